"""The send API a simulation uses to stream its fields to the server.

    with Client({"temperature": ("float32", (nx, ny))}) as client:
        for t in range(steps):
            client.send("temperature", t, solve(client.parameters))

The launcher puts the simulation id, parameters, server endpoint, secret
token and security level in the environment; the client handshakes with rank
0, connects one PUSH socket per server rank, declares its fields on each, and
routes every step to the rank that owns it. In an MPI-parallel simulation,
pass the communicator: each rank sends its own slice (stacked on axis 0 in
rank order by the server), or, for a field given a third element, its block
of the global array (:mod:`melissa_dl.wire.blocks`)::

    pressure = ("float32", (50, 51), Block(start=(0, 50), global_shape=(101, 101)))
    with Client({"pressure": pressure}, comm) as client:
        client.send("pressure", t, p[1:-1, 1:-1])  # the interior, without its halo: any layout, no copy needed

Every socket carries the study's credentials
(:func:`melissa_dl.wire.security.configure_client`); a server that refuses them
raises ``HandshakeRefused`` at once.

``send`` copies the array into ZeroMQ's queue, so the simulation may overwrite
it at once (a slice over :data:`~melissa_dl.wire.protocol.PART_BYTES` goes as
several messages, one per part); it blocks when the queue is full (back-pressure) for as long as
the server lives, however long that is, and raises ``ServerUnreachable`` once
the rank it sends to has been unreachable for ``client_timeout`` seconds. The
client knows a rank lives from two sources: a socket monitor shows its
connection (a server that exits or is killed closes it at once), and the rank's
delivery service (:mod:`melissa_dl.ingest.delivery`), which a blocked send asks every
:func:`~melissa_dl.wire.protocol.keepalive` seconds, answers however full the
buffer is; a frozen process or a lost node answers nothing (a question lost with
its connection, or unanswered for 1.5 keepalives, is asked again: no simulation
fails for a lost control message). No send timeout:
back-pressure is not death (a blocked send wakes every ``WAKE_MS`` to look at
its connection, so a refusal or ``client_timeout`` is noticed up to that much
later).

``finalize`` tells each server rank how many steps it should hold, then waits
until every rank's delivery service confirms that it has read every message
sent to it, again for as long as the server lives: a client that exits has
lost nothing, however far behind the server is (a process that exits with
frames still in its kernel's socket buffer may have them reset away). A
FINALIZE lost with a broken connection is sent again; messages lost with it
cannot be, and ``finalize`` raises ``ServerUnreachable`` saying how many, so
that the study relaunches the simulation.
"""

from __future__ import annotations

import contextlib
import json
import logging
import operator
import os
import secrets
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import zmq

from melissa_dl.config.limits import CLIENT_TIMEOUT_RANGE, SEND_QUEUE_BYTES_RANGE
from melissa_dl.errors import ClientError, HandshakeRefused, PredictionRefused, ProtocolError, ServerUnreachable
from melissa_dl.runtime.mpi import Comm
from melissa_dl.wire.blocks import Block
from melissa_dl.wire.predictions import SERVING_FILE, Prediction, count_questions, declared, pack, unpack
from melissa_dl.wire.protocol import (
    PART_BYTES,
    PROTOCOL_VERSION,
    Header,
    Kind,
    Route,
    encode_json,
    keepalive,
    parts,
    simulation_key,
)
from melissa_dl.wire.security import (
    ENV_SECURITY,
    Security,
    configure_client,
    describe_handshake_failure,
    monitor_event,
)

logger = logging.getLogger(__name__)

ENV_SERVER = "MELISSA_SERVER"
ENV_TOKEN = "MELISSA_TOKEN"
ENV_SIMULATION_ID = "MELISSA_SIMULATION_ID"
ENV_ATTEMPT = "MELISSA_ATTEMPT"
ENV_PARAMETERS = "MELISSA_PARAMETERS"
ENV_PARAMETER_NAMES = "MELISSA_PARAMETER_NAMES"
ENV_CLIENT_TIMEOUT = "MELISSA_CLIENT_TIMEOUT"
ENV_SEND_QUEUE_BYTES = "MELISSA_SEND_QUEUE_BYTES"
ENV_SERVING = "MELISSA_SERVING"  # a serving.json of melissa-server --serve, for a Predictor (and the C library)
ENV_WORKER = "MELISSA_WORKER"  # launcher.workers.ENV_WORKER: a persistent worker's slot and start

WAKE_MS = 1000  # a blocked send looks at its connection at least this often
ANSWER_POLL_MS = 100  # how often a finalize waiting for the ranks' answers looks at its connections
REASK = 1.5  # keepalives after which an unanswered question to a delivery service is asked again
WORKER_POLL = 0.01  # seconds between two looks of a worker's other ranks at whether rank 0 has its next simulation
PREDICT_QUEUE = 2  # requests a prediction link queues while its rank is unreachable: more get no answer at once


