"""The send API a simulation uses to stream its fields to the server.

    with Client({"temperature": ("float32", (nx, ny))}) as client:
        for t in range(steps):
            client.send("temperature", t, solve(client.parameters))

The launcher puts the simulation id, parameters, server endpoint, secret
token and security level in the environment; the client handshakes with rank
0, connects one PUSH socket per server rank, declares its fields on each, and
routes every step to the rank that owns it. In an MPI-parallel simulation,
pass the communicator: each rank sends its own slice (stacked on axis 0 in
rank order by the server). Every socket carries the study's credentials
(:func:`melissa_dl.security.configure_client`); a server that refuses them
raises ``HandshakeRefused`` at once.

``send`` copies the array into ZeroMQ's queue, so the simulation may overwrite
it at once; it blocks when the queue is full (back-pressure) for as long as
the server lives, however long that is, and raises ``ServerUnreachable`` once
the rank it sends to has been unreachable for ``client_timeout`` seconds. A
socket monitor tells the client whether its connection is up: a server that
exits or is killed closes it at once, and a silent one (a frozen process, a
lost node) is dropped by the heartbeats that every server socket sends while
it lives, also while it does not read (:mod:`melissa_dl.security`). No send
timeout: back-pressure is not death (a blocked send wakes every ``WAKE_MS`` to
look at its connection, so a refusal or ``client_timeout`` is noticed up to
that much later).

``finalize`` tells each server rank how many steps it should hold, then waits
until ZeroMQ has handed every queued frame to the network (a socket closed
without linger silently drops its last frames), again for as long as the
server lives. ZeroMQ shows nothing of a closed socket, so during that wait the
client watches each server rank through a probe connection; should one be
unreachable for ``client_timeout``, ``finalize`` raises ``ServerUnreachable``
and abandons the context to the end of the process (libzmq cannot cut a
lingering close short).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time
from types import TracebackType
from typing import Any, Mapping, Sequence

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from melissa_dl.errors import ClientError, HandshakeRefused, ServerUnreachable
from melissa_dl.mpi import Comm
from melissa_dl.protocol import (
    PROTOCOL_VERSION,
    Header,
    Kind,
    encode_json,
    owner_rank,
    simulation_key,
)
from melissa_dl.security import ENV_SECURITY, configure_client, describe_handshake_failure

logger = logging.getLogger(__name__)

ENV_SERVER = "MELISSA_SERVER"
ENV_TOKEN = "MELISSA_TOKEN"
ENV_SIMULATION_ID = "MELISSA_SIMULATION_ID"
ENV_ATTEMPT = "MELISSA_ATTEMPT"
ENV_PARAMETERS = "MELISSA_PARAMETERS"
ENV_PARAMETER_NAMES = "MELISSA_PARAMETER_NAMES"
ENV_CLIENT_TIMEOUT = "MELISSA_CLIENT_TIMEOUT"
ENV_SEND_QUEUE_BYTES = "MELISSA_SEND_QUEUE_BYTES"

WAKE_MS = 1000  # a blocked send looks at its connection at least this often
FLUSH_GRACE = 0.2  # seconds a finalize waits for its frames to leave before it starts probing the server
PROBE_SETTLE = 1.0  # seconds a probe may take to finish its handshake once the frames are out

_abandoned: list[zmq.Context] = []  # contexts whose close waits for a dead server: never collected, never termed


def _require(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name)
    if value is None:
        raise ClientError(f"{name} is not set: start this simulation through melissa-server's launcher")
    return value


class _Link:
    """A client socket with the study's credentials, and what its monitor says of its connection."""

    EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)

    def __init__(self, context: zmq.Context, kind: int, endpoint: str, environ: Mapping[str, str]) -> None:
        self.endpoint = endpoint
        self.socket = context.socket(kind)
        try:
            self.level = configure_client(self.socket, environ)
            self.monitor = self.socket.get_monitor_socket(self.EVENTS)
        except BaseException:
            self.socket.close(linger=0)
            raise
        self.up = False
        self.since = time.monotonic()  # of the last change between up and down
        self.refused: str | None = None  # the server refused our credentials or mechanism: no retry will help
        self.failed_handshakes = 0  # closed midway, as a CURVE server does with a client of another server key

    def update(self) -> None:
        """Take the monitor's pending events."""
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up, self.since = True, time.monotonic()
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                self.refused = describe_handshake_failure(kind, event["value"])
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self.failed_handshakes += 1
            elif self.up:  # disconnected: the server closed, died, or stopped sending heartbeats
                self.up, self.since = False, time.monotonic()

    def down_for(self) -> float:
        return 0.0 if self.up else time.monotonic() - self.since

    def close(self, linger_ms: int) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=linger_ms)


