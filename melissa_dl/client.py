"""The send API a simulation uses to stream its fields to the server.

    with Client({"temperature": ("float32", (nx, ny))}) as client:
        for t in range(steps):
            client.send("temperature", t, solve(client.parameters))

The launcher puts the simulation id, parameters, server endpoint and secret
token in the environment; the client handshakes with rank 0, connects one PUSH
socket per server rank, declares its fields on each, and routes every step to
the rank that owns it. In an MPI-parallel simulation, pass the communicator:
each rank sends its own slice (stacked on axis 0 in rank order by the server).

``send`` copies the array into ZeroMQ's queue, so the simulation may overwrite
it at once; it blocks when the queue is full (back-pressure) and raises
``ServerUnreachable`` when the server accepts nothing for ``client_timeout``
seconds. ``finalize`` tells each server rank how many steps it should hold,
then waits (bounded) until ZeroMQ has handed every queued frame to the network:
a socket closed without linger silently drops its last frames.
"""
from __future__ import annotations

import json
import logging
import os
import time
from types import TracebackType
from typing import Any, Mapping, Sequence

import numpy as np
import zmq

from melissa_dl.errors import ClientError, HandshakeRefused, ServerUnreachable
from melissa_dl.protocol import (
    PROTOCOL_VERSION,
    Header,
    Kind,
    encode_json,
    owner_rank,
    simulation_key,
)

logger = logging.getLogger(__name__)

ENV_SERVER = "MELISSA_SERVER"
ENV_TOKEN = "MELISSA_TOKEN"
ENV_SIMULATION_ID = "MELISSA_SIMULATION_ID"
ENV_ATTEMPT = "MELISSA_ATTEMPT"
ENV_PARAMETERS = "MELISSA_PARAMETERS"
ENV_CLIENT_TIMEOUT = "MELISSA_CLIENT_TIMEOUT"
ENV_SEND_QUEUE_BYTES = "MELISSA_SEND_QUEUE_BYTES"


def _require(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name)
    if value is None:
        raise ClientError(f"{name} is not set: start this simulation through melissa-server's launcher")
    return value


class Client:
    """One client rank's connection to the server for one simulation."""

    def __init__(
        self,
        fields: Mapping[str, tuple[Any, Sequence[int]]],
        comm: Any = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.simulation_id = int(_require(env, ENV_SIMULATION_ID))
        self.attempt = int(env.get(ENV_ATTEMPT, "0"))
        self.parameters = np.asarray(json.loads(_require(env, ENV_PARAMETERS)), dtype=np.float64)
        self._timeout = float(env.get(ENV_CLIENT_TIMEOUT, "300"))
        queue_bytes = int(env.get(ENV_SEND_QUEUE_BYTES, str(64 << 20)))
        self.rank, self.size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
        self._layouts = {name: (np.dtype(dtype).name, tuple(int(n) for n in shape)) for name, (dtype, shape) in fields.items()}
        token = _require(env, ENV_TOKEN)
        self._context = zmq.Context()
        self._sockets: list[zmq.Socket] = []
        try:
            reply = self._handshake(_require(env, ENV_SERVER), token)
            self._key = simulation_key(bytes.fromhex(token), self.simulation_id, self.attempt)
            self._field_ids = {name: i for i, name in enumerate(reply["fields"])}
            self._bind_simulation = bool(reply["bind_simulation"])
            largest = max([1, *(int(np.prod(s)) * np.dtype(d).itemsize for d, s in self._layouts.values())])
            for endpoint in reply["endpoints"]:
                socket = self._context.socket(zmq.PUSH)
                socket.setsockopt(zmq.SNDHWM, max(2, queue_bytes // largest))
                socket.setsockopt(zmq.SNDTIMEO, int(self._timeout * 1000))
                socket.connect(endpoint)
                self._sockets.append(socket)
            self._steps: list[set[int]] = [set() for _ in self._sockets]
            declaration = encode_json({"fields": {n: [d, list(s)] for n, (d, s) in self._layouts.items()}})
            for socket in self._sockets:
                self._send(socket, self._header(Kind.DECLARE, 0, 0, "uint8", (), len(declaration)), declaration)
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
        socket = self._context.socket(zmq.REQ)
        try:
            socket.connect(endpoint)
            socket.send(encode_json(hello))
            if not socket.poll(int(self._timeout * 1000)):
                raise ServerUnreachable(f"no handshake answer from {endpoint} within {self._timeout:g} s")
            reply = json.loads(socket.recv())
        finally:
            socket.close(linger=0)
        if not reply.get("ok"):
            raise HandshakeRefused(f"simulation {self.simulation_id}: {reply.get('error')}")
        return reply

    def _header(self, kind: Kind, time_step: int, field_id: int, dtype: str, shape: tuple[int, ...], size: int) -> bytes:
        return Header(
            kind, self._key, self.simulation_id, self.attempt, time_step, self.rank, self.size, field_id, dtype, shape, size
        ).pack()

    def _send(self, socket: zmq.Socket, header: bytes, payload: Any) -> None:
        try:
            socket.send_multipart([header, payload])
        except zmq.Again:
            raise ServerUnreachable(
                f"simulation {self.simulation_id}: the server accepted no data for {self._timeout:g} s"
            ) from None

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
        rank = owner_rank(self.simulation_id, time_step, len(self._sockets), self._bind_simulation)
        header = self._header(Kind.DATA, time_step, self._field_ids[field], layout[0], layout[1], data.nbytes)
        self._send(self._sockets[rank], header, data)
        self._steps[rank].add(time_step)

    def finalize(self) -> None:
        """Announce the steps sent to each server rank, flush and close."""
        try:
            for socket, steps in zip(self._sockets, self._steps):
                body = encode_json({"steps": len(steps)})
                self._send(socket, self._header(Kind.FINALIZE, 0, 0, "uint8", (), len(body)), body)
        except BaseException:
            self.close(linger=0)
            raise
        self.close()

    def close(self, linger: float | None = None) -> None:
        """Close the sockets, waiting at most ``linger`` seconds (default: the client timeout) for queued frames."""
        linger = self._timeout if linger is None else linger
        for socket in self._sockets:
            socket.close(linger=int(linger * 1000))
        self._sockets = []
        start = time.monotonic()
        self._context.term()
        if linger > 0 and time.monotonic() - start >= linger:
            raise ServerUnreachable(f"simulation {self.simulation_id}: queued frames not delivered within {linger:g} s")

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if kind is None:
            self.finalize()
        else:  # no finalize: the attempt will not count, and the user's exception must surface unchanged
            self.close(linger=0)