def _block(name: str, field: tuple[Any, ...]) -> Block | None:
    """A field's block, if its declaration gives one (this client sends every array in C order)."""
    if len(field) == 2:
        return None
    block = field[2]
    if not isinstance(block, Block) or block.order != "C":
        raise ClientError(
            f"field '{name}': the third element must be a Block(start, global_shape), got {block!r} (an array of any "
            "layout, a Fortran-ordered one too, is sent as its values in C order)"
        )
    try:  # numpy's integers too (a decomposition computed with numpy), which JSON does not take
        return Block(
            tuple(operator.index(n) for n in block.start), tuple(operator.index(n) for n in block.global_shape)
        )
    except TypeError:
        raise ClientError(f"field '{name}': a block's start and global shape are integers, got {block!r}") from None


def _require(environ: Mapping[str, str], name: str) -> str:
    value = environ.get(name)
    if value is None:
        raise ClientError(f"{name} is not set: start this simulation through melissa-server's launcher")
    return value


def _number(
    environ: Mapping[str, str], name: str, default: float, bounds: tuple[float, float], integer: bool = False
) -> float:
    """A number the launcher put in the environment, refused in one line outside what the clients accept (the
    configuration checks the same ``bounds``; the C library's ``env_number``), rather than failing deep in ZeroMQ."""
    text = environ.get(name)
    try:
        value = float(default if text is None else text)
    except ValueError:
        value = float("nan")
    if not (bounds[0] <= value <= bounds[1] and (value.is_integer() or not integer)):
        kind = "an integer" if integer else "a number"
        raise ClientError(f"{name}={text!r} is not {kind} in [{bounds[0]:g}, {bounds[1]:g}]")
    return value


class _Link:
    """A client socket with the study's credentials, and what its monitor says of its connection."""

    EVENTS = (
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_DISCONNECTED
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )

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
        self.drops = 0  # connections lost: what was in flight on them may be lost

    def update(self) -> None:
        """Take the monitor's pending events."""
        while self.monitor.poll(0):
            kind, value = monitor_event(self.monitor)
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up, self.since = True, time.monotonic()
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
                self.refused = describe_handshake_failure(kind, value)
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self.failed_handshakes += 1
            elif self.up:  # disconnected: the server closed or died
                self.up, self.since = False, time.monotonic()
                self.drops += 1

    def down_for(self) -> float:
        return 0.0 if self.up else time.monotonic() - self.since

    def close(self) -> None:
        self.socket.disable_monitor()
        self.monitor.close(linger=0)
        self.socket.close(linger=0)


class _Questions:
    """A server rank's delivery service, asked over a DEALER link one question at a time.

    A question is lost with the connection that carried it (the rank's answer goes to a peer that is gone) or, on
    a live connection, when the rank's full queue made it drop the answer: it is asked again when the link's
    drop count grew since it was sent, or when it has been silent for ``REASK`` keepalives (the service answers
    every question within one). The rank answers a repeated question as the first. Silence is counted from the
    first question still unanswered, so that a rank that answers nothing is still taken for dead at the timeout.
    """

    def __init__(self, link: _Link, keepalive: float) -> None:
        self.link = link
        self.keepalive = keepalive
        self.asked: float | None = None  # when the first question still unanswered was sent
        self.last_asked = time.monotonic()  # when a question was last sent (or the link was opened)
        self.drops = 0  # the link's drop count when a question was last sent

    def ask(self, question: bytes, every: float = 0.0) -> None:
        """Send ``question`` if none is open and ``every`` seconds have passed since the last one, or if the open
        one was lost. Not sent if the link's queue is full: the rank is then unreachable, which silence tells."""
        self.link.update()
        since = time.monotonic() - self.last_asked
        if self.asked is None:
            due = since >= every
        else:
            due = self.link.drops > self.drops or since >= REASK * self.keepalive
        if due and _offer(self.link.socket, question):
            self.last_asked, self.drops = time.monotonic(), self.link.drops
            self.asked = self.asked or self.last_asked

    def answer(self) -> dict[str, Any] | None:
        """The answer to the open question, if it came."""
        if not self.link.socket.poll(0):
            return None
        reply = json.loads(self.link.socket.recv())
        self.asked = None
        return reply

    def silent_for(self) -> float:
        """Seconds the first open question has waited for its answer (0 if none is open)."""
        return 0.0 if self.asked is None else time.monotonic() - self.asked