class Client:
    """One client rank's connection to the server for one simulation."""

    def __init__(
        self,
        fields: Mapping[str, tuple[Any, Sequence[int]]],
        comm: Comm = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.simulation_id = int(_require(env, ENV_SIMULATION_ID))
        self.attempt = int(env.get(ENV_ATTEMPT, "0"))
        self.parameters = np.asarray(json.loads(_require(env, ENV_PARAMETERS)), dtype=np.float64)
        names = json.loads(env.get(ENV_PARAMETER_NAMES, "[]"))
        self.named_parameters: dict[str, float] = dict(zip(names, self.parameters.tolist()))
        """The parameters by the names ``study.parameters`` gives them (``parameters`` in that order)."""
        self._timeout = float(env.get(ENV_CLIENT_TIMEOUT, "300"))
        queue_bytes = int(env.get(ENV_SEND_QUEUE_BYTES, str(64 << 20)))
        self.rank, self.size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
        self._layouts = {name: (np.dtype(dtype).name, tuple(int(n) for n in shape)) for name, (dtype, shape) in fields.items()}
        token = _require(env, ENV_TOKEN)
        self._environ = dict(env)
        self._context = zmq.Context()
        self._links: list[_Link] = []
        try:
            reply = self._handshake(_require(env, ENV_SERVER), token)
            self._key = simulation_key(bytes.fromhex(token), self.simulation_id, self.attempt)
            self._field_ids = {name: i for i, name in enumerate(reply["fields"])}
            self._bind_simulation = bool(reply["bind_simulation"])
            largest = max([1, *(int(np.prod(s)) * np.dtype(d).itemsize for d, s in self._layouts.values())])
            for endpoint in reply["endpoints"]:
                link = _Link(self._context, zmq.PUSH, endpoint, self._environ)
                self._links.append(link)
                link.socket.setsockopt(zmq.SNDHWM, max(2, queue_bytes // largest))
                link.socket.setsockopt(zmq.SNDTIMEO, WAKE_MS)  # a send blocked by a full queue wakes this often
                link.socket.connect(endpoint)
            self._steps: list[set[int]] = [set() for _ in self._links]
            declaration = encode_json({"fields": {n: [d, list(s)] for n, (d, s) in self._layouts.items()}})
            for rank in range(len(self._links)):
                self._send(rank, self._header(Kind.DECLARE, 0, 0, "uint8", (), len(declaration)), declaration)
        except BaseException:
            self.close(linger=0)
            raise

    def _handshake(self, endpoint: str, token: str) -> dict[str, Any]:
        hello = {
            "protocol": PROTOCOL_VERSION,
            "token": token,
            "simulation_id": self.simulation_id,
            "attempt": self.attempt,
            "client_rank": self.rank,
            "client_size": self.size,
            "fields": {n: [d, list(s)] for n, (d, s) in self._layouts.items()},
        }
        link = _Link(self._context, zmq.REQ, endpoint, self._environ)
        try:
            link.socket.connect(endpoint)
            link.socket.send(encode_json(hello))
            poller = zmq.Poller()
            poller.register(link.socket, zmq.POLLIN)
            poller.register(link.monitor, zmq.POLLIN)
            deadline = time.monotonic() + self._timeout
            while True:
                link.update()
                self._check_refused(link)
                left = deadline - time.monotonic()
                if left <= 0:
                    hint = (f" ({link.failed_handshakes} ZeroMQ handshakes with it failed: another security level "
                            f"or CURVE server key than {ENV_SECURITY}={link.level}?)" if link.failed_handshakes else "")
                    raise ServerUnreachable(f"no handshake answer from {endpoint} within {self._timeout:g} s{hint}")
                if link.socket in dict(poller.poll(int(left * 1000) + 1)):
                    reply = json.loads(link.socket.recv())
                    break
        finally:
            link.close(linger_ms=0)
        if not reply.get("ok"):
            raise HandshakeRefused(f"simulation {self.simulation_id}: {reply.get('error')}")
        return reply

    def _check_refused(self, link: _Link) -> None:
        if link.refused is not None:
            raise HandshakeRefused(
                f"simulation {self.simulation_id}: {link.endpoint}: {link.refused}: this simulation's credentials "
                f"({ENV_SECURITY}={link.level}) are not the server's (a stale environment, or another study's server?)"
            )

    def _check_alive(self, link: _Link, rank: int) -> float:
        """Raise if the server refused us or has been unreachable for the client timeout; else the seconds left."""
        link.update()
        self._check_refused(link)
        left = self._timeout - link.down_for()
        if left <= 0:
            raise ServerUnreachable(f"simulation {self.simulation_id}: server rank {rank} ({link.endpoint}) has been "
                                    f"unreachable for {self._timeout:g} s (no connection, no heartbeat)")
        return left

    def _header(self, kind: Kind, time_step: int, field_id: int, dtype: str, shape: tuple[int, ...], size: int) -> bytes:
        return Header(
            kind, self._key, self.simulation_id, self.attempt, time_step, self.rank, self.size, field_id, dtype, shape, size
        ).pack()

    def _send(self, rank: int, header: bytes, payload: Any) -> None:
        """Queue a message for a server rank; while the queue is full, wait as long as that rank lives."""
        link = self._links[rank]
        while True:
            try:  # waits inside ZeroMQ for at most WAKE_MS (SNDTIMEO): no Python loop per wake-up
                link.socket.send(header, zmq.SNDMORE)
                break
            except zmq.Again:
                self._check_alive(link, rank)
        link.socket.send(payload)  # a message's first part taken, ZeroMQ takes the rest: its queue counts messages

    def send(self, field: str, time_step: int, array: Any) -> None:
        """Send this rank's slice of ``field`` at ``time_step`` (an integer index >= 0)."""
        layout = self._layouts.get(field)
        if layout is None:
            raise ClientError(f"field '{field}' was not declared (declared: {sorted(self._layouts)})")
        if not 0 <= time_step < 1 << 32:
            raise ClientError(f"field '{field}': time step {time_step} is not in [0, 2**32)")
        data = np.ascontiguousarray(array).reshape(np.shape(array))  # keeps 0-d arrays 0-d
        if (data.dtype.name, data.shape) != layout:
            raise ClientError(
                f"field '{field}': got {data.dtype.name}{list(data.shape)}, declared {layout[0]}{list(layout[1])}"
            )
        rank = owner_rank(self.simulation_id, time_step, len(self._links), self._bind_simulation)
        header = self._header(Kind.DATA, time_step, self._field_ids[field], layout[0], layout[1], data.nbytes)
        self._send(rank, header, data)
        self._steps[rank].add(time_step)

    def finalize(self) -> None:
        """Announce the steps sent to each server rank, flush and close."""
        try:
            for rank, steps in enumerate(self._steps):
                body = encode_json({"steps": len(steps)})
                self._send(rank, self._header(Kind.FINALIZE, 0, 0, "uint8", (), len(body)), body)
        except BaseException:
            self.close(linger=0)
            raise
        self.close()

    def close(self, linger: float | None = None) -> None:
        """Close the sockets: ``linger=None`` waits until every queued frame has left, for as long as the
        server lives; a number of seconds bounds the wait (0 drops what is queued)."""
        endpoints = [link.endpoint for link in self._links]
        for link in self._links:
            link.close(linger_ms=-1 if linger is None else int(linger * 1000))
        self._links = []
        if linger is not None:
            self._context.term()
            return
        done = threading.Event()

        def term() -> None:
            self._context.term()
            done.set()

        closer = threading.Thread(target=term, name=f"flush-{self.simulation_id}", daemon=True)
        closer.start()
        if not done.wait(FLUSH_GRACE):
            self._watch_flush(done, endpoints)
        closer.join()

    def _watch_flush(self, done: threading.Event, endpoints: list[str]) -> None:
        """While the closed sockets linger, watch every server rank through a probe; give up on a dead one."""
        probes = zmq.Context()
        links: list[_Link] = []
        try:
            for endpoint in endpoints:
                links.append(_Link(probes, zmq.PUSH, endpoint, self._environ))
                links[-1].socket.connect(endpoint)
            while not done.wait(0.05):
                for rank, link in enumerate(links):
                    try:
                        self._check_alive(link, rank)
                    except (ServerUnreachable, HandshakeRefused) as error:
                        _abandoned.append(self._context)  # its term never returns: keep it from the collector
                        raise ServerUnreachable(f"queued frames not delivered: {error}") from None
            deadline = time.monotonic() + PROBE_SETTLE
            for link in links:  # a probe closed amid its handshake would be counted as a refusal (noauth)
                while not link.up and link.refused is None and time.monotonic() < deadline:
                    link.monitor.poll(10)
                    link.update()
        finally:
            for link in links:
                link.close(linger_ms=0)
            probes.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if kind is None:
            self.finalize()
        else:  # no finalize: the attempt will not count, and the user's exception must surface unchanged
            self.close(linger=0)
