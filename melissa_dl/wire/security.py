"""Who may talk to the server's sockets, how big a message may be, and how a peer knows the server lives.

A study's ports are reachable by anyone on the cluster, so every server socket
(rank 0's handshake REP, each rank's data PULL) admits only peers holding the
study's credentials, checked by ZeroMQ's authentication protocol (ZAP) before a
single message is read. ``server.security`` picks the level:

- ``token`` (default): ZeroMQ PLAIN; the password is the study's secret token
  (hex), which the launcher gives the simulations as ``MELISSA_TOKEN``. Peers
  without it get no connection; the traffic is not encrypted.
- ``curve``: ZeroMQ CURVE, encrypted and authenticated. Rank 0 draws a server
  and a client keypair per study; every rank serves with the server's secret
  key and admits only the study's client public key. Simulations find the
  server's public key and the client keypair in ``MELISSA_CURVE_SERVER_KEY``,
  ``MELISSA_CURVE_PUBLIC_KEY`` and ``MELISSA_CURVE_SECRET_KEY`` (Z85 text).

ZAP is per ZeroMQ context: one handler thread serves all guarded sockets of a
context (rank 0 has two). It starts with the first :class:`Gate`, before that
socket binds, and stops with the last, after its socket closed: a CURVE socket
without a handler would admit anyone. Every refusal is counted as
``<socket>_auth`` in the socket's :class:`~melissa_dl.wire.rejections.RejectionLog`
(wrong password or key here; no or another mechanism, or a failed key exchange,
by the socket's monitor in :mod:`melissa_dl.ingest.connections`, which counts
connections that end before the handshake is done as ``<socket>_noauth``).

A gate also caps every message part at ZeroMQ's level (``ZMQ_MAXMSGSIZE``: a
larger part ends the connection before it is buffered). libzmq applies that
cap to the login too, before the credentials are checked, so a socket's cap
is what its own traffic needs and no more (``PART_BYTES`` on a data socket,
:func:`hello_bytes` on the handshake socket), and the sockets' guards
(:mod:`melissa_dl.ingest.connections`) bound how many logins may be under way. No server socket sends
ZeroMQ heartbeats: on a connection that back-pressure stalls, a heartbeat to a
client that has exited trips an assertion in libzmq 4.3.5 that aborts the rank
(libzmq issues #3937, #4364, #4767). A client learns that a rank lives from
that rank's delivery service instead (:mod:`melissa_dl.ingest.delivery`), which
answers however full the buffer is; ``peer_timeout`` (the clients'
``client_timeout``) bounds how long it holds a question.
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import zmq
from zmq.utils import z85

from melissa_dl.errors import ClientError, ConfigError
from melissa_dl.wire.rejections import RejectionLog

logger = logging.getLogger(__name__)

LEVELS = ("token", "curve")
ENV_SECURITY = "MELISSA_SECURITY"
ENV_CURVE_SERVER_KEY = "MELISSA_CURVE_SERVER_KEY"
ENV_CURVE_PUBLIC_KEY = "MELISSA_CURVE_PUBLIC_KEY"
ENV_CURVE_SECRET_KEY = "MELISSA_CURVE_SECRET_KEY"
PLAIN_USERNAME = b"melissa"  # not checked: the password is the credential

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
POLL_MS = 50
BIND_TIMEOUT = 5.0  # a previous handler's endpoint is released asynchronously

# The largest hello (and DECLARE payload) a socket reads: a fixed part with room
# for odd but harmless input, plus each field's JSON-escaped name and a
# declaration of six 10-digit dimensions with a block's start and global shape
# of as many (melissa_dl.wire.blocks). It is also what a peer that has not
# logged in may make the handshake socket read (the cap applies to the login).
HELLO_BASE_BYTES = 64 << 10
HELLO_FIELD_BYTES = 320

# what a mechanism adds to a message part on the wire (CURVE: command name, nonce, MAC and flags, 33 bytes);
# a part over the cap ends its connection and is lost, so the cap must never cut a legitimate part
MECHANISM_OVERHEAD = 256


def hello_bytes(fields: Iterable[str]) -> int:
    """The largest handshake request a study with these fields needs: the handshake socket's message cap."""
    return HELLO_BASE_BYTES + sum(len(json.dumps(name)) + HELLO_FIELD_BYTES for name in fields)