def _handshake_link(context: zmq.Context, endpoint: str, environ: Mapping[str, str]) -> _Link:
    """A REQ link to rank 0's handshake service, on which a request may be sent again (only the answer to the
    latest counts)."""
    link = _Link(context, zmq.REQ, endpoint, environ)
    link.socket.setsockopt(zmq.REQ_RELAXED, 1)
    link.socket.setsockopt(zmq.REQ_CORRELATE, 1)
    link.socket.connect(endpoint)
    return link


def _ask(link: _Link, request: dict[str, Any], timeout: float, who: str) -> dict[str, Any]:
    """Send ``request`` to the handshake service and return its answer; sent again when the connection that
    carried it, or its answer, was lost. ``HandshakeRefused`` if the service refuses it, ``ServerUnreachable``
    without an answer for ``timeout`` seconds.

    Never a blocking send: a server that refuses the credentials in the ZeroMQ handshake leaves the socket
    without a connection, and a send would then wait for ever. That refusal can come before the first send
    (on a busy machine), so a send that finds no connection is tried again after the monitor's next event."""
    message = encode_json(request)
    poller = zmq.Poller()
    poller.register(link.socket, zmq.POLLIN)
    poller.register(link.monitor, zmq.POLLIN)
    deadline = time.monotonic() + timeout
    drops, sent = link.drops, False
    while True:
        link.update()
        _check_refused(link, who)
        if link.drops > drops or not sent:
            drops, sent = link.drops, _offer(link.socket, message)
        left = deadline - time.monotonic()
        if left <= 0:
            hint = (
                f" ({link.failed_handshakes} ZeroMQ handshakes with it failed: another security level "
                f"or CURVE server key than {ENV_SECURITY}={link.level}?)"
                if link.failed_handshakes
                else ""
            )
            raise ServerUnreachable(f"no handshake answer from {link.endpoint} within {timeout:g} s{hint}")
        if link.socket in dict(poller.poll(int(left * 1000) + 1)):
            reply: dict[str, Any] = json.loads(link.socket.recv())
            if not reply.get("ok"):
                raise HandshakeRefused(f"{who}: {reply.get('error')}")
            return reply


