"""A rank's prediction service on real sockets, with a one-parameter module standing for the trainer's: versions
and the replica's refresh, one forward for the requests that came together, each refusal answered and counted, a
flood bounded, a failing ``predict`` costing only its requests, and what a server without credentials admits."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
import zmq
from torch import nn

from melissa_dl.config.sections import ServingConfig
from melissa_dl.embeddings.sparse_optim import SGD
from melissa_dl.embeddings.table import ShardedEmbedding
from melissa_dl.errors import ConfigError
from melissa_dl.serving.online import PEER_QUEUE, PredictionServer, Replica, check_servable
from melissa_dl.train.module import TrainingModule
from melissa_dl.wire.predictions import pack, unpack
from melissa_dl.wire.rejections import RejectionLog
from melissa_dl.wire.security import Security, configure_client, monitor_event

pytestmark = pytest.mark.timeout(60)

TOKEN = bytes(range(32))
ANSWER_MS = 30_000  # a bound on a wait for an answer that must come: never reached unless the service is broken


class Scaler(TrainingModule):
    """``y = scale * x``; counts its ``predict`` calls and the questions each got."""

    prediction_inputs = {"x": ("float32", (3,))}

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))
        self.calls: list[int] = []
        self.fail = False

    def configure_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def process(self, sample: Any) -> Any:
        return sample

    def training_step(self, batch: Any) -> torch.Tensor:
        return self.scale

    def predict(self, inputs: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        self.calls.append(len(inputs["x"]))
        if self.fail:
            raise RuntimeError("out of luck")
        return {"y": inputs["x"] * self.scale}


@dataclass
class Trained:
    """The trainer's side: its module, its step sequence and its batch count."""

    module: Scaler
    sequence: int = 0
    batches: int = 0

    def step(self, scale: float) -> None:
        self.sequence += 1
        with torch.no_grad():
            self.module.scale.fill_(scale)
        self.batches += 1
        self.sequence += 1


@pytest.fixture
def trained() -> Trained:
    return Trained(Scaler())


def replica_of(trained: Trained) -> Replica:
    """A replica brought up to date by every question that finds it behind (the server's waits ``REFRESH``)."""
    return Replica(trained.module, lambda: trained.sequence, lambda: trained.batches, torch.device("cpu"), refresh=0)


def serve(trained: Trained, **options: Any) -> tuple[PredictionServer, str]:
    replica = replica_of(trained)
    server = PredictionServer(
        replica, ServingConfig(online=True, **options), 0, RejectionLog(), "127.0.0.1", Security("token", TOKEN)
    )
    return server, f"tcp://127.0.0.1:{server.start_and_bind()}"


@pytest.fixture
def context() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def peer(context: zmq.Context, endpoint: str, token: bytes = TOKEN) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    configure_client(socket, {"MELISSA_TOKEN": token.hex()})
    socket.connect(endpoint)
    return socket


def ask(socket: zmq.Socket, ident: int, **arrays: np.ndarray) -> None:
    socket.send(pack({"id": ident}, arrays))


def answer(socket: zmq.Socket) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    assert socket.poll(ANSWER_MS), "no answer"
    return unpack(socket.recv(), "answer")


def x(n: int, value: float = 1.0) -> np.ndarray:
    return np.full((n, 3), value, np.float32)


def test_an_untrained_model_says_so_and_a_trained_one_answers_from_the_version_it_was_copied_at(
    trained: Trained, context: zmq.Context
) -> None:
    server, endpoint = serve(trained, max_wait=0.0)
    try:
        socket = peer(context, endpoint)
        ask(socket, 1, x=x(2))
        assert answer(socket)[0] == {"id": 1, "status": "no_model", "arrays": []}
        trained.step(scale=3.0)
        ask(socket, 2, x=x(2))
        header, arrays = answer(socket)
        assert (header["id"], header["status"], header["version"]) == (2, "answered", 1)
        np.testing.assert_array_equal(arrays["y"], x(2, 3.0))
        with torch.no_grad():  # changed without a step: the replica is not copied again
            trained.module.scale.fill_(5.0)
        ask(socket, 3, x=x(1))
        header, arrays = answer(socket)
        assert header["version"] == 1 and np.array_equal(arrays["y"], x(1, 3.0))
        trained.step(scale=7.0)
        ask(socket, 4, x=x(1))
        header, arrays = answer(socket)
        assert header["version"] == 2 and np.array_equal(arrays["y"], x(1, 7.0))
    finally:
        server.stop()
    assert server.error is None and server.rejections.counts() == {}


