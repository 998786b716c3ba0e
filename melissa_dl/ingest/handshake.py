"""Rank 0's handshake service: admits clients and tells them where to send.

A client rank sends one JSON object::

    {"protocol": 4, "token": "<hex>", "simulation_id": 3, "attempt": 0, "client_rank": 0,
     "client_size": 2, "fields": {"temperature": ["float32", [16, 32]]}, "nonce": "<hex>"}

and receives ``{"ok": true, "endpoints": [...], "acks": [...], "fields": [...],
"bind_simulation": false, "block": 1, "overlap": 0, "predictions": null}`` (each server rank's data socket and
delivery service, :mod:`melissa_dl.ingest.delivery`; the routing, ``wire.protocol.Route``; with
``serving.online``, ``{"endpoints": [...], "inputs": {...}, "max_batch": 256, "deadline": 1.0}``, each rank's
prediction service and what it is asked with, :mod:`melissa_dl.wire.predictions`) or
``{"ok": false, "kind": ..., "error": ...}``.
A persistent worker (``launcher.persistent``) asks for its next simulation
with ``{"protocol": 4, "token": "<hex>", "worker": "3:0", "last": "12:0"}``
(``last``: the simulation and attempt it was last told, null at first, so
that a request sent again after a lost answer gets that answer again) and receives
``{"ok": true, "env": {...}}`` (its next simulation's environment), ``{"ok":
true, "wait": 0.1}`` or ``{"ok": true, "over": true}``
(:meth:`launcher.workers.WorkerScheduler.next_for`).
Refusals are counted like bad data frames; whatever a hello holds, checking
it can only refuse it, never end the thread. The service runs in its own
thread with its own REP socket; the study tells it which attempt of which
simulation it expects.

Two mistakes would otherwise corrupt the science silently, so they are
refused here, where the whole study is in view: a client whose size
contradicts ``launcher.client_ranks`` or a second hello from the same client
rank of one attempt (an MPI simulation that forgot ``comm=``: every rank
would send its half-field as a whole one), and fields whose dtype or shape
differ from the study's pinned ones (configured in ``study.fields``, or set by
the first simulation admitted). Such refusals are deterministic: the study
fails the simulation at once instead of relaunching it
(:meth:`HandshakeServer.take_failures`).

A client sends its hello again when the connection that carried it was lost
(the answer may have been lost with it): the guard may cut a connection that
had already logged in when it sees it too late. The hello's ``nonce``, drawn
once per client, tells that repeat, answered as the first was, from a second
process claiming the same rank, refused as ``twice``.
"""

from __future__ import annotations

import hmac
import logging
import math
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import zmq

from melissa_dl.errors import ProtocolError
from melissa_dl.ingest.connections import ConnectionGuard, ServerSocketThread
from melissa_dl.wire.blocks import Declared, joined, parse_block
from melissa_dl.wire.protocol import (
    PROTOCOL_VERSION,
    Layout,
    Route,
    check_layout,
    decode_json,
    describe,
    encode_json,
    integers,
    quote,
)
from melissa_dl.wire.security import Security, hello_bytes

if TYPE_CHECKING:
    from melissa_dl.config.sections import LauncherConfig, ServerConfig, StudyConfig, WindowConfig

logger = logging.getLogger(__name__)

HELLO_QUEUE = 4  # hellos queued per connection (a REQ client sends one at a time)

NONCE_CHARS = 64  # of a hello's nonce (a client sends 16 hex digits)
# refusals that the same simulation would meet again on every relaunch
DETERMINISTIC = frozenset({"unknown_field", "missing_field", "dtype", "shape", "oversize", "client_size", "twice"})


