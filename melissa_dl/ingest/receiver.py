"""The receiver thread of a server rank: data socket -> assembler -> buffer.

The thread owns the rank's PULL socket from bind to close. Back-pressure is the
buffer's: while a put waits, the thread does not read, ZeroMQ's high-water
marks fill up and clients block in ``send`` — nothing is dropped. Bad frames
are refused and counted; any other exception is kept and re-raised in the main
thread by :meth:`Receiver.check`, which ends the job.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq

from melissa_dl.buffers.kinds import Buffer
from melissa_dl.buffers.sample import Sample
from melissa_dl.errors import ProtocolError, ReceiverDied
from melissa_dl.ingest.assembly import Assembler, Delivery, Progress, StreamSpec
from melissa_dl.ingest.connections import POLL_MS, ConnectionGuard, ServerSocketThread
from melissa_dl.ingest.delivery import DeliveryServer
from melissa_dl.ingest.ledger import Ledger
from melissa_dl.wire.rejections import merge_rejections
from melissa_dl.wire.security import Security, hello_bytes

if TYPE_CHECKING:
    from melissa_dl.checkpoint.recovery import OldRanks
    from melissa_dl.config.sections import ServerConfig

logger = logging.getLogger(__name__)


@dataclass
class ReceiverReport:
    """What a rank sends rank 0 at each synchronisation."""

    progress: dict[int, Progress] = field(default_factory=dict)
    active: set[int] = field(default_factory=set)  # simulations that sent anything since the last report
    refused: dict[int, tuple[str, str]] = field(default_factory=dict)  # simulation -> its first frame refused
    blocked: bool = False  # the buffer made the receiver wait since the last report
    bytes_received: int = 0
    samples: int = 0  # steps received that this rank owns (with windows, not the copies of another rank's)
    duplicate_frames: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    buffer_size: int = 0
    passes: tuple[int, int] | None = None  # after the data: the buffer's passes done, of training.epochs_after_data


class Receiver(ServerSocketThread):
    socket_type = zmq.PULL
    guard_name = "data"

    def __init__(
        self,
        spec: StreamSpec,
        buffer: Buffer,
        bind_address: str,
        receive_queue_bytes: int,
        security: Security | None = None,
    ) -> None:
        super().__init__(
            f"receiver-{spec.server_rank}",
            bind_address,
            security=security if security is not None else Security("token", spec.token),
            message_cap=max(spec.part_bytes, hello_bytes(spec.fields)),
        )  # DECLARE: fields' JSON
        self.spec = spec
        self.buffer = buffer
        self._assembler = Assembler(spec, self.rejections)
        self.delivery = DeliveryServer(
            spec.server_rank, spec.token, self._delivery, self.rejections, bind_address, self.security
        )
        # ZeroMQ counts messages, not bytes: size the queue for the largest part allowed
        self._hwm = max(2, receive_queue_bytes // spec.part_bytes)
        self._lock = threading.Lock()
        self._held_out: list[Sample] = []  # the held-out simulations' samples (``study.validation``): not buffered
        self._blocked = False
        self._last_scalars = (time.monotonic(), 0)  # time, bytes received
        self._last_waits: tuple[float, float] | None = None  # the buffer's put and get waits (s), restored ones too

    @classmethod
    def from_config(
        cls, server: ServerConfig, spec: StreamSpec, buffer: Buffer, bind_address: str, security: Security
    ) -> Receiver:
        """The receiver of ``spec``'s rank, with the receive queue the ``server`` section sizes."""
        return cls(spec, buffer, bind_address, server.receive_queue_bytes, security)

    def start_and_bind(self, timeout: float = 30.0) -> int:
        """Start the data socket's thread and the delivery service's; return the data port."""
        port = super().start_and_bind(timeout)
        self.delivery.start_and_bind(timeout)
        return port

    def endpoints(self, host: str) -> tuple[str, str]:
        """Where clients reach this rank once started: its data socket and its delivery service."""
        return f"tcp://{host}:{self.port}", f"tcp://{host}:{self.delivery.port}"

    def stop(self) -> None:
        self.delivery.stop()
        super().stop()

    def configure(self, socket: zmq.Socket) -> None:
        socket.setsockopt(zmq.RCVHWM, self._hwm)

    def _delivery(self, sim: int, attempt: int, client_rank: int) -> Delivery:
        with self._lock:
            return self._assembler.delivery(sim, attempt, client_rank)

    def handle(self, socket: zmq.Socket, guard: ConnectionGuard) -> None:
        frames = socket.recv_multipart(copy=False)
        try:
            with self._lock:
                sample = self._assembler.handle([f.buffer for f in frames])
        except ProtocolError as error:
            self.rejections.reject(error.kind, str(error))
            return
        if sample is None:
            return
        if self.spec.held_out(sample.simulation_id):
            with self._lock:
                self._held_out.append(sample)
                self._assembler.commit(sample)
            return
        while not self.buffer.put(sample, timeout=POLL_MS / 1000, on_insert=lambda: self._commit(sample)):
            self._blocked = True
            guard.check()  # connections still come while the buffer makes us wait
            if self._stop_event.is_set():
                return

    def _commit(self, sample: Sample) -> None:
        with self._lock:
            self._assembler.commit(sample)

    def state_dict(self) -> dict[str, Any]:
        """The buffer and the ledger, consistent: a step is in the ledger exactly when the buffer took it.

        With them, the counters the final report adds up, so that a restart forgets none.
        """

        def assembler() -> tuple[dict[str, Any], list[dict[str, Any]]]:
            with self._lock:
                return self._assembler.state_dict(), [sample.state() for sample in self._held_out]

        buffer, (received, held_out) = self.buffer.state_dict_with(assembler)
        return {"buffer": buffer, **received, "held_out": held_out, "rejected": self.rejections.state_dict()}

    def held_out(self) -> list[Sample]:
        """The held-out simulations' samples this rank received (the validation set's share that came here)."""
        with self._lock:
            return list(self._held_out)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Before ``start``: the buffered samples, the steps received (their second arrival is dropped), the
        counters."""
        self.buffer.load_state_dict({**state["buffer"], "closed": False})
        self._load_received(state)

    def _load_received(self, state: dict[str, Any]) -> None:
        """What a checkpoint holds besides the buffer: the ledger and counters, the held-out samples."""
        self._assembler.load_state_dict(state)
        self._held_out = [Sample.from_state(entry) for entry in state.get("held_out", [])]
        self.rejections.load_state_dict(state["rejected"])

    def load_resharded(self, old: OldRanks) -> None:
        """Before ``start``, from a checkpoint of another number of ranks: the steps of every old ledger that
        the new routing sends this rank, an equal share of the old buffered samples (as the buffer's kind shares
        them) and of the held-out ones, and on rank 0 the old ranks' counters added up."""
        spec = self.spec
        streams = [old.read(rank) for rank in range(old.size)]
        self.buffer.load_resharded([stream["buffer"] for stream in streams], spec.server_rank, spec.server_size)
        ledger = Ledger()
        for stream in streams:  # with windows, a step this rank lacks for a window to make is received again
            ledger.merge(
                stream["ledger"],
                lambda sim, steps: spec.route.holds(spec.server_rank, sim, steps) & ~self.buffer.lacks(sim, steps),
            )
        held_out = [entry for stream in streams for entry in stream.get("held_out", [])]
        first = spec.server_rank == 0  # the old ranks' counters, added up once
        self._load_received(
            {
                "ledger": ledger.state_dict(),
                "bytes_received": sum(s["bytes_received"] for s in streams) if first else 0,
                "duplicates": sum(s["duplicates"] for s in streams) if first else 0,
                "rejected": merge_rejections([s["rejected"] for s in streams]) if first else {},
                "held_out": held_out[spec.server_rank :: spec.server_size],
            }
        )

    def follow(self, attempts: dict[int, int], finished: list[int], parameters: dict[int, np.ndarray]) -> None:
        """Rank 0's news: newer attempts (their predecessors' frames are refused), finished simulations, and the
        parameters of the simulations about to be launched."""
        with self._lock:
            for sim, row in parameters.items():
                self.spec.parameters[sim] = row
            for sim, attempt in attempts.items():
                self._assembler.start_attempt(sim, attempt)
            for sim in finished:
                self._assembler.finish(sim)
        for sim in finished:  # the buffer's lock, not under ours (``report``)
            self.buffer.end_simulation(sim)

    def check(self) -> None:
        """Re-raise in the caller's thread an exception that killed the receiver or its delivery service."""
        for thread in (self, self.delivery):
            if thread.error is not None:
                raise ReceiverDied(f"{thread.name} thread failed: {thread.error!r}") from thread.error

    def scalars(self) -> dict[str, float]:
        """TensorBoard points of the stream since the last call: the buffer's fill, the share of the time its puts
        (a full buffer) and its gets (an empty one) waited, the bytes received per second."""
        now, received = time.monotonic(), self._assembler.bytes_received  # one int read: atomic under the GIL
        waits = self.buffer.put_wait_seconds, self.buffer.get_wait_seconds
        then, before = self._last_scalars
        put_before, get_before = self._last_waits or waits  # a restored buffer's waits are not this run's
        self._last_scalars, self._last_waits = (now, received), waits
        put_wait, get_wait = waits
        seconds = max(now - then, 1e-9)
        return {
            "stream/buffer_samples": len(self.buffer),
            "stream/put_waiting": (put_wait - put_before) / seconds,
            "stream/get_waiting": (get_wait - get_before) / seconds,
            "stream/received_bytes_per_s": (received - before) / seconds,
        }

    def _passes(self) -> tuple[int, int] | None:
        done, passes = self.buffer.passes_done, self.buffer.passes_after_data
        return None if done is None or passes is None else (done, passes)

    def report(self) -> ReceiverReport:
        passes = self._passes()  # the buffer's lock, not under ours: a put holds it and then takes ours (_commit)
        with self._lock:
            progress = self._assembler.take_progress()
            report = ReceiverReport(
                progress=progress,
                active=set(progress),
                refused=self._assembler.take_refused(),
                blocked=self._blocked,
                bytes_received=self._assembler.bytes_received,
                samples=self._assembler.ledger.total() - self._assembler.copies,  # each step once
                duplicate_frames=self._assembler.duplicates,
                rejected=self.rejections.counts(),
                buffer_size=len(self.buffer),
                passes=passes,
            )
            self._blocked = False
        return report