@dataclass(frozen=True)
class Security:
    """A study's security level and secrets, the same on every rank (rank 0 draws them)."""

    level: str
    token: bytes = field(repr=False)
    peer_timeout: float = 300.0  # the clients' client_timeout: bounds how long the delivery service holds a question
    peers: int = 0  # simulation ranks that may run at once (job_limit x client_ranks), all of which may log in at once
    server_public: bytes = b""  # CURVE keys, Z85
    server_secret: bytes = field(default=b"", repr=False)
    client_public: bytes = b""
    client_secret: bytes = field(default=b"", repr=False)

    def __post_init__(self) -> None:
        assert self.level in LEVELS, self.level
        assert self.level != "curve" or (self.server_secret and self.client_public), "curve needs its keys"

    @classmethod
    def generate(cls, level: str, token: bytes, peer_timeout: float = 300.0, peers: int = 0) -> Security:
        """The study's security: for ``curve``, a fresh server and client keypair."""
        if level != "curve":
            return cls(level, token, peer_timeout, peers)
        if not zmq.has("curve"):
            raise ConfigError("server.security: 'curve' needs a libzmq built with CURVE support (libsodium)")
        server_public, server_secret = zmq.curve_keypair()
        client_public, client_secret = zmq.curve_keypair()
        return cls(level, token, peer_timeout, peers, server_public, server_secret, client_public, client_secret)

    def to_json(self) -> dict[str, str]:
        """The level and secrets as text (``melissa-server --serve`` keeps them in its ``serving.json``)."""
        keys = ("server_public", "server_secret", "client_public", "client_secret")
        return {"level": self.level, "token": self.token.hex(), **{key: getattr(self, key).decode() for key in keys}}

    @classmethod
    def from_json(cls, saved: Mapping[str, str]) -> Security:
        return cls(
            saved["level"],
            bytes.fromhex(saved["token"]),
            server_public=saved["server_public"].encode(),
            server_secret=saved["server_secret"].encode(),
            client_public=saved["client_public"].encode(),
            client_secret=saved["client_secret"].encode(),
        )

    def client_environment(self) -> dict[str, str]:
        """What a simulation needs besides ``MELISSA_TOKEN`` to pass the gates."""
        environ = {ENV_SECURITY: self.level}
        if self.level == "curve":
            environ[ENV_CURVE_SERVER_KEY] = self.server_public.decode()
            environ[ENV_CURVE_PUBLIC_KEY] = self.client_public.decode()
            environ[ENV_CURVE_SECRET_KEY] = self.client_secret.decode()
        return environ

    def admits(self, mechanism: bytes, credentials: list[bytes]) -> bool:
        """Whether a ZAP request's credentials are the study's (compared in constant time)."""
        if self.level == "token":
            return (
                mechanism == b"PLAIN"
                and len(credentials) == 2
                and hmac.compare_digest(credentials[1], self.token.hex().encode())
            )
        return (
            mechanism == b"CURVE"
            and len(credentials) == 1
            and hmac.compare_digest(credentials[0], z85.decode(self.client_public))
        )

    def serve(self, socket: zmq.Socket) -> None:
        """Make ``socket`` the server side of the level's mechanism (before bind)."""
        if self.level == "token":
            socket.setsockopt(zmq.PLAIN_SERVER, 1)
        else:
            socket.setsockopt(zmq.CURVE_SERVER, 1)
            socket.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)


def configure_client(socket: zmq.Socket, environ: Mapping[str, str] | None = None) -> str:
    """Give a client socket the credentials the launcher put in the environment (before connect); returns the level."""
    env = os.environ if environ is None else environ
    level = env.get(ENV_SECURITY, "token")
    if level == "token":
        token = env.get("MELISSA_TOKEN")
        if token is None:
            raise ClientError("MELISSA_TOKEN is not set: start this simulation through melissa-server's launcher")
        socket.setsockopt(zmq.PLAIN_USERNAME, PLAIN_USERNAME)
        socket.setsockopt(zmq.PLAIN_PASSWORD, token.encode())
    elif level == "curve":
        keys = []
        for name in (ENV_CURVE_SERVER_KEY, ENV_CURVE_PUBLIC_KEY, ENV_CURVE_SECRET_KEY):
            value = env.get(name)
            if value is None or len(value) != 40:
                raise ClientError(
                    f"{ENV_SECURITY}=curve but {name} is {'not set' if value is None else 'not a Z85 key'}"
                )
            keys.append(value.encode())
        try:
            socket.setsockopt(zmq.CURVE_SERVERKEY, keys[0])
            socket.setsockopt(zmq.CURVE_PUBLICKEY, keys[1])
            socket.setsockopt(zmq.CURVE_SECRETKEY, keys[2])
        except zmq.ZMQError as error:
            raise ClientError(f"the MELISSA_CURVE_* keys are refused by ZeroMQ: {error}") from None
    else:
        raise ClientError(f"{ENV_SECURITY}={level[:50]!r} is neither 'token' nor 'curve'")
    return level


_PROTOCOL_ERRORS = {
    getattr(zmq, name): name[len("PROTOCOL_ERROR_") :].lower()
    for name in dir(zmq)
    if name.startswith("PROTOCOL_ERROR_")
}


_MONITOR_EVENT = struct.Struct("=Hi")  # a monitor message's first frame: event, value


def monitor_event(monitor: zmq.Socket) -> tuple[int, int]:
    """The next event of a socket monitor: its kind and its value (a descriptor, an errno, a status).

    Not pyzmq's ``recv_monitor_message``, which makes the value a ``zmq.Event`` flag: every new
    descriptor number becomes a pseudo-member that the enum keeps for good, after decomposing it into
    flags (thousands of them, and their cost, on a rank that serves a thousand simulations at once).
    """
    return _MONITOR_EVENT.unpack(monitor.recv_multipart()[0])