class HandshakeServer(ServerSocketThread):
    socket_type = zmq.REP
    guard_name = "handshake"

    def __init__(
        self,
        *,
        token: bytes,
        fields: Sequence[str],
        simulations: int,
        endpoints: Sequence[tuple[str, str]],
        bind_simulation: bool,
        max_message_bytes: int,
        bind_address: str,
        max_partial_bytes: int = 1 << 28,
        client_size: int = 1,
        layouts: dict[str, Layout] | None = None,
        port: int = 0,
        security: Security | None = None,
        next_work: Callable[[str, str | None], dict[str, Any]] | None = None,
        block: int = 1,
        overlap: int = 0,
        predictions: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            "handshake",
            bind_address,
            port,
            security=security if security is not None else Security("token", token),
            message_cap=hello_bytes(fields),
        )
        self._token = token
        self._fields = list(fields)
        self._simulations = simulations
        self._max_message_bytes = max_message_bytes
        self._max_partial_bytes = max_partial_bytes
        self._accept = {
            "ok": True,
            "endpoints": [data for data, _ in endpoints],
            "acks": [ack for _, ack in endpoints],
            "fields": self._fields,
            **Route(len(endpoints), bind_simulation, block, overlap).answer(),
            "predictions": predictions,
        }
        self._client_size = client_size
        self._pins: dict[str, Layout] = dict(layouts or {})  # whole (joined) layout of each field
        self._expected: dict[int, int] = {}  # simulation -> the attempt it runs
        self._admitted: dict[int, dict[int, dict[str, Declared]]] = {}  # simulation -> client rank -> its fields
        self._nonces: dict[int, dict[int, str]] = {}  # simulation -> client rank -> its hello's nonce
        self._failures: list[tuple[int, str]] = []
        self._lock = threading.Lock()
        self._next_work = next_work  # what a persistent worker runs next (``launcher.persistent``)

    @classmethod
    def from_config(
        cls,
        server: ServerConfig,
        study: StudyConfig,
        launcher: LauncherConfig,
        token: bytes,
        endpoints: Sequence[tuple[str, str]],
        bind_address: str,
        security: Security,
        next_work: Callable[[str, str | None], dict[str, Any]] | None = None,
        window: WindowConfig | None = None,
        predictions: dict[str, Any] | None = None,
    ) -> HandshakeServer:
        """Rank 0's handshake socket for the study the sections describe, sending clients to ``endpoints`` (each
        rank's data and delivery endpoints) and ``predictions`` (``Client.predict``'s ranks, inputs and limits),
        and persistent workers to ``next_work``'s simulations."""
        return cls(
            token=token,
            fields=study.field_names,
            simulations=study.all_simulations,
            endpoints=endpoints,
            bind_simulation=server.bind_simulation_to_server_rank,
            max_message_bytes=server.max_message_bytes,
            bind_address=bind_address,
            max_partial_bytes=server.max_partial_bytes,
            client_size=launcher.client_ranks,
            layouts=study.field_layouts,
            port=server.handshake_port,
            security=security,
            next_work=next_work,
            **(window.routing if window is not None else {}),
            predictions=predictions,
        )

    def expect(self, simulation_id: int, attempt: int | None) -> None:
        """Admit the clients of this attempt of a simulation (None: stop admitting its clients)."""
        with self._lock:
            self._admitted.pop(simulation_id, None)
            self._nonces.pop(simulation_id, None)
            if attempt is None:
                self._expected.pop(simulation_id, None)
            else:
                self._expected[simulation_id] = attempt

    def take_failures(self) -> list[tuple[int, str]]:
        """Simulations refused for a reason a relaunch would meet again, with that reason; each reported once."""
        with self._lock:
            failures, self._failures = self._failures, []
        return failures

    def configure(self, socket: zmq.Socket) -> None:
        socket.setsockopt(zmq.RCVHWM, HELLO_QUEUE)  # a peer pipelining hellos holds at most this many

    def handle(self, socket: zmq.Socket, guard: ConnectionGuard) -> None:
        socket.send(encode_json(self.answer(socket.recv_multipart())))

    def answer(self, request: list[bytes]) -> dict[str, Any]:
        """The reply to one request; checking it never raises."""
        try:
            if len(request) != 1:
                raise ProtocolError(f"handshake: {len(request)} message parts instead of 1", "malformed")
            message = decode_json(request[0], "handshake")
            self._check_credentials(message)
            if "worker" in message:
                return {"ok": True, **self._next_for(message["worker"], message.get("last"))}
            self._check(message)
        except ProtocolError as error:
            return self._refuse(error.kind, str(error))
        except Exception as error:  # an input nobody foresaw must cost this peer its hello, not the study its rank 0
            return self._refuse("malformed", f"handshake: {type(error).__name__}: {quote(str(error))}")
        return self._accept

    def _refuse(self, kind: str, message: str) -> dict[str, Any]:
        self.rejections.reject(f"handshake_{kind}", message)
        return {"ok": False, "kind": kind, "error": message}

    def _check_credentials(self, message: Any) -> None:
        """Refuse anything but a JSON object of our protocol carrying the study's token."""
        if not isinstance(message, dict):
            raise ProtocolError("handshake: expected a JSON object", "malformed")
        version = message.get("protocol")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"handshake: protocol version {quote(version)}, server speaks {PROTOCOL_VERSION}", "version"
            )
        token = message.get("token")
        if not (isinstance(token, str) and token.isascii() and hmac.compare_digest(token, self._token.hex())):
            raise ProtocolError("handshake: bad or missing token", "credentials")

    def _next_for(self, worker: Any, last: Any) -> dict[str, Any]:
        """What a persistent worker runs next."""
        if self._next_work is None:
            raise ProtocolError("handshake: a worker asked for a simulation, but launcher.persistent is off", "worker")
        if not _short_ascii(worker) or not (last is None or _short_ascii(last)):
            raise ProtocolError(
                f"handshake: worker {quote(worker)} and last {quote(last)} must be short ASCII strings", "malformed"
            )
        return self._next_work(worker, last)

    def _check(self, hello: dict[str, Any]) -> None:
        """Refuse anything but a well-formed hello of an expected simulation (its credentials checked)."""
        numbers = integers(hello, ("simulation_id", "attempt", "client_rank", "client_size"))
        if numbers is None or not (0 <= numbers[2] < numbers[3] < 1 << 16 and 0 <= numbers[1] < 1 << 32):
            raise ProtocolError(
                "handshake: simulation_id, attempt, client_rank and client_size must be integers", "malformed"
            )
        sim, attempt, crank, csize = numbers
        if not 0 <= sim < self._simulations:
            raise ProtocolError(f"handshake: simulation {sim} is not in the study", "unknown_simulation")
        with self._lock:
            expected = self._expected.get(sim)
        if expected is None:
            raise ProtocolError(
                f"handshake: simulation {sim} is not expected (not launched, done or failed)", "not_expected"
            )
        if attempt != expected:
            raise ProtocolError(
                f"handshake: simulation {sim}: attempt {attempt}, the running one is {expected}", "stale_attempt"
            )
        try:
            self._admit(sim, crank, csize, hello.get("fields"), _nonce(hello))
        except ProtocolError as error:
            if error.kind in DETERMINISTIC:
                with self._lock:
                    if self._expected.get(sim) == attempt:
                        self._failures.append((sim, str(error)))
            raise

    def _admit(self, sim: int, crank: int, csize: int, fields: Any, nonce: str | None) -> None:
        """Check one client rank's declaration against the study; remember it until its simulation's end (a
        repeat of an admitted hello, by its ``nonce``, is admitted again)."""
        where = f"handshake: simulation {sim}"
        if csize != self._client_size:
            cause = " (an MPI simulation that did not pass comm= to Client?)" if csize == 1 else ""
            raise ProtocolError(
                f"{where}: client rank {crank} of {csize}, but launcher.client_ranks is {self._client_size}{cause}",
                "client_size",
            )
        if not isinstance(fields, dict):
            raise ProtocolError(f"{where} declares no fields", "malformed")
        for name in fields:
            if name not in self._fields:
                raise ProtocolError(f"{where}: unknown field {quote(name)} (study has {self._fields})", "unknown_field")
        slices = {}
        for name in self._fields:
            if name not in fields:
                raise ProtocolError(f"{where}: field '{name}' missing", "missing_field")
            layout = check_layout(f"{where}, field '{name}'", fields[name], self._max_message_bytes)
            block = parse_block(f"{where}, field '{name}'", fields[name], layout[1], self._max_partial_bytes)
            slices[name] = (layout, block)
        with self._lock:
            ranks = self._admitted.setdefault(sim, {})
            nonces = self._nonces.setdefault(sim, {})
            if crank in ranks and nonce is not None and nonces.get(crank) == nonce and ranks[crank] == slices:
                return  # the same client again: its connection, and perhaps our answer, was lost
            if crank in ranks:
                raise ProtocolError(
                    f"{where}: client rank {crank} of {csize} said hello twice in one attempt (several processes "
                    "with the same rank: an MPI simulation that did not pass comm= to Client?)",
                    "twice",
                )
            self._check_pins(where, {**ranks, crank: slices}, csize, crank)
            ranks[crank] = slices
            if nonce is not None:
                nonces[crank] = nonce

    def _check_pins(self, where: str, ranks: dict[int, dict[str, Declared]], csize: int, new: int) -> None:
        """Slices must join, and blocks tile, into each field's pinned layout; the first complete simulation pins
        unpinned fields."""
        complete = len(ranks) == csize
        wholes = {}
        for name in self._fields:
            declared = {r: ranks[r][name] for r in sorted(ranks)}
            at = f"{where}, field '{name}'"
            wholes[name] = whole = joined(at, declared, csize, new)
            pinned = self._pins.get(name)
            if pinned is None:
                continue
            exact = complete or any(block is not None for _, block in declared.values())  # a block says the whole
            if whole[0] != pinned[0] or (whole[1] != pinned[1] if exact else whole[1][1:] != pinned[1][1:]):
                kind = "dtype" if whole[0] != pinned[0] else "shape"
                raise ProtocolError(
                    f"{at}: declares {describe(whole)}{'' if exact else ' so far'}, the study's is {describe(pinned)}"
                    + _one_dimensional_rule(whole[1], pinned[1]),
                    kind,
                )
        if complete:
            for name in self._fields:
                self._pins.setdefault(name, wholes[name])


def _one_dimensional_rule(declared: tuple[int, ...], pinned: tuple[int, ...]) -> str:
    """What a refusal of 1-D slices against a field of more dimensions must say: they join into 1-D only."""
    if len(declared) != 1 or len(pinned) < 2:
        return ""
    elements = math.prod(pinned)
    return (
        f" (1-D slices, as Melissa's API always sends, join into a 1-D field: give the field's shape as "
        f"[{elements}] and reshape it in the training module, or declare blocks)"
    )


def _nonce(hello: dict[str, Any]) -> str | None:
    """The hello's nonce (a client's own random string, ``NONCE_CHARS`` at most), if it has one."""
    nonce = hello.get("nonce")
    if nonce is not None and not _short_ascii(nonce):
        raise ProtocolError(f"handshake: nonce {quote(nonce)} is not a short ASCII string", "malformed")
    return nonce


def _short_ascii(value: Any) -> bool:
    """A string of 1 to ``NONCE_CHARS`` ASCII characters: what a hello's nonce or a worker's names are."""
    return isinstance(value, str) and 0 < len(value) <= NONCE_CHARS and value.isascii()