def test_requests_that_come_together_are_answered_by_one_forward_and_split_back_to_their_peers(
    trained: Trained, context: zmq.Context
) -> None:
    trained.step(scale=2.0)
    server, endpoint = serve(trained, max_batch=6, max_wait=60.0)  # served when 6 questions wait, not before
    try:
        sockets = [peer(context, endpoint) for _ in range(3)]
        for n, socket in enumerate(sockets, start=1):  # 1 + 2 + 3 questions
            ask(socket, 10 + n, x=x(n, float(n)))
        for n, socket in enumerate(sockets, start=1):
            header, arrays = answer(socket)
            assert (header["id"], header["status"]) == (10 + n, "answered")
            np.testing.assert_array_equal(arrays["y"], x(n, 2.0 * n))
    finally:
        server.stop()
    assert trained.module.calls == []  # the trainer's module answers nothing: its replica does
    assert server.replica.module.calls == [6]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "arrays, kind",
    [
        ({"z": x(1)}, "names"),
        ({"x": x(1), "z": x(1)}, "names"),
        ({"x": x(1).astype(np.float64)}, "dtype"),
        ({"x": np.ones((1, 4), np.float32)}, "shape"),
        ({"x": np.ones(3, np.float32)}, "shape"),
        ({"x": x(0)}, "oversize"),
        ({"x": x(5)}, "oversize"),
        ({"x": np.array([[1.0, np.nan, 2.0]], np.float32)}, "non_finite"),
    ],
)
def test_a_wrong_request_is_refused_with_its_reason_and_counted(
    trained: Trained, context: zmq.Context, arrays: dict[str, np.ndarray], kind: str
) -> None:
    trained.step(scale=2.0)
    server, endpoint = serve(trained, max_batch=4, max_wait=0.0)
    try:
        socket = peer(context, endpoint)
        ask(socket, 7, **arrays)
        header, _ = answer(socket)
        assert (header["id"], header["status"], header["kind"]) == (7, "refused", kind)
        ask(socket, 8, x=x(1))  # and the next is answered
        assert answer(socket)[0]["status"] == "answered"
    finally:
        server.stop()
    assert server.rejections.counts() == {f"predict_{kind}": 1}


def test_a_malformed_frame_is_refused_without_an_id_and_costs_nothing_else(
    trained: Trained, context: zmq.Context
) -> None:
    trained.step(scale=2.0)
    server, endpoint = serve(trained, max_wait=0.0)
    try:
        socket = peer(context, endpoint)
        socket.send(b"\xff\xff\xff\xff{}")
        header, _ = answer(socket)
        assert (header["id"], header["kind"]) == (-1, "malformed")
        socket.send_multipart([b"a", b"b"])
        ask(socket, 9, x=x(1))
        assert answer(socket)[0] == {"id": 9, "status": "answered", "version": 1, "arrays": [["y", "float32", [1, 3]]]}
    finally:
        server.stop()
    assert server.rejections.counts() == {"predict_malformed": 2}


def test_a_peer_asking_faster_than_it_is_answered_is_refused_beyond_its_queue(
    trained: Trained, context: zmq.Context
) -> None:
    trained.step(scale=2.0)
    server, endpoint = serve(trained, max_wait=60.0)  # nothing is served before the test stops it
    try:
        flooder = peer(context, endpoint)
        for ident in range(PEER_QUEUE + 1):
            ask(flooder, ident, x=x(1))
        header, _ = answer(flooder)
        assert (header["id"], header["kind"]) == (PEER_QUEUE, "flood")
    finally:
        server.stop()
    assert server.rejections.counts() == {"predict_flood": 1}


