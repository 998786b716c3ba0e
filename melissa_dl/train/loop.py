"""The consumer loop of every rank: batches in lockstep, the bookkeeping round, the stop, the checkpoints.

Every iteration each rank tries to form a batch (waiting at most ``WAIT``
seconds), then all ranks join one small all-reduce of five counters: ranks
with a batch ready, ranks whose stream ended, whether rank 0 wants a
bookkeeping round, ranks whose buffer is full, and ranks asked to stop
(SIGTERM). So every rank takes the same decisions at the same iteration: a
training step only when all K ranks hold a batch (the global loss is the mean
of the K per-rank losses, docs/explanation/design.md#training-across-ranks), an end as soon as any rank has run dry
(no rank ever waits in a collective that another will not join), and the
study's bookkeeping while data is late. A rank keeps a batch it formed until
the step happens, so nothing is skipped. A stop happens in the round that
learns of it: if every rank holds a batch they step first; otherwise a rank
holding one gives it back to its buffer as it is, whose checkpoint keeps it
for the resumed run to train first (waiting for the others to match it may
be forever: the simulations die of the same signal). Without training, ranks
drain independently and stop when all are dry.

While data keeps up, that round costs no collective of its own: before a
step every rank takes its next batch without waiting and starts the next
round's all-reduce, which completes during the step's gradient all-reduce
(MPI progresses both in one call), so the next iteration finds its decision
made. Not before a snapshot (a rank would hold a formed batch the snapshot
misses) nor once a stop is asked for.

The loop calls the checkpoints (``checkpoint.manager``) after every step,
in every bookkeeping round, in every round where no rank holds a formed
batch, and at the end: a snapshot right after every
``checkpoint.interval``-th step (no rank then holds a formed batch) and at
the first chance after simulations ended, its commit in a later round, and a
last one when training ends or stops. The
trainer only steps and gives its state; the bookkeeping round only talks to
the study.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from mpi4py import MPI

from melissa_dl.buffers.kinds import Buffer
from melissa_dl.buffers.sample import Sample
from melissa_dl.checkpoint.manager import CheckpointManager
from melissa_dl.checkpoint.snapshots import copy_to_cpu
from melissa_dl.errors import TrainingStalled
from melissa_dl.ingest.connections import ServerSocketThread
from melissa_dl.ingest.handshake import HandshakeServer
from melissa_dl.ingest.receiver import Receiver, ReceiverReport
from melissa_dl.runtime.allocator import FreedMemory
from melissa_dl.runtime.metrics import Metrics
from melissa_dl.runtime.mpi import Comm, GracefulStop
from melissa_dl.study.learning import Records
from melissa_dl.study.progress import StatusBoard
from melissa_dl.study.study import Study
from melissa_dl.train.dataset import END, Batch
from melissa_dl.train.trainer import Trainer

logger = logging.getLogger(__name__)

WAIT = 0.05  # seconds a rank waits for its buffer before joining the next round
POLL = 0.0002  # seconds between two checks of a pending collective
READY, ENDED, DUE, FULL, STOP = range(5)  # the counters of a round
DRAIN_BATCH = 64  # samples taken from the buffer at once without training


class Outcome(Enum):
    ENDED = "ended"  # a rank (lockstep) or every rank (draining) ran dry after reception ended
    STOPPED = "stopped"  # on request


class Consumer(Protocol):
    """What the bookkeeping round asks of whatever consumes a rank's buffer: the ``Trainer``, or ``Drain``."""

    def consumed(self) -> int:
        """Samples taken from this rank's buffer so far."""
        ...

    def status(self) -> dict[str, Any] | None:
        """Where training stands, for the study's status (None without training)."""
        ...

    def take_losses(self) -> Records | None:
        """This rank's losses per sample since the last call, for a sampler that learns (None if none)."""
        ...

    def take_held_out(self, samples: list[Sample]) -> None:
        """Collective, once every held-out simulation ended: this rank's share of their samples, as received."""
        ...


