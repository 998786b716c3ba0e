"""Predictions while the model trains: each training rank answers the simulations' questions (``serving.online``).

A rank's prediction service is a ROUTER socket in a thread of its own, under the study's credentials like every
server socket (:mod:`melissa_dl.wire.security`), so intake and training go on whatever it is asked. The requests
that arrive together, up to ``serving.max_batch`` questions or for at most ``serving.max_wait`` seconds (0: what
has arrived; those that arrive during a forward are the next batch), are answered by one ``predict`` of a
:class:`Replica`, then split back to their peers, each answer carrying the version it came from
(:mod:`melissa_dl.wire.predictions`).

Why a replica, not the module that trains: a step runs the module in ``train()`` mode and its optimizers change
the parameters in place, so a forward from another thread would see dropout on and half-updated weights. The
replica is a copy in ``eval()`` mode that a batch of questions brings up to date when the trainer has stepped
since (:class:`Replica`), copied between two optimizer steps without ever making training wait. It costs two
more copies of the model (the replica and its spare).

A module with sharded embedding tables is refused (:func:`check_servable`): a rank holds one shard of each, and a
lookup is a collective of every training rank, which a serving thread cannot join. Such a model is asked after
the study (``melissa-server --serve``, ``load_model``, ``model.ts``), where its tables are whole.

What a peer may cost a rank is bounded: one frame per request, capped at the largest request of ``max_batch``
questions (a larger one ends its connection unread, counted as ``predict_cut``); ``PEER_QUEUE`` requests queued
per connection; a peer with ``PEER_QUEUE`` requests waiting for a batch has its next ones refused (``flood``). A
wrong request is refused with an answer saying why, counted as ``predict_<kind>`` with the rank's other
refusals.
"""

from __future__ import annotations

import copy
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
import zmq

from melissa_dl.embeddings.table import ShardedEmbedding
from melissa_dl.errors import ConfigError, ProtocolError
from melissa_dl.ingest.connections import POLL_MS, ConnectionGuard, ServerSocketThread
from melissa_dl.train.module import TrainingModule
from melissa_dl.wire.predictions import Inputs, count_questions, described, pack, request_bytes, unpack
from melissa_dl.wire.rejections import RejectionLog
from melissa_dl.wire.security import Security

if TYPE_CHECKING:
    from melissa_dl.config.sections import ServingConfig
    from melissa_dl.train.trainer import Trainer

PEER_QUEUE = 4  # requests one connection may have queued or waiting: a client asks one at a time
REFRESH = 0.02  # seconds: the least age of a replica brought up to date (each copy costs the serving thread)
FIRST_COPY = 1.0  # seconds the first copy of a trained model is tried for, before the rank answers "no model"
COPY_RETRY = 0.0005  # seconds between two tries of it


def check_servable(module: TrainingModule) -> None:
    """Refuse, before the study starts, a module whose predictions a training rank cannot answer alone."""
    name = type(module).__name__
    if not module.prediction_inputs:
        raise ConfigError(f"serving.online: {name} declares no prediction_inputs, so nothing can be asked of it")
    tables = [path for path, m in module.named_modules() if isinstance(m, ShardedEmbedding)]
    if tables:
        raise ConfigError(
            f"serving.online: {name} has sharded embedding tables ({', '.join(tables)}), whose lookups are "
            "collectives of the training ranks: ask it after the study (melissa-server --serve, load_model, model.ts), "
            "where they are whole"
        )


def clients_guide(serving: ServingConfig, inputs: Inputs, endpoints: list[str | None]) -> dict[str, Any]:
    """What clients are told of the predictions (by the handshake, or ``serving.json``): each rank's service, the
    inputs, the limits."""
    return {
        "endpoints": endpoints,
        "inputs": described(inputs),
        "max_batch": serving.max_batch,
        "deadline": serving.deadline,
    }


def predict_numpy(module: TrainingModule, inputs: dict[str, np.ndarray], device: torch.device) -> dict[str, np.ndarray]:
    """``module.predict`` of numpy questions on ``device``, without gradients; its answers as numpy arrays."""
    tensors = {name: torch.from_numpy(array).to(device) for name, array in inputs.items()}
    with torch.no_grad():
        outputs = module.predict(tensors)
    return {name: tensor.detach().cpu().numpy() for name, tensor in outputs.items()}


