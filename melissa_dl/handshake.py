"""Rank 0's handshake service: admits clients and tells them where to send.

A client rank sends one JSON object::

    {"protocol": 1, "token": "<hex>", "simulation_id": 3, "client_rank": 0,
     "client_size": 2, "fields": {"temperature": ["float32", [16, 32]]}}

and receives ``{"ok": true, "endpoints": [...], "fields": [...],
"bind_simulation": false}`` or ``{"ok": false, "kind": ..., "error": ...}``.
Refusals are counted like bad data frames. The service runs in its own thread
with its own REP socket; the study tells it which simulations it expects.
"""
from __future__ import annotations

import hmac
import logging
import threading
from typing import Any, Sequence

import zmq

from melissa_dl.errors import ProtocolError
from melissa_dl.protocol import PROTOCOL_VERSION, check_layout, decode_json, encode_json
from melissa_dl.rejections import RejectionLog

logger = logging.getLogger(__name__)


class HandshakeServer(threading.Thread):
    def __init__(
        self,
        *,
        token: bytes,
        fields: Sequence[str],
        simulations: int,
        endpoints: Sequence[str],
        bind_simulation: bool,
        max_message_bytes: int,
        bind_address: str,
        port: int = 0,
    ) -> None:
        super().__init__(name="handshake", daemon=True)
        self.rejections = RejectionLog()
        self.port = port
        self.error: BaseException | None = None
        self._token = token
        self._fields = list(fields)
        self._simulations = simulations
        self._max_message_bytes = max_message_bytes
        self._accept = {"ok": True, "endpoints": list(endpoints), "fields": self._fields, "bind_simulation": bind_simulation}
        self._bind_address = bind_address
        self._expected: set[int] = set()
        self._lock = threading.Lock()
        self._stop_event = threading.Event()
        self._ready = threading.Event()

    def expect(self, simulation_id: int, expected: bool) -> None:
        """Admit (or stop admitting) clients of a simulation."""
        with self._lock:
            if expected:
                self._expected.add(simulation_id)
            else:
                self._expected.discard(simulation_id)

    def start_and_bind(self, timeout: float = 30.0) -> int:
        self.start()
        self._ready.wait(timeout)
        if self.error is not None:
            raise self.error
        return self.port

    def run(self) -> None:
        try:
            socket = zmq.Context.instance().socket(zmq.REP)
            try:
                socket.setsockopt(zmq.RCVTIMEO, 100)
                address = f"tcp://{self._bind_address}"
                if self.port:
                    socket.bind(f"{address}:{self.port}")
                else:
                    self.port = socket.bind_to_random_port(address)
                self._ready.set()
                while not self._stop_event.is_set():
                    try:
                        request = socket.recv_multipart()
                    except zmq.Again:
                        continue
                    socket.send(encode_json(self._answer(request)))
            finally:
                socket.close(linger=0)
        except BaseException as error:  # re-raised by the main thread
            self.error = error
            self._ready.set()

    def _answer(self, request: list[bytes]) -> dict[str, Any]:
        try:
            if len(request) != 1:
                raise ProtocolError(f"handshake: {len(request)} message parts instead of 1", "malformed")
            self._check(decode_json(request[0], "handshake"))
        except ProtocolError as error:
            self.rejections.reject(f"handshake_{error.kind}", str(error))
            return {"ok": False, "kind": error.kind, "error": str(error)}
        return self._accept

    def _check(self, hello: Any) -> None:
        """Refuse anything but a well-formed hello of an expected simulation."""
        if not isinstance(hello, dict):
            raise ProtocolError("handshake: expected a JSON object", "malformed")
        version = hello.get("protocol")
        if version != PROTOCOL_VERSION:
            raise ProtocolError(f"handshake: protocol version {version!r}, server speaks {PROTOCOL_VERSION}", "version")
        token = hello.get("token")
        if not isinstance(token, str) or not hmac.compare_digest(token.encode(), self._token.hex().encode()):
            raise ProtocolError("handshake: bad or missing token", "credentials")
        sim, crank, csize = (hello.get(k) for k in ("simulation_id", "client_rank", "client_size"))
        if not all(isinstance(v, int) for v in (sim, crank, csize)) or not 0 <= crank < csize < 1 << 16:
            raise ProtocolError("handshake: simulation_id, client_rank and client_size must be integers", "malformed")
        if not 0 <= sim < self._simulations:
            raise ProtocolError(f"handshake: simulation {sim} is not in the study", "unknown_simulation")
        with self._lock:
            expected = sim in self._expected
        if not expected:
            raise ProtocolError(f"handshake: simulation {sim} is not expected (not launched, done or failed)", "not_expected")
        fields = hello.get("fields")
        if not isinstance(fields, dict):
            raise ProtocolError(f"handshake: simulation {sim} declares no fields", "malformed")
        for name in fields:
            if name not in self._fields:
                raise ProtocolError(f"handshake: simulation {sim}: unknown field '{name}' (study has {self._fields})", "unknown_field")
        for name in self._fields:
            if name not in fields:
                raise ProtocolError(f"handshake: simulation {sim}: field '{name}' missing", "missing_field")
            check_layout(f"handshake: simulation {sim}, field '{name}'", fields[name], self._max_message_bytes)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()