class Drain:
    """The consumer of ranks without a training module: it counts what it takes."""

    def __init__(self) -> None:
        self.drained = 0

    def consumed(self) -> int:
        return self.drained

    def status(self) -> None:
        return None

    def take_losses(self) -> None:
        return None

    def take_held_out(self, samples: list[Sample]) -> None:
        pass  # nothing validates


class Bookkeeping:
    """The ranks' bookkeeping round: reports to rank 0, the study's decisions, the end of reception, and every
    rank's freed memory given back to the kernel from time to time.

    ``study``, ``handshake`` and ``status`` are rank 0's; the other ranks pass none. ``metrics`` gets the
    study's generations.
    """

    def __init__(
        self,
        comm: Comm,
        receiver: Receiver,
        interval: float,
        heartbeat: Path,
        study: Study | None = None,
        handshake: HandshakeServer | None = None,
        status: StatusBoard | None = None,
        metrics: Metrics | None = None,
        services: Sequence[ServerSocketThread] = (),
    ) -> None:
        self.comm = comm
        self.receiver = receiver
        self.services = services  # the rank's other sockets (its prediction service): a failure ends the job
        self.interval = interval
        self.heartbeat = heartbeat
        self.study = study
        self.handshake = handshake
        self.status = status
        self.metrics = metrics if metrics is not None else Metrics(None)
        self.next_sync = time.monotonic() + interval
        self.freed = FreedMemory()
        self.over = False
        self._ended = False  # simulations ended since the last take_ended (every rank knows, from the news)
        self._held_out_given = False  # the held-out samples went to the consumer

    def due(self) -> bool:
        """Also after the study is over: draining the buffers still commits checkpoints and beats the heart."""
        return time.monotonic() >= self.next_sync

    def sync(self, consumer: Consumer, stopping: bool = False) -> None:
        """Collective: rank 0 learns what every rank received and its ``consumer`` consumed, advances the study
        (``stopping``: without failing or launching simulations, see ``Study.tick``), shows where it and training
        stand, and tells the ranks which attempts are current, which simulations finished, and whether the study is
        over."""
        self.receiver.check()
        for service in self.services:
            service.check()
        reports = self.gather(consumer)
        total = self.comm.reduce(consumer.consumed())  # rank 0's; None elsewhere
        news: Any
        over, news, held_out = False, ({}, [], {}), False  # without a study (benches): nothing to follow
        if self.study is not None:
            assert self.handshake is not None and self.status is not None and total is not None
            if self.handshake.error is not None:
                raise self.handshake.error
            for sim, reason in self.handshake.take_failures():
                self.study.fail(sim, reason)
            self.study.tick(reports, stopping=stopping)
            for generation in self.study.take_generations():
                generation.write(self.metrics)
            self.status.update(time.monotonic(), self.study, reports, total, consumer.status())
            over, news, held_out = self.study.over, self.study.take_news(), self.study.held_out_ended
        was_over = self.over
        self.over, news, held_out = self.comm.bcast((over, news, held_out))
        self.receiver.follow(*news)
        self._ended |= bool(news[1])
        if held_out and not self._held_out_given:
            self._held_out_given = True
            consumer.take_held_out(self.receiver.held_out())
        self.beat()
        if self.over and not was_over:  # every simulation is done or failed: what is buffered is all there will be
            self.receiver.stop()
            self.receiver.buffer.close()
            self.freed.release()  # the connections' memory, freed with the sockets
        else:
            self.freed.release_if_due()
        self.next_sync = time.monotonic() + self.interval

    def take_ended(self) -> bool:
        """Whether simulations ended (done or failed) since the last call: the same on every rank."""
        ended, self._ended = self._ended, False
        return ended

    def gather(self, consumer: Consumer) -> list[ReceiverReport]:
        """Collective: every rank's receiver report, on rank 0 (elsewhere an empty list), whose study learns the
        losses per sample that came with them."""
        gathered = self.comm.gather((self.receiver.report(), consumer.take_losses()))
        if gathered is None:
            return []
        if self.study is not None:
            self.study.learn([losses for _, losses in gathered if losses is not None])
        return [report for report, _ in gathered]

    def open(self, consumer: Consumer) -> None:
        """The first two rounds: the first simulations' parameters go to the ranks, then they are launched."""
        self.sync(consumer)
        self.sync(consumer)

    def beat(self) -> None:
        """Rank 0 tells ``melissa-launcher`` that the ranks got through a collective round."""
        if self.study is not None:
            try:
                os.utime(self.heartbeat)  # needs no file descriptor, unlike touch()
            except FileNotFoundError:  # the study's first: the supervisor takes it for the end of the start
                self.heartbeat.touch()


