"""Each server rank's delivery service: what the rank has read of a client, and that the rank lives.

Why a socket of its own: a data connection stalled by back-pressure carries
nothing back, and ZeroMQ's heartbeats on it are what made libzmq 4.3.5 abort
the rank (``Assertion failed: !_io_error``: a heartbeat timer writing to a
connection whose peer had exited while the rank was not reading). So no server
socket sends heartbeats, and a client asks this ROUTER socket instead, which
its own thread serves however full the buffer is. A request is one JSON
object::

    {"simulation_id": 3, "attempt": 0, "client_rank": 0, "key": "<hex>", "sent": 42, "wait": true}

``key`` is the attempt's frame key (:func:`melissa_dl.wire.protocol.simulation_key`)
and ``sent`` the number of data-socket messages (DECLARE, DATA, FINALIZE) the
client rank sent to this rank. The reply is ``{"read": n, "finalized": bool,
"ended": bool}``: the messages of that attempt and client rank read so far,
whether its FINALIZE was one of them, and whether the simulation has ended
(done or failed) or the attempt was replaced, so that there is nothing more to
deliver. A request with ``"wait": false`` is a liveness ping, answered at
once; with ``"wait": true`` the answer waits until ``read >= sent`` and the
FINALIZE is in, or the simulation ended, or :func:`~melissa_dl.wire.protocol.keepalive`
seconds passed (so that a client behind a slow server still hears from it). A client asks a question again
when its connection dropped or its answer is overdue; a ``wait`` question asked again on the same connection is
held from when it was first asked, so that the answer a keepalive promises is never put off by the asking. A
client that hears nothing for ``client_timeout`` seconds takes the rank for dead. Bad requests
are refused and counted as ``ack_<kind>``; what waiting requests hold is
bounded by the connections the socket accepts.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import zmq

from melissa_dl.errors import ProtocolError
from melissa_dl.ingest.assembly import Delivery
from melissa_dl.ingest.connections import ConnectionGuard, ServerSocketThread
from melissa_dl.wire.protocol import decode_json, encode_json, integers, keepalive, quote, simulation_key
from melissa_dl.wire.rejections import RejectionLog
from melissa_dl.wire.security import Security

logger = logging.getLogger(__name__)

REQUEST_BYTES = 1024  # a request is a short JSON object: anything longer ends its connection unread


@dataclass(frozen=True)
class _Request:
    simulation_id: int
    attempt: int
    client_rank: int
    sent: int
    wait: bool  # False: a liveness ping, answered at once
    since: float


class DeliveryServer(ServerSocketThread):
    """Serves one rank's delivery requests from its own thread; ``delivery`` reads the receiver's tally."""

    socket_type = zmq.ROUTER
    guard_name = "ack"

    def __init__(
        self,
        server_rank: int,
        token: bytes,
        delivery: Callable[[int, int, int], Delivery],
        rejections: RejectionLog,
        bind_address: str,
        security: Security,
    ) -> None:
        super().__init__(f"delivery-{server_rank}", bind_address, security=security, message_cap=REQUEST_BYTES)
        self.rejections = rejections  # the receiver's: one report of what the rank refused
        self._token = token
        self._delivery = delivery
        self._keepalive = keepalive(security.peer_timeout)
        self._waiting: dict[bytes, _Request] = {}  # peer routing id -> its request; one per peer

    def handle(self, socket: zmq.Socket, guard: ConnectionGuard) -> None:
        frames = socket.recv_multipart()
        if len(frames) != 2:  # a DEALER peer's message is one part; ROUTER puts the peer's id before it
            self.rejections.reject("ack_malformed", f"ack socket: a request of {len(frames) - 1} parts instead of 1")
            return
        peer, body = frames
        try:
            request = self._parse(decode_json(body, "ack request"))
        except ProtocolError as error:
            self.rejections.reject(f"ack_{error.kind}", str(error))
            return
        held = self._waiting.get(peer)
        if held is not None and held.wait and request.wait:  # asked again: held since the first, not from now
            request = replace(request, since=held.since)
        self._waiting[peer] = request
        self.answer_due(socket, only=peer)

    def _parse(self, body: Any) -> _Request:
        """The request, checked."""
        if not isinstance(body, dict):
            raise ProtocolError("ack request: expected a JSON object", "malformed")
        keys = ("simulation_id", "attempt", "client_rank", "sent")
        values = integers(body, keys)
        if values is None or not all(0 <= v < 1 << 32 for v in values):
            raise ProtocolError(f"ack request: bad numbers {quote([body.get(k) for k in keys])}", "malformed")
        sim, attempt, crank, sent = values
        key = body.get("key")
        if not (
            isinstance(key, str)
            and key.isascii()
            and hmac.compare_digest(key, simulation_key(self._token, sim, attempt).hex())
        ):
            raise ProtocolError(f"ack request: simulation {sim}: bad credentials", "credentials")
        return _Request(sim, attempt, crank, sent, body.get("wait") is True, time.monotonic())

    def idle(self, socket: zmq.Socket) -> None:
        self.answer_due(socket)

    def answer_due(self, socket: zmq.Socket, only: bytes | None = None) -> None:
        """Answer the waiting requests that are complete, ended or held long enough."""
        now = time.monotonic()
        for peer in [only] if only is not None else list(self._waiting):
            request = self._waiting[peer]
            state = self._delivery(request.simulation_id, request.attempt, request.client_rank)
            delivered = state.finalized and state.read >= request.sent
            if not request.wait or delivered or state.ended or now - request.since >= self._keepalive:
                del self._waiting[peer]
                try:  # a peer that left meanwhile is dropped by ZeroMQ without a word
                    socket.send_multipart(
                        [peer, encode_json({"read": state.read, "finalized": state.finalized, "ended": state.ended})],
                        zmq.NOBLOCK,
                    )
                except zmq.Again:
                    pass  # its queue is full of answers it does not read: it will ask again
