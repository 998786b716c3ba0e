"""Questions to a rank's delivery service, both ends without sockets: the client asks a lost question again (its
connection dropped, or no answer for 1.5 keepalives) and still counts silence from the first; the service holds a
``wait`` question asked again from when it was first asked."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest

from melissa_dl.ingest import delivery as delivery_module
from melissa_dl.ingest.assembly import Delivery
from melissa_dl.ingest.delivery import DeliveryServer
from melissa_dl.wire import client as client_module
from melissa_dl.wire.client import REASK, _Questions
from melissa_dl.wire.protocol import keepalive, simulation_key
from melissa_dl.wire.rejections import RejectionLog
from melissa_dl.wire.security import Security

if TYPE_CHECKING:
    from clocks import Clock  # tests/clocks.py

pytestmark = pytest.mark.timeout(30)

TIMEOUT = 8.0
KEEPALIVE = keepalive(TIMEOUT)
TOKEN = bytes(32)


CLOCKED = (client_module, delivery_module)  # the modules whose clock the tests move (the ``clock`` fixture)


class Socket:
    """The few calls of a ZeroMQ socket that the two ends make: what was sent, what is there to read."""

    def __init__(self) -> None:
        self.sent: list[Any] = []
        self.inbox: list[Any] = []

    def send(self, message: bytes, flags: int = 0) -> None:
        self.sent.append(message)

    def send_multipart(self, frames: list[bytes], flags: int = 0) -> None:
        self.sent.append(frames)

    def recv_multipart(self) -> list[bytes]:
        return self.inbox.pop(0)


class Link:
    """A client link whose monitor says nothing new: ``drops`` is what the test makes it."""

    def __init__(self) -> None:
        self.socket = Socket()
        self.drops = 0

    def update(self) -> None:
        pass


def test_a_question_is_asked_again_when_its_connection_dropped_or_after_one_and_a_half_keepalives(
    clock: Clock,
) -> None:
    link = Link()
    questions = _Questions(link, KEEPALIVE)  # type: ignore[arg-type]
    questions.ask(b"q1")
    clock.now += 0.1
    questions.ask(b"q1")  # open, and its answer may still come
    assert link.socket.sent == [b"q1"]
    link.drops += 1  # the connection that carried it is gone, and its answer with it
    questions.ask(b"q1")
    assert link.socket.sent == [b"q1", b"q1"]
    clock.now += REASK * KEEPALIVE - 0.01
    questions.ask(b"q1")  # silent, but not for long enough since it was asked again
    assert len(link.socket.sent) == 2
    clock.now += 0.02
    questions.ask(b"q1")
    assert len(link.socket.sent) == 3
    assert questions.silent_for() == pytest.approx(
        0.11 + REASK * KEEPALIVE
    )  # from the first: a dead rank still ends it


def test_a_ping_is_asked_once_its_interval_has_passed(clock: Clock) -> None:
    link = Link()
    questions = _Questions(link, KEEPALIVE)  # type: ignore[arg-type]
    questions.ask(b"ping", every=KEEPALIVE)  # the link was opened just now
    assert link.socket.sent == [] and questions.silent_for() == 0.0
    clock.now += KEEPALIVE
    questions.ask(b"ping", every=KEEPALIVE)
    assert link.socket.sent == [b"ping"]


def server() -> tuple[DeliveryServer, Socket]:
    """A rank's delivery service (not started: no socket), that has read 3 messages of the client, not its FINALIZE."""
    read = Delivery(read=3, finalized=False, ended=False)
    security = Security("token", TOKEN, TIMEOUT)
    return DeliveryServer(0, TOKEN, lambda sim, attempt, rank: read, RejectionLog(), "127.0.0.1", security), Socket()


def question(wait: bool) -> list[bytes]:
    body = {"simulation_id": 1, "attempt": 0, "client_rank": 0, "key": simulation_key(TOKEN, 1, 0).hex(), "sent": 5}
    return [b"peer", json.dumps({**body, "wait": wait}).encode()]


def test_a_wait_question_asked_again_is_held_from_when_it_was_first_asked(clock: Clock) -> None:
    service, socket = server()
    socket.inbox.append(question(wait=True))
    service.handle(socket, None)  # type: ignore[arg-type]
    clock.now += 0.6 * KEEPALIVE
    socket.inbox.append(question(wait=True))  # asked again on the same connection
    service.handle(socket, None)  # type: ignore[arg-type]
    assert socket.sent == []  # not delivered yet: held
    clock.now += 0.4 * KEEPALIVE
    service.idle(socket)  # type: ignore[arg-type]
    assert socket.sent == [[b"peer", b'{"read":3,"finalized":false,"ended":false}']]


def test_a_ping_is_answered_at_once(clock: Clock) -> None:
    service, socket = server()
    socket.inbox.append(question(wait=False))
    service.handle(socket, None)  # type: ignore[arg-type]
    assert len(socket.sent) == 1 and json.loads(socket.sent[0][1]) == {"read": 3, "finalized": False, "ended": False}