def test_a_predict_that_fails_costs_its_requests_their_answer_and_the_next_ones_are_answered(
    trained: Trained, context: zmq.Context
) -> None:
    trained.step(scale=2.0)
    server, endpoint = serve(trained, max_wait=0.0)
    replica: Scaler = server.replica.module  # type: ignore[assignment]
    try:
        socket = peer(context, endpoint)
        replica.fail = True
        ask(socket, 1, x=x(1))
        header, _ = answer(socket)
        assert header["kind"] == "failed" and "Scaler.predict failed: RuntimeError: out of luck" in header["error"]
        replica.fail = False
        ask(socket, 2, x=x(1))
        assert answer(socket)[0]["status"] == "answered"
    finally:
        server.stop()
    assert server.error is None and server.rejections.counts() == {"predict_failed": 1}


def test_a_peer_without_the_study_token_gets_no_connection(trained: Trained, context: zmq.Context) -> None:
    trained.step(scale=2.0)
    server, endpoint = serve(trained, max_wait=0.0)
    stranger = peer(context, endpoint, token=bytes(32))
    monitor = stranger.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    try:
        ask(stranger, 1, x=x(1))
        assert monitor.poll(ANSWER_MS) and monitor_event(monitor)[0] == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        assert not stranger.poll(0)  # refused in ZeroMQ's handshake: nothing reached the service
        member = peer(context, endpoint)
        ask(member, 2, x=x(1))
        assert answer(member)[0]["status"] == "answered"
    finally:
        # the monitor ended before its socket, as the client's links do: the context's end waited for ever once,
        # in a fresh clone's parallel run, for a monitored socket the fixture's destroy closed in another order
        stranger.disable_monitor()
        monitor.close(linger=0)
        stranger.close(linger=0)
        server.stop()
    assert server.rejections.counts()["predict_auth"] >= 1  # it may try again meanwhile


def test_a_module_is_served_online_only_with_inputs_and_whole_tables() -> None:
    check_servable(Scaler())

    class Silent(Scaler):
        prediction_inputs = {}

    with pytest.raises(ConfigError, match=r"^serving.online: Silent declares no prediction_inputs"):
        check_servable(Silent())

    class Tabled(Scaler):
        def __init__(self) -> None:
            super().__init__()
            self.nodes = ShardedEmbedding(10, 2, SGD(lr=0.1))

    with pytest.raises(ConfigError, match=r"^serving.online: Tabled has sharded embedding tables \(nodes\)"):
        check_servable(Tabled())


def test_the_replica_keeps_no_copy_a_step_may_have_torn_and_training_never_waits_for_it(trained: Trained) -> None:
    x1 = {"x": x(1)}
    stuck = itertools.chain([0], itertools.repeat(1))  # a step begins during the first copy and never ends
    torn = Replica(trained.module, lambda: next(stuck), lambda: trained.batches, torch.device("cpu"), refresh=0)
    looks = iter([0, 1, 2, 2])  # it ends: the second try copies
    retried = Replica(trained.module, lambda: next(looks), lambda: trained.batches, torch.device("cpu"), refresh=0)
    replica = replica_of(trained)
    trained.step(scale=2.0)
    assert torn.answer(x1) == (0, {})  # after FIRST_COPY: no model answers
    assert retried.answer(x1)[0] == 1
    assert replica.answer(x1)[0] == 1
    trained.sequence += 1  # a step under way: nothing is copied, the last copy answers
    with torch.no_grad():
        trained.module.scale.fill_(9.0)
    trained.batches += 1
    version, answers = replica.answer(x1)
    assert version == 1 and np.array_equal(answers["y"], x(1, 2.0))
    trained.sequence += 1
    version, answers = replica.answer(x1)  # between two steps: copied
    assert version == 2 and np.array_equal(answers["y"], x(1, 9.0))