class Replica:
    """The model that answers, beside the one that trains: a copy in ``eval()`` mode, brought up to date by a
    batch of questions that finds the trainer ahead of it and the copy ``refresh`` seconds old (or untrained).

    The copy is made into a spare replica between two looks at the trainer's ``step_sequence`` (odd while its
    optimizers change the module) and taken only if no step came between them; otherwise the current replica
    answers and the next batch tries again. So training never waits, and an answer's version is exactly the
    state it came from."""

    def __init__(
        self,
        module: TrainingModule,
        sequence: Callable[[], int],
        batches: Callable[[], int],
        device: torch.device,
        refresh: float = REFRESH,
    ) -> None:
        self.module, self._spare = self._copy(module), self._copy(module)
        self.inputs = dict(module.prediction_inputs)
        self._source, self._sequence, self._batches, self._device = module, sequence, batches, device
        self._refresh_every = refresh
        self.version = batches()
        self._refreshed = -math.inf

    @staticmethod
    def _copy(module: TrainingModule) -> TrainingModule:
        try:
            copied = copy.deepcopy(module)
        except Exception as error:  # the user's module may hold what does not copy (a file, a lock)
            raise ConfigError(
                f"serving.online: {type(module).__name__} cannot be copied to answer predictions "
                f"({type(error).__name__}: {error})"
            ) from None
        return copied.eval().requires_grad_(False)

    def trained(self) -> int:
        """Batches the trainer has stepped: 0 while no model exists."""
        return self._batches()

    def answer(self, inputs: dict[str, np.ndarray]) -> tuple[int, dict[str, np.ndarray]]:
        """The version that answers and its answers to ``inputs`` (``[n, ...]`` each); none while the copy is
        untrained (version 0)."""
        self._refresh()
        if not self.version:
            return 0, {}
        return self.version, predict_numpy(self.module, inputs, self._device)

    def _refresh(self) -> None:
        """Try to copy the trainer's state once; an untrained copy, until ``FIRST_COPY`` seconds have passed."""
        end = time.monotonic() + FIRST_COPY
        while not self._copied() and not self.version and time.monotonic() < end:
            time.sleep(COPY_RETRY)  # a step under way: the first trained copy is worth the wait

    def _copied(self) -> bool:
        """Whether the replica is the trainer's state (or recent enough), after one try to copy it."""
        before, version, now = self._sequence(), self._batches(), time.monotonic()
        if version == self.version or now - self._refreshed < self._refresh_every and self.version:
            return True
        if before % 2:
            return False
        self._spare.load_state_dict(self._source.state_dict())
        if self._sequence() != before:  # a step began meanwhile: the spare may be torn
            return False
        self.module, self._spare = self._spare, self.module
        self.version, self._refreshed = version, now
        return True


class Answering(Protocol):
    """What answers a rank's questions: a :class:`Replica` of the module that trains, or a study's final model
    (``serving.standalone``)."""

    inputs: dict[str, tuple[str, tuple[int, ...]]]
    module: TrainingModule

    def trained(self) -> int:
        """The version a question would get: 0 while no model exists."""
        ...

    def answer(self, inputs: dict[str, np.ndarray]) -> tuple[int, dict[str, np.ndarray]]:
        """The version that answers and its answers (none at version 0)."""
        ...


@dataclass(frozen=True)
class _Request:
    peer: bytes
    id: int
    questions: int
    arrays: dict[str, np.ndarray]