class Loop:
    """Consumes a rank's buffer in rounds with the other ranks until the study ends or a stop is asked for."""

    def __init__(
        self, comm: Comm, bookkeeping: Bookkeeping, stop: GracefulStop, checkpoints: CheckpointManager | None = None
    ) -> None:
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.bookkeeping = bookkeeping
        self.buffer: Buffer = bookkeeping.receiver.buffer
        self.stop = stop
        self.checkpoints = checkpoints

    def train(self, trainer: Trainer, next_batch: Callable[[float], Any], stall_timeout: float) -> Outcome:
        """Train in lockstep, first on the batches a stopped run left this rank's buffer (``Buffer.hold``);
        snapshot when the checkpoints say so and at the end. ``stall_timeout``: see ``_check_stall``."""
        assert self.checkpoints is not None
        checkpoints, summary = self.checkpoints, trainer.summary

        def held_first(wait: float) -> Any:
            held = self.buffer.take_held()
            return held if held is not None else next_batch(wait)

        def step(batch: Any) -> None:
            trainer.step(batch)
            checkpoints.after_step(summary.batches, summary.samples)

        checkpoints.begin()
        self.bookkeeping.open(trainer)  # the simulations start while begin() runs
        start = time.monotonic()  # the first validation counts, as it always did
        trainer.begin()
        self.stop.install()  # a signal before is an exit: there is nothing to checkpoint yet
        outcome = self._rounds(
            trainer,
            held_first,
            step,
            stall_timeout,
            look_ahead=lambda: not checkpoints.due(summary.batches + 1),
            idle=lambda: checkpoints.when_idle(summary.batches, summary.samples),
            hold=self._hold,
        )
        summary.duration_s += time.monotonic() - start
        self._log(outcome, summary.batches)
        if outcome is Outcome.ENDED:
            trainer.validate_unless_done()
        checkpoints.snapshot(summary.batches, summary.samples)
        checkpoints.final(complete=outcome is Outcome.ENDED)
        trainer.close()
        return outcome

    def drain(self, tally: Drain) -> Outcome:
        """Without training: take what the buffer serves and count it in ``tally``, independently of the other
        ranks."""

        def next_samples(wait: float) -> list[Sample] | object | None:
            samples = self.buffer.get_batch(DRAIN_BATCH, timeout=wait)
            return END if samples == [] else samples

        def count(samples: list[Sample]) -> None:
            tally.drained += len(samples)

        self.bookkeeping.open(tally)
        return self._rounds(tally, next_samples, count, stall_timeout=None)

    def _rounds(
        self,
        consumer: Consumer,
        next_batch: Callable[[float], Any],
        step: Callable[[Any], None],
        stall_timeout: float | None,
        look_ahead: Callable[[], bool] = lambda: False,
        idle: Callable[[], None] = lambda: None,
        hold: Callable[[Any], None] = lambda batch: None,
    ) -> Outcome:
        """Consume until one rank (with a ``stall_timeout``: lockstep training) or every rank (without:
        independent draining) is dry, or a rank was asked to stop.

        When every rank steps, the next round may travel with the step (see ``_step_ahead``) if
        ``look_ahead()`` allows holding the next batch through it (not before a snapshot). In lockstep,
        ``idle()`` is called in every round where no rank holds a formed batch, and at a stop a batch the
        other ranks could not match goes to ``hold``.
        """
        synchronous = stall_timeout is not None
        flags, next_flags = np.zeros(5, dtype=np.int64), np.zeros(5, dtype=np.int64)
        pending, ahead = None, False  # ahead: this round's flags came with the last step, in next_flags
        self._stalled_since: float | None = None
        while True:
            if ahead:
                flags, next_flags = next_flags, flags
            else:
                if pending is None:
                    pending = next_batch(WAIT)
                self._wait(self._exchange(flags, pending))
            ready, ahead = pending is not None and pending is not END, False
            if flags[DUE]:
                self.bookkeeping.sync(consumer, stopping=bool(flags[STOP]) or self.stop.requested)
                if self.checkpoints is not None:
                    self.checkpoints.sync(ended=self.bookkeeping.take_ended())
            if flags[ENDED] >= (1 if synchronous else self.size):
                return Outcome.ENDED
            if synchronous and flags[READY] == 0:
                idle()
            if ready and (flags[READY] == self.size or not synchronous):
                if synchronous and not flags[STOP] and look_ahead():
                    pending, ahead = self._step_ahead(step, pending, next_batch, next_flags), True
                else:
                    step(pending)
                    pending = None
            if flags[STOP]:
                if pending is not None and pending is not END:
                    hold(pending)
                return Outcome.STOPPED
            if synchronous:
                self._check_stall(flags, stall_timeout)  # type: ignore[arg-type]

    def _hold(self, batch: Batch) -> None:
        """A batch formed here that the other ranks could not match when training stopped: back to the buffer,
        whose checkpoint keeps it (copied: it may view memory the buffer reuses)."""
        self.buffer.hold(Batch(copy_to_cpu(batch.data), batch.ids.copy()))
        logger.info("rank %d keeps a batch of %d samples for the resumed run to train first", self.rank, len(batch))

    def _step_ahead(
        self, step: Callable[[Any], None], batch: Any, next_batch: Callable[[float], Any], flags: np.ndarray
    ) -> Any:
        """Step on ``batch`` with the next round in flight: the next batch is taken first (without waiting),
        and the round's all-reduce, started before the step, completes during the step's gradient
        all-reduce, so that lockstep costs no collective of its own. ``flags`` receives the next round's;
        returns the next batch (None if none was ready, or END)."""
        following = next_batch(0)
        request = self._exchange(flags, following)
        step(batch)
        self._wait(request)
        return following

    def _exchange(self, flags: np.ndarray, pending: Any) -> MPI.Request:
        """Start the round's all-reduce of what this rank holds and wants."""
        flags[:] = (
            pending is not None and pending is not END,
            pending is END,
            self.rank == 0 and self.bookkeeping.due(),
            self.buffer.producer_waiting,
            self.stop.requested,
        )
        return self.comm.Iallreduce(MPI.IN_PLACE, flags)

    @staticmethod
    def _wait(request: MPI.Request) -> None:
        """Polled rather than waited in: simulations and the other ranks may share these cores."""
        while not request.Test():
            time.sleep(POLL)

    def _check_stall(self, flags: np.ndarray, stall_timeout: float) -> None:
        """In lockstep, a rank without data while another rank's buffer is full can wait forever (that
        buffer's clients are blocked, so the study cannot end): after ``stall_timeout`` seconds of it the job
        stops with an error instead."""
        if flags[READY] == self.size or flags[FULL] == 0:
            self._stalled_since = None
            return
        self._stalled_since = self._stalled_since or time.monotonic()
        if time.monotonic() - self._stalled_since > stall_timeout:
            raise TrainingStalled(
                f"training stalled for {stall_timeout:g} s: {self.size - flags[READY]} of {self.size} ranks have "
                f"no batch while {flags[FULL]} have a full buffer (routing sends them no data: with "
                "server.bind_simulation_to_server_rank, run at least as many simulations at once as ranks; with "
                "training.window, also make each rank's buffer hold a block of each, or make the blocks shorter)"
            )

    def _log(self, outcome: Outcome, batches: int) -> None:
        if outcome is Outcome.STOPPED:
            logger.info("training stopped on request after %d batches", batches)
        else:
            logger.info(
                "training stopped after %d batches; %d buffered samples left untrained (training stops "
                "when the first rank runs dry)",
                batches,
                len(self.buffer),
            )