def _offer(socket: zmq.Socket, message: bytes) -> bool:
    """Whether ``message`` was queued: False when no connection can take it now."""
    try:
        socket.send(message, zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


def _check_refused(link: _Link, who: str) -> None:
    if link.refused is not None:
        raise HandshakeRefused(
            f"{who}: {link.endpoint}: {link.refused}: this simulation's credentials "
            f"({ENV_SECURITY}={link.level}) are not the server's (a stale environment, or another study's server?)"
        )


def _next_simulation(environ: Mapping[str, str], comm: Comm | None, last: str | None) -> dict[str, str] | None:
    """What this persistent worker runs next, on every rank of ``comm`` (rank 0 asks, once every rank is done
    with the last one, whose end its asking tells): its simulation's environment, or None once the study is over;
    rank 0's error is raised on every rank. The other ranks wait without spinning a core."""
    if comm is None:
        return _ask_next(environ, last)
    _polled_barrier(comm)
    answer: dict[str, str] | Exception | None = None
    if comm.Get_rank() == 0:
        try:
            answer = _ask_next(environ, last)
        except Exception as error:  # every rank raises it, rather than wait for an answer that will not come
            answer = error
    _polled_barrier(comm)
    answer = comm.bcast(answer)
    if isinstance(answer, Exception):
        raise answer
    return answer


def _polled_barrier(comm: Comm) -> None:
    """A barrier that sleeps between looks: MPI's own spins a core for as long as rank 0 waits for the server."""
    arrived = comm.Ibarrier()
    while not arrived.Test():
        time.sleep(WORKER_POLL)


def _ask_next(environ: Mapping[str, str], last: str | None) -> dict[str, str] | None:
    """Ask rank 0's handshake service, until it hands this worker a simulation or says the study is over
    (``last``: the simulation and attempt it was last told)."""
    worker = _require(environ, ENV_WORKER)
    request = {"protocol": PROTOCOL_VERSION, "token": _require(environ, ENV_TOKEN), "worker": worker, "last": last}
    context = zmq.Context()
    link = _handshake_link(context, _require(environ, ENV_SERVER), environ)
    try:
        while True:
            reply = _ask(
                link, request, _number(environ, ENV_CLIENT_TIMEOUT, 300, CLIENT_TIMEOUT_RANGE), f"worker {worker}"
            )
            if "env" in reply:
                return {str(name): str(value) for name, value in reply["env"].items()}
            if reply.get("over"):
                return None
            time.sleep(float(reply["wait"]))
    finally:
        link.close()
        context.term()


class _Predictor:
    """The server ranks' prediction services (:mod:`melissa_dl.wire.predictions`), asked in turn from rank
    ``first`` (a simulation's id, a process's: clients start on different ranks), one request at a time; a rank's
    link is opened by the first question to it. ``who`` begins its errors."""

    def __init__(
        self, guide: dict[str, Any], context: zmq.Context, environ: Mapping[str, str], first: int, who: str
    ) -> None:
        self.endpoints: list[str] = guide["endpoints"]
        self.inputs = declared(guide["inputs"])
        self.max_batch, self.deadline = int(guide["max_batch"]), float(guide["deadline"])
        self.links: dict[int, _Link] = {}
        self.asked = 0  # requests sent: the last one's id
        self._context, self._environ, self._first, self._who = context, environ, first, who

    def ask(self, inputs: Mapping[str, Any], deadline: float | None) -> Prediction:
        arrays = {name: np.ascontiguousarray(array) for name, array in inputs.items()}
        try:
            count_questions(arrays, self.inputs, self.max_batch, f"{self._who}: predict")
        except ProtocolError as error:
            raise ClientError(str(error)) from None
        rank = (self._first + self.asked) % len(self.endpoints)
        self.asked += 1
        link = self.links.get(rank)
        if link is None:
            link = self.links[rank] = _Link(self._context, zmq.DEALER, self.endpoints[rank], self._environ)
            link.socket.setsockopt(zmq.SNDHWM, PREDICT_QUEUE)
            link.socket.connect(link.endpoint)
        if not _offer(link.socket, pack({"id": self.asked}, arrays)):
            return Prediction("no_answer")
        until = time.monotonic() + (self.deadline if deadline is None else deadline)
        return self._answer(link, self.asked, until, f"{self._who}: server rank {rank}")

    @staticmethod
    def _answer(link: _Link, ident: int, until: float, who: str) -> Prediction:
        """The answer to request ``ident``, if it comes before ``until`` (answers to requests given up on are
        dropped)."""
        while (left := until - time.monotonic()) > 0:
            link.update()
            _check_refused(link, who)
            if not link.socket.poll(min(int(left * 1000) + 1, ANSWER_POLL_MS)):
                continue
            header, arrays = unpack(link.socket.recv(), "prediction answer")
            if header["id"] != ident:
                continue
            if header.get("status") == "refused":
                raise PredictionRefused(f"{who}: {header.get('error')}")
            outputs = {name: array.copy() for name, array in arrays.items()}  # their own memory, writable
            return Prediction(str(header["status"]), int(header.get("version", 0)), outputs)
        return Prediction("no_answer")

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.links = {}


class Client:
    """One client rank's connection to the server for one simulation: what a simulation streams its fields with.

    The constructor reads what the launcher put in the environment (this simulation's id, attempt and parameters,
    the server's endpoint, the study's token and security level), handshakes with server rank 0, connects to every
    server rank and declares the fields there; it returns once the server has admitted this client. Use it as a
    context manager: leaving the ``with`` block normally calls ``finalize``; leaving it with an exception calls only
    ``close``, so that the attempt does not count and the study runs the simulation again. A persistent worker gets
    its clients from ``Client.simulations`` instead.

    ```python
    with Client({"temperature": ("float32", (nx, ny))}) as client:
        solver = MySolver(*client.parameters)
        for t in range(steps):
            client.send("temperature", t, solver.step())
    ```

    :param fields: every field of ``study.fields``, by name: ``(dtype, shape)``, the dtype (float16/32/64,
        int8/16/32/64, uint8) and the shape of this rank's slice, or ``(dtype, shape, Block(start, global_shape))``
        for this rank's block of a field split in blocks. Every rank declares every field of the study.
    :param comm: the mpi4py communicator of an MPI-parallel simulation, of ``launcher.client_ranks`` ranks: each rank
        sends its own slice (the server stacks them along axis 0 in rank order) or its block. None: one process.
    :param environ: the launcher's variables, where they are not ``os.environ`` (a test, a wrapper that sets them).
    :raises ClientError: a variable the launcher sets is missing or out of its bounds (a simulation started by hand,
        not by melissa-server's launcher), or a field's third element is not a ``Block`` of integers.
    :raises HandshakeRefused: the server refused this client, and the message says why: credentials that are not the
        study's (a stale environment, another study's server), a field the study does not have or one it lacks, a
        dtype or shape that is not the study's, blocks that overlap or leave a gap, a ``comm`` whose size is not
        ``launcher.client_ranks``, an attempt that is no longer the running one.
    :raises ServerUnreachable: the handshake got no answer within ``launcher.client_timeout`` seconds.
    :ivar simulation_id: this simulation's index in the study, from 0 (``MELISSA_SIMULATION_ID``).
    :vartype simulation_id: int
    :ivar attempt: which launch of this simulation this is: 0 on the first, 1 on its first relaunch, ...
        (``MELISSA_ATTEMPT``).
    :vartype attempt: int
    :ivar parameters: this simulation's parameter set, a float64 array in the order of ``study.parameters``
        (``MELISSA_PARAMETERS``).
    :vartype parameters: np.ndarray
    :ivar named_parameters: the same parameters by the names ``study.parameters`` gives them
        (``client.named_parameters["diffusivity"]``); empty where the launcher passes no names.
    :ivar rank: this process's rank in ``comm``; 0 without one.
    :vartype rank: int
    :ivar size: the number of ranks of ``comm``; 1 without one.
    :vartype size: int
    """

    def __init__(
        self,
        fields: Mapping[str, tuple[Any, Sequence[int]] | tuple[Any, Sequence[int], Block]],
        comm: Comm | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.simulation_id = int(_require(env, ENV_SIMULATION_ID))
        self.attempt = int(env.get(ENV_ATTEMPT, "0"))
        self.parameters = np.asarray(json.loads(_require(env, ENV_PARAMETERS)), dtype=np.float64)
        names = json.loads(env.get(ENV_PARAMETER_NAMES, "[]"))
        self.named_parameters: dict[str, float] = dict(zip(names, self.parameters.tolist()))
        self._timeout = _number(env, ENV_CLIENT_TIMEOUT, 300, CLIENT_TIMEOUT_RANGE)
        queue_bytes = int(_number(env, ENV_SEND_QUEUE_BYTES, 64 << 20, SEND_QUEUE_BYTES_RANGE, integer=True))
        self.rank, self.size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
        self._layouts = {
            name: (np.dtype(field[0]).name, tuple(int(n) for n in field[1])) for name, field in fields.items()
        }
        self._blocks = {name: _block(name, field) for name, field in fields.items()}
        token = _require(env, ENV_TOKEN)
        self._environ = dict(env)
        self._context = zmq.Context()
        self._links: list[_Link] = []
        self._questions: list[_Questions] = []
        self._predictor: _Predictor | None = None  # with serving.online
        try:
            reply = self._handshake(_require(env, ENV_SERVER), token)
            self._key = simulation_key(bytes.fromhex(token), self.simulation_id, self.attempt)
            self._field_ids = {name: i for i, name in enumerate(reply["fields"])}
            self._route = Route.from_answer(reply)
            self._connect(reply, queue_bytes)
            self._steps: list[set[int]] = [set() for _ in self._links]
            self._sent = [0] * len(self._links)  # messages sent to each rank, as its delivery service counts them
            declaration = encode_json({"fields": self._declarations()})
            for rank in range(len(self._links)):
                self._send(rank, self._header(Kind.DECLARE, 0, 0, "uint8", (), len(declaration)), declaration)
        except BaseException:
            self.close()
            raise

    def _connect(self, reply: dict[str, Any], queue_bytes: int) -> None:
        """Open a data link and a delivery link to every server rank the handshake's ``reply`` names, the data
        queue ``queue_bytes`` deep; with ``serving.online``, the predictor that asks the ranks' models."""
        largest = max([1, *(int(np.prod(s)) * np.dtype(d).itemsize for d, s in self._layouts.values())])
        for endpoint in reply["endpoints"]:
            link = _Link(self._context, zmq.PUSH, endpoint, self._environ)
            self._links.append(link)
            link.socket.setsockopt(zmq.SNDHWM, max(2, queue_bytes // largest))
            link.socket.setsockopt(zmq.SNDTIMEO, WAKE_MS)  # a send blocked by a full queue wakes this often
            link.socket.connect(endpoint)
        for endpoint in reply["acks"]:
            link = _Link(self._context, zmq.DEALER, endpoint, self._environ)
            self._questions.append(_Questions(link, keepalive(self._timeout)))
            link.socket.connect(endpoint)
        if reply.get("predictions"):
            who = f"simulation {self.simulation_id}"
            self._predictor = _Predictor(reply["predictions"], self._context, self._environ, self.simulation_id, who)

    def _handshake(self, endpoint: str, token: str) -> dict[str, Any]:
        hello = {
            "protocol": PROTOCOL_VERSION,
            "token": token,
            "simulation_id": self.simulation_id,
            "attempt": self.attempt,
            "client_rank": self.rank,
            "client_size": self.size,
            "fields": self._declarations(),
            "nonce": secrets.token_hex(8),
        }
        link = _handshake_link(self._context, endpoint, self._environ)
        try:
            return _ask(link, hello, self._timeout, f"simulation {self.simulation_id}")
        finally:
            link.close()

    def _declarations(self) -> dict[str, list[Any]]:
        """Each field's ``[dtype, shape]``, and its block where it has one, as the hello and DECLARE carry them."""
        return {
            name: [dtype, list(shape), *([block.to_json()] if (block := self._blocks[name]) else [])]
            for name, (dtype, shape) in self._layouts.items()
        }

    def _check_alive(self, rank: int) -> None:
        """Raise if a server rank refused us or has been unreachable for the client timeout: no connection, or
        its delivery service silent (a frozen process, a lost node)."""
        link, questions = self._links[rank], self._questions[rank]
        for each in (link, questions.link):
            each.update()
            _check_refused(each, f"simulation {self.simulation_id}")
        if max(link.down_for(), questions.link.down_for(), questions.silent_for()) >= self._timeout:
            raise ServerUnreachable(
                f"simulation {self.simulation_id}: server rank {rank} ({link.endpoint}) has been "
                f"unreachable for {self._timeout:g} s (no connection, no answer)"
            )

    def _question(self, rank: int, wait: bool) -> bytes:
        return encode_json(
            {
                "simulation_id": self.simulation_id,
                "attempt": self.attempt,
                "client_rank": self.rank,
                "key": self._key.hex(),
                "sent": self._sent[rank],
                "wait": wait,
            }
        )

    def _ping(self, rank: int) -> None:
        """While a send is blocked: ask the rank whether it lives, every keepalive seconds (counted from the last
        question, not its answer: an answer is read at a wake, and a question at the next would leave a frozen rank
        unnoticed for two wakes past the timeout)."""
        questions = self._questions[rank]
        questions.answer()
        questions.ask(self._question(rank, wait=False), every=keepalive(self._timeout))

    def _header(
        self, kind: Kind, time_step: int, field_id: int, dtype: str, shape: tuple[int, ...], size: int, offset: int = 0
    ) -> bytes:
        return Header(
            kind,
            self._key,
            self.simulation_id,
            self.attempt,
            time_step,
            self.rank,
            self.size,
            field_id,
            dtype,
            shape,
            size,
            offset,
        ).pack()

    def _send(self, rank: int, header: bytes, payload: Any) -> None:
        """Queue a message for a server rank; while the queue is full, wait as long as that rank lives."""
        link = self._links[rank]
        while True:
            try:  # waits inside ZeroMQ for at most WAKE_MS (SNDTIMEO): no Python loop per wake-up
                link.socket.send(header, zmq.SNDMORE)
                break
            except zmq.Again:
                self._ping(rank)
                self._check_alive(rank)
        link.socket.send(payload)  # a message's first part taken, ZeroMQ takes the rest: its queue counts messages
        self._sent[rank] += 1

    def send(self, field: str, time_step: int, array: Any) -> None:
        """Send this rank's slice (or block) of ``field`` at ``time_step`` to the server rank that holds that step.

        ``array`` is copied into ZeroMQ's send queue before ``send`` returns, so the simulation may overwrite it at
        once. Any memory layout is taken (a view without the halo, a Fortran-ordered array): its values are sent in
        C order. When the queue is full (the server's buffer is full: back-pressure), ``send`` blocks for as long as
        the server rank lives, however long that is; nothing is lost and nothing times out. Only a rank that has been
        unreachable (no connection, no answer to the client's questions) for ``launcher.client_timeout`` seconds
        ends the wait, noticed within a second.

        :param field: a field name declared to the constructor.
        :param time_step: the step's index, an integer in ``[0, 2**32)``: 0, 1, 2, ...
        :param array: the data, of the dtype and shape declared for ``field`` exactly: nothing is cast (a float64
            array for a float32 field is refused).
        :raises ClientError: ``field`` was not declared, ``time_step`` is out of range, or ``array``'s dtype or shape
            is not the declared one; nothing is sent.
        :raises ServerUnreachable: the server rank has been unreachable for ``launcher.client_timeout`` seconds
            while ``send`` waited (a server that exited, a frozen process, a lost node).
        :raises HandshakeRefused: the server rank refused this client's credentials while ``send`` waited.
        """
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
        field_id, (dtype, shape) = self._field_ids[field], layout
        for rank in self._route.ranks(self.simulation_id, time_step):  # two with windows, near a block's end
            if data.nbytes <= PART_BYTES:
                self._send(rank, self._header(Kind.DATA, time_step, field_id, dtype, shape, data.nbytes), data)
            else:
                octets = data.reshape(-1).view(np.uint8)
                for offset in parts(data.nbytes):
                    header = self._header(Kind.DATA, time_step, field_id, dtype, shape, data.nbytes, offset)
                    self._send(rank, header, octets[offset : offset + PART_BYTES])
            self._steps[rank].add(time_step)

    def predict(self, inputs: Mapping[str, Any], deadline: float | None = None) -> Prediction:
        """Ask the model the server is training (``serving.online``) ``n`` questions at once: to use its answers
        where it is good enough, and your own solver otherwise. The server ranks are asked in turn; an answer that
        comes after the deadline is dropped.

        ```python
        answer = client.predict({"parameters": client.parameters[None].astype(np.float32)})  # n = 1
        field = answer.outputs["temperature"][0] if answer else solver.step()
        ```

        :param inputs: each name of the module's ``prediction_inputs``, mapped to an array ``[n, *shape]`` of its
            dtype.
        :param deadline: the longest wait for the answer, in seconds; None: the study's ``serving.deadline``.
        :returns: the answer, true only when answered (``outputs``, and the ``version`` of the model that answered);
            its ``status`` is ``no_model`` when the study has trained nothing yet, ``no_answer`` when none came in
            time.
        :raises ClientError: the server answers no predictions (``serving.online`` is off), or ``inputs`` are not
            what the model takes (a name, a dtype, a shape, NaN, more than ``serving.max_batch`` questions); nothing
            is sent.
        :raises PredictionRefused: the server rank refused the request; the message says why.
        :raises HandshakeRefused: the server rank refused this client's credentials.
        """
        if self._predictor is None:
            raise ClientError(
                f"simulation {self.simulation_id}: predict: the server answers no predictions (serving.online is off)"
            )
        return self._predictor.ask(inputs, deadline)

    def finalize(self) -> None:
        """Announce the steps sent to each server rank, wait until every rank has read everything, and close.

        Once it returns, the process may exit without losing anything. It waits for as long as the server lives,
        however far behind it is, and closes the client whether it returns or raises. Leaving a ``with`` block
        normally calls it.

        :raises ServerUnreachable: a server rank has been unreachable for ``launcher.client_timeout`` seconds, or
            messages were lost with a broken connection (the message says how many): the study should run the
            simulation again, which the process's failure tells it.
        :raises HandshakeRefused: a server rank refused this client's credentials.
        """
        try:
            for rank in range(len(self._links)):
                self._send(rank, *self._finalize_message(rank))
            self._await_delivery()
        finally:
            self.close()

    def _finalize_message(self, rank: int) -> tuple[bytes, bytes]:
        body = encode_json({"steps": len(self._steps[rank])})
        return self._header(Kind.FINALIZE, 0, 0, "uint8", (), len(body)), body

    def _await_delivery(self) -> None:
        """Until every rank confirms it read every message sent to it (or its simulation ended), for as long as
        the ranks live; a FINALIZE lost with a broken connection is sent again."""
        waiting = set(range(len(self._links)))
        for link in self._links:
            link.update()
        drops = [link.drops for link in self._links]  # when the FINALIZE was queued
        for rank in waiting:
            self._questions[rank].ask(self._question(rank, wait=True))
        poller = zmq.Poller()
        for questions in self._questions:
            poller.register(questions.link.socket, zmq.POLLIN)
        while waiting:
            poller.poll(ANSWER_POLL_MS)
            for rank in sorted(waiting):
                answer = self._questions[rank].answer()
                if answer is None:
                    self._questions[rank].ask(self._question(rank, wait=True))  # if it was lost
                    self._check_alive(rank)
                    continue
                read, finalized, ended = int(answer["read"]), bool(answer["finalized"]), bool(answer["ended"])
                if ended or (finalized and read >= self._sent[rank]):
                    waiting.discard(rank)
                    continue
                if finalized:  # the FINALIZE, sent last, was read: what is missing before it is lost
                    raise ServerUnreachable(
                        f"simulation {self.simulation_id}: server rank {rank} ({self._links[rank].endpoint}) read "
                        f"{read} of the {self._sent[rank]} messages sent to it: {self._sent[rank] - read} lost with a "
                        "broken connection"
                    )
                link = self._links[rank]
                if link.up and link.drops > drops[rank]:  # reconnected since: the FINALIZE may be lost
                    try:  # not counted: it stands for the lost one
                        link.socket.send_multipart(list(self._finalize_message(rank)), zmq.NOBLOCK)
                        drops[rank] = link.drops
                    except zmq.Again:
                        pass  # the queue is full: it still holds what was not lost, the FINALIZE among it
                self._questions[rank].ask(self._question(rank, wait=True))

    def close(self) -> None:
        """Close the sockets at once, without waiting: what a finalize confirmed is delivered, anything else is dropped.

        ``finalize`` ends with it; leaving a ``with`` block with an exception calls it alone, so that the attempt does
        not count and the study runs the simulation again.
        """
        for link in [*self._links, *(questions.link for questions in self._questions)]:
            link.close()
        if self._predictor is not None:
            self._predictor.close()
        self._links, self._questions = [], []
        self._context.term()

    @classmethod
    def simulations(
        cls,
        fields: Mapping[str, tuple[Any, Sequence[int]]],
        comm: Comm | None = None,
        *,
        environ: Mapping[str, str] | None = None,
    ) -> Iterator[Client]:
        """The simulations this process runs, a client each: under ``launcher.persistent``, those the study hands
        this worker until it is over; otherwise the one its environment names (so the same code runs both ways).

        Each iteration's body streams one simulation; its end finalizes it. An exception (or a ``break``) leaves
        that simulation unfinalized, and the study runs it again. Between two simulations the worker waits, without
        spinning a core, until the study has one for it (with ``comm``, rank 0 asks for every rank).

        ```python
        setup = load_mesh_and_compile()  # paid once per worker
        for client in Client.simulations({"u": ("float32", (nx,))}):
            for t, u in enumerate(setup.solve(**client.named_parameters)):
                client.send("u", t, u)
        ```

        :param fields: as the constructor's.
        :param comm: as the constructor's; all its ranks iterate together.
        :param environ: as the constructor's.
        :returns: an iterator of clients, each connected to the server for its simulation.
        :raises ClientError: as the constructor, or a worker's environment without ``MELISSA_SERVER`` or
            ``MELISSA_TOKEN``.
        :raises HandshakeRefused: as the constructor, or the server refused the worker's request (its credentials,
            a server whose ``launcher.persistent`` is off).
        :raises ServerUnreachable: as the constructor, or the worker's request for its next simulation got no answer
            within ``launcher.client_timeout`` seconds.
        """
        env = dict(os.environ if environ is None else environ)
        if ENV_WORKER not in env:
            with cls(fields, comm, environ=env) as client:
                yield client
            return
        last = None
        while (assigned := _next_simulation(env, comm, last)) is not None:
            with cls(fields, comm, environ={**env, **assigned}) as client:
                last = f"{client.simulation_id}:{client.attempt}"
                yield client

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        if kind is None:
            self.finalize()
        else:  # no finalize: the attempt will not count, and the user's exception must surface unchanged
            self.close()


class Predictor:
    """Asks the model that ``melissa-server --serve OUTPUT_DIR`` serves, from any process of its user: no study, no
    simulation needed. Use it as a context manager, or call ``close``.

    The server writes ``serving.json`` with each rank's endpoint and the credentials. When a question gets no answer
    and the file changed since it was read (a restarted server), the next question goes to the ranks it names now.

    ```python
    with Predictor("output") as predictor:
        answer = predictor.predict({"parameters": p, "time_step": t})  # as Client.predict
    ```

    :param serving: the output folder or its ``serving.json``; None: the ``MELISSA_SERVING`` variable, as the C
        library reads it.
    :raises ClientError: ``serving`` is None and ``MELISSA_SERVING`` is not set, or ``serving.json`` cannot be read
        (a server that is not running, or has not written it yet).
    """

    def __init__(self, serving: str | os.PathLike[str] | None = None) -> None:
        if serving is None:
            serving = _require(os.environ, ENV_SERVING)
        path = Path(serving)
        self._path = path / SERVING_FILE if path.is_dir() else path
        self._context = zmq.Context()
        self._text = ""
        self._asker: _Predictor | None = None
        try:
            self._read()
        except BaseException:
            self.close()
            raise

    def _read(self) -> None:
        try:
            text = self._path.read_text()
            published = json.loads(text)
            security = Security.from_json(published["credentials"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ClientError(
                f"{self._path}: cannot read what melissa-server --serve publishes ({error}); is it running?"
            ) from None
        if self._asker is not None:
            self._asker.close()
        environ = {ENV_TOKEN: security.token.hex(), **security.client_environment()}
        self._asker = _Predictor(published, self._context, environ, os.getpid(), f"predictor of {self._path}")
        self._text = text

    def predict(self, inputs: Mapping[str, Any], deadline: float | None = None) -> Prediction:
        """Ask the served model ``n`` questions at once, as ``Client.predict`` does; the server ranks in turn.

        :param inputs: each name of the model's ``prediction_inputs``, mapped to an array ``[n, *shape]`` of its
            dtype.
        :param deadline: the longest wait for the answer, in seconds; None: the study's ``serving.deadline``.
        :returns: the answer, true only when answered; its ``status`` is ``no_answer`` when none came in time.
        :raises ClientError: ``inputs`` are not what the model takes (a name, a dtype, a shape, NaN, more than
            ``serving.max_batch`` questions), or ``serving.json``, read again after a question without an answer,
            cannot be read.
        :raises PredictionRefused: the server rank refused the request; the message says why.
        :raises HandshakeRefused: the server rank refused the credentials of ``serving.json``.
        """
        assert self._asker is not None
        answer = self._asker.ask(inputs, deadline)
        if answer.status == "no_answer":
            with contextlib.suppress(OSError):
                if self._path.read_text() != self._text:
                    self._read()
        return answer

    def close(self) -> None:
        """Close the connections to the server ranks; leaving a ``with`` block calls it."""
        if self._asker is not None:
            self._asker.close()
        self._context.term()

    def __enter__(self) -> Predictor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