def describe_handshake_failure(event: int, value: int) -> str:
    """Words for a monitor's HANDSHAKE_FAILED_* event."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"credentials refused (ZAP status {value})"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"ZeroMQ security handshake failed: {_PROTOCOL_ERRORS.get(value, hex(value))}"
    return f"connection lost during ZeroMQ's handshake ({os.strerror(value)})"


class Gate:
    """A server socket's admission, from before its bind until after its close.

    Sets the security mechanism and a ZAP domain of its own and the message
    size cap (``max_message_bytes`` of payload per part, plus the mechanism's
    framing; ZeroMQ applies it to the login too), and registers with its
    context's ZAP handler so that refusals are counted in ``rejections`` as
    ``<name>_auth`` and admissions told to ``admitted``.
    """

    _numbers = itertools.count()

    def __init__(
        self,
        socket: zmq.Socket,
        security: Security,
        rejections: RejectionLog,
        name: str,
        max_message_bytes: int,
        admitted: Callable[[str], None] = lambda host: None,
    ) -> None:
        self.name = name
        self.security = security
        self.rejections = rejections
        self.admitted = admitted  # told the host of every peer let in (from the handler's thread)
        self.domain = f"melissa-{name}-{os.getpid()}-{next(self._numbers)}".encode()
        self.context = socket.context
        socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes + MECHANISM_OVERHEAD)
        security.serve(socket)
        socket.setsockopt(zmq.ZAP_DOMAIN, self.domain)
        _Gatekeeper.enter(self)
        self._open = True

    def refuse(self, mechanism: bytes, address: bytes) -> None:
        peer = address.decode(errors="replace")[:100]
        self.rejections.reject(
            f"{self.name}_auth",
            f"{self.name} socket: {mechanism.decode(errors='replace')[:20]} "
            f"peer {peer} refused: not the study's {self.security.level} credentials",
        )

    def close(self) -> None:
        """After the socket closed: stop answering for it (the last gate of a context stops its handler)."""
        if self._open:
            self._open = False
            _Gatekeeper.leave(self)


class _Gatekeeper(threading.Thread):
    """The ZAP handler of one ZeroMQ context: answers its gates' requests from its own REP socket."""

    _lock = threading.Lock()  # guards _running and every keeper's gates
    _running: ClassVar[dict[int, _Gatekeeper]] = {}

    def __init__(self, context: zmq.Context) -> None:
        super().__init__(name="zap", daemon=True)
        self.context = context
        self.gates: dict[bytes, Gate] = {}
        self.error: BaseException | None = None
        self._stop_event = threading.Event()
        self._ready = threading.Event()

    @classmethod
    def enter(cls, gate: Gate) -> None:
        with cls._lock:
            keeper = cls._running.get(id(gate.context))
            if keeper is None or keeper.context is not gate.context:
                keeper = cls(gate.context)
                keeper.start()
                keeper._ready.wait()
                if keeper.error is not None:
                    raise keeper.error
                cls._running[id(gate.context)] = keeper
            keeper.gates[gate.domain] = gate

    @classmethod
    def leave(cls, gate: Gate) -> None:
        with cls._lock:
            keeper = cls._running[id(gate.context)]
            del keeper.gates[gate.domain]
            if keeper.gates:
                return
            del cls._running[id(gate.context)]
        keeper._stop_event.set()
        keeper.join()

    def run(self) -> None:
        try:
            socket = self.context.socket(zmq.REP)
            try:
                self._bind(socket)
                self._ready.set()
                while not self._stop_event.is_set():
                    if socket.poll(POLL_MS):
                        socket.send_multipart(self._answer(socket.recv_multipart()))
            finally:
                socket.close(linger=0)
        except BaseException as error:  # raised by enter() if it happens before the bind
            self.error = error
            logger.error("the ZAP handler failed: %r", error)
            self._ready.set()

    def _bind(self, socket: zmq.Socket) -> None:
        deadline = time.monotonic() + BIND_TIMEOUT
        while True:
            try:
                socket.bind(ZAP_ENDPOINT)
                return
            except zmq.ZMQError as error:
                if error.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)

    def _answer(self, request: list[bytes]) -> list[bytes]:
        """RFC 27: version, request id, domain, address, identity, mechanism, credentials."""
        request_id = request[1] if len(request) > 1 else b""
        if len(request) < 6 or request[0] != b"1.0":
            return [b"1.0", request_id, b"500", b"malformed ZAP request", b"", b""]
        domain, address, mechanism, credentials = request[2], request[3], request[5], request[6:]
        with self._lock:
            gate = self.gates.get(domain)
        if gate is not None and gate.security.admits(mechanism, credentials):
            gate.admitted(address.decode(errors="replace"))
            return [b"1.0", request_id, b"200", b"OK", b"", b""]
        if gate is not None:
            gate.refuse(mechanism, address)
        return [b"1.0", request_id, b"400", b"not the study's credentials", b"", b""]