class PredictionServer(ServerSocketThread):
    """One rank's prediction service; its refusals are counted in ``rejections`` (the receiver's)."""

    socket_type = zmq.ROUTER
    guard_name = "predict"

    def __init__(
        self,
        replica: Answering,
        serving: ServingConfig,
        server_rank: int,
        rejections: RejectionLog,
        bind_address: str,
        security: Security,
        port: int = 0,
    ) -> None:
        cap = request_bytes(replica.inputs, serving.max_batch)
        super().__init__(f"predictions-{server_rank}", bind_address, port, security=security, message_cap=cap)
        self.rejections = rejections
        self.replica = replica
        self._max_batch, self._max_wait = serving.max_batch, serving.max_wait
        self._waiting: list[_Request] = []
        self._questions = 0  # that the waiting requests ask
        self._since = 0.0  # when the first waiting request came
        self._per_peer: Counter[bytes] = Counter()

    @classmethod
    def for_trainer(
        cls, trainer: Trainer, serving: ServingConfig, rejections: RejectionLog, bind_address: str, security: Security
    ) -> PredictionServer:
        replica = Replica(
            trainer.module, lambda: trainer.step_sequence, lambda: trainer.summary.batches, trainer.device
        )
        return cls(replica, serving, trainer.rank, rejections, bind_address, security)

    def configure(self, socket: zmq.Socket) -> None:
        socket.setsockopt(zmq.RCVHWM, PEER_QUEUE)

    def handle(self, socket: zmq.Socket, guard: ConnectionGuard) -> None:
        for _ in range(self._max_batch):  # what came together, up to a batch
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._take(socket, frames)
            if self._questions >= self._max_batch:
                self._serve(socket)

    def idle(self, socket: zmq.Socket) -> None:
        if self._waiting and time.monotonic() - self._since >= self._max_wait:
            self._serve(socket)

    def wait_ms(self) -> int:
        due = POLL_MS if not self._waiting else math.ceil((self._since + self._max_wait - time.monotonic()) * 1000)
        return max(0, min(POLL_MS, due))  # the stop flag is looked at every POLL_MS

    def _take(self, socket: zmq.Socket, frames: list[bytes]) -> None:
        """Check one request: refused, answered that no model exists yet, or kept for the next batch."""
        if len(frames) != 2:  # a DEALER peer's request is one part; ROUTER puts the peer's id before it
            self.rejections.reject("predict_malformed", f"predict socket: a request of {len(frames) - 1} parts")
            return
        peer, frame = frames
        ident = -1
        try:
            header, arrays = unpack(frame, "prediction request")
            ident = header["id"]
            if self._per_peer[peer] >= PEER_QUEUE:
                raise ProtocolError(f"prediction request: {PEER_QUEUE} of this peer's are waiting already", "flood")
            n = count_questions(arrays, self.replica.inputs, self._max_batch, "prediction request")
        except ProtocolError as error:
            self._refuse(socket, peer, ident, error.kind, str(error))
            return
        if self.replica.trained() == 0:
            self._reply(socket, peer, {"id": ident, "status": "no_model"})
            return
        if not self._waiting:
            self._since = time.monotonic()
        self._waiting.append(_Request(peer, ident, n, arrays))
        self._questions += n
        self._per_peer[peer] += 1

    def _serve(self, socket: zmq.Socket) -> None:
        """Answer every waiting request with one ``predict``."""
        batch, self._waiting, total = self._waiting, [], self._questions
        self._questions = 0
        self._per_peer.clear()
        inputs = {name: np.concatenate([request.arrays[name] for request in batch]) for name in self.replica.inputs}
        try:
            version, outputs = self.replica.answer(inputs)
            for name, array in outputs.items():
                if array.ndim == 0 or len(array) != total:
                    raise ValueError(f"output '{name}' is {list(array.shape)} for {total} questions")
        except Exception as error:  # the user's predict: it costs these requests their answer, not the rank
            said = f"prediction: {type(self.replica.module).__name__}.predict failed: {type(error).__name__}: {error}"
            for request in batch:
                self._refuse(socket, request.peer, request.id, "failed", said)
            return
        if not version:  # the first copy of a trained model was not made yet
            for request in batch:
                self._reply(socket, request.peer, {"id": request.id, "status": "no_model"})
            return
        start = 0
        for request in batch:
            end = start + request.questions
            answer = {name: array[start:end] for name, array in outputs.items()}
            self._reply(socket, request.peer, {"id": request.id, "status": "answered", "version": version}, answer)
            start = end

    def _refuse(self, socket: zmq.Socket, peer: bytes, ident: int, kind: str, message: str) -> None:
        """Count a refusal and tell the peer why."""
        self.rejections.reject(f"predict_{kind}", message)
        self._reply(socket, peer, {"id": ident, "status": "refused", "kind": kind, "error": message})

    @staticmethod
    def _reply(
        socket: zmq.Socket, peer: bytes, header: dict[str, Any], arrays: dict[str, np.ndarray] | None = None
    ) -> None:
        """Send an answer; a peer that left meanwhile, or whose queue is full, loses it (ROUTER drops it)."""
        socket.send_multipart([peer, pack(header, arrays or {})])
