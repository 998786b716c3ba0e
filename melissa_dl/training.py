"""The server's consumer loop: online training (or plain draining) in lockstep.

Every iteration each rank tries to form a batch (waiting at most ``WAIT``
seconds), then all ranks join one small all-reduce of five counters: ranks
with a batch ready, ranks whose stream ended, whether rank 0 wants a
bookkeeping round, ranks whose buffer is full, and ranks asked to stop
(SIGTERM). So every rank takes the same decisions at the same iteration: a
training step only when all K ranks hold a batch (the global loss is the mean
of the K per-rank losses, DESIGN §5), a stop as soon as any rank has run dry
(no rank ever waits in a collective that another will not join), and the
study's bookkeeping while data is late. Checkpoints are taken right after a
step, when no rank holds a formed batch. A rank keeps a batch it formed
until the step happens, so nothing is skipped. Without training, ranks drain
independently and stop when all are dry.
"""
from __future__ import annotations

import copy
import io
import logging
import os
import random
import resource
import time
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

import numpy as np
import torch
from mpi4py import MPI
from torch.utils._pytree import tree_leaves

from melissa_dl.collectives import GradientAverager, make_collectives
from melissa_dl.buffers import Buffer
from melissa_dl.config import TrainingConfig
from melissa_dl.dataset import END, StreamDataset, collate
from melissa_dl.embedding import ShardedEmbedding, set_default_collectives
from melissa_dl.errors import ConfigError, TrainingStalled
from melissa_dl.files import write_atomic
from melissa_dl.module import TrainingModule, load_module_class
from melissa_dl.mpi import Comm
from melissa_dl.receiver import Receiver
from melissa_dl.snapshots import BackgroundCopy, copy_to_cpu

if TYPE_CHECKING:
    from melissa_dl.recovery import Checkpointer

logger = logging.getLogger(__name__)

WAIT = 0.05  # seconds a rank waits for its buffer before joining the next round
POLL = 0.0002  # seconds between two checks of a pending collective
STOP_WAIT = 20.0  # seconds a requested stop waits for a round where no rank holds a formed batch


class Outcome(Enum):
    ENDED = "ended"  # a rank (lockstep) or every rank (draining) ran dry after reception ended
    STOPPED = "stopped"  # on request, at a round where no rank held a formed batch: safe to checkpoint
    STOPPED_MIDWAY = "stopped midway"  # on request, but no such round came within STOP_WAIT seconds


class Control(Protocol):
    """The ranks' bookkeeping round (a collective), driven by rank 0's clock."""

    def due(self) -> bool: ...

    def sync(self) -> None: ...

    def stop_requested(self) -> bool: ...


def lockstep(
    comm: Comm,
    next_batch: Callable[[float], Any],
    step: Callable[[Any], None],
    control: Control,
    buffer: Buffer,
    stall_timeout: float | None,
) -> Outcome:
    """Consume batches until one rank (with a ``stall_timeout``: lockstep
    training) or every rank (without: independent draining) is dry, or a
    rank was asked to stop (``control.stop_requested``).

    A stop happens at a round where no rank holds a formed batch, so every
    sample taken from a buffer has been trained: a checkpoint taken then
    loses none. If no such round comes within ``STOP_WAIT`` seconds (by rank
    0's clock, so that all ranks agree), the stop happens anyway, midway,
    and no checkpoint may be taken (it could lose samples). In lockstep, a
    rank without data while another rank's buffer is full can wait forever
    (that buffer's clients are blocked, so the study cannot end): after
    ``stall_timeout`` seconds of it the job stops with an error instead.
    """
    size = comm.Get_size()
    synchronous = stall_timeout is not None
    flags = np.zeros(5, dtype=np.int64)
    pending = None
    stalled_since = None
    stopping_since = None
    while True:
        if pending is None:
            pending = next_batch(WAIT)
        ready, ended = pending is not None and pending is not END, pending is END
        overdue = comm.Get_rank() == 0 and stopping_since is not None and time.monotonic() - stopping_since > STOP_WAIT
        flags[:] = (ready, ended, comm.Get_rank() == 0 and control.due(), buffer.producer_waiting,
                    control.stop_requested() + overdue * (size + 1))
        request = comm.Iallreduce(MPI.IN_PLACE, flags)
        while not request.Test():
            time.sleep(POLL)  # do not spin: simulations and the other ranks may share these cores
        if flags[2]:
            control.sync()
        if flags[1] >= (1 if synchronous else size):
            return Outcome.ENDED
        if ready and (flags[0] == size or not synchronous):
            step(pending)
            pending = None
        if flags[4] or stopping_since is not None:
            stopping_since = stopping_since or time.monotonic()
            if flags[0] in (0, size) or not synchronous:
                return Outcome.STOPPED
            if flags[4] > size:
                return Outcome.STOPPED_MIDWAY
        if synchronous and flags[0] < size and flags[3] > 0:
            stalled_since = stalled_since or time.monotonic()
            if time.monotonic() - stalled_since > stall_timeout:  # type: ignore[operator]
                raise TrainingStalled(
                    f"training stalled for {stall_timeout:g} s: {size - flags[0]} of {size} ranks have no batch "
                    f"while {flags[3]} have a full buffer (routing sends them no data: with "
                    "server.bind_simulation_to_server_rank, run at least as many simulations at once as ranks)"
                )
        else:
            stalled_since = None


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


_STATM = os.open("/proc/self/statm", os.O_RDONLY)  # opened once: a rank out of descriptors still reads it


def rss_megabytes() -> float:
    return int(os.pread(_STATM, 128, 0).split()[1]) * resource.getpagesize() / 1e6


@dataclass
class TrainingSummary:
    batches: int = 0
    samples: int = 0  # on this rank
    duration_s: float = 0.0
    validation: list[tuple[int, float]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        losses = [loss for _, loss in self.validation]
        return {
            "batches": self.batches,
            "duration_s": round(self.duration_s, 3),
            "batches_per_s": round(self.batches / self.duration_s, 3) if self.duration_s > 0 else 0.0,
            "validation": [[b, loss] for b, loss in self.validation],
            "first_validation_loss": losses[0] if losses else None,
            "last_validation_loss": losses[-1] if losses else None,
        }


class Trainer:
    """One rank's replica of the user's module, its optimizer and its TensorBoard writer."""

    def __init__(self, options: TrainingConfig, base_dir: Path, output: Path, comm: Comm, receiver: Receiver) -> None:
        self.options = options
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.receiver = receiver
        cuda = options.device == "cuda" or (options.device == "auto" and torch.cuda.is_available())
        self.device = torch.device(f"cuda:{self.rank % torch.cuda.device_count()}" if cuda else "cpu")
        local_ranks = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))  # ranks on a node share its cores
        torch.manual_seed(options.seed)  # the same seed everywhere: replicas start identical
        self.collectives = make_collectives(comm, self.device)
        set_default_collectives(self.collectives)  # the user's ShardedEmbeddings shard over these ranks
        module_class = load_module_class(base_dir / options.module, options.class_name)
        self.module: TrainingModule = module_class(**options.options)
        self.module.rank, self.module.world_size = self.rank, self.size
        self.module.to(self.device)
        self.tables = {name: m for name, m in self.module.named_modules() if isinstance(m, ShardedEmbedding)}
        self.optimizer = self.module.configure_optimizer()
        self.averager = GradientAverager(self.module.parameters(), self.collectives)
        self.dataset = StreamDataset(receiver.buffer, self.module.process, options.batch_size)
        held_out = list(self.module.validation_samples())
        # equal shares, so that every rank runs as many validation batches (lookups of sharded tables are collectives)
        self.validation_set = held_out[: len(held_out) - len(held_out) % self.size][self.rank :: self.size]
        self.output = output
        self.writer: Any = None  # opened by run(), after a restore has set the step to continue from
        self.checkpointer: Checkpointer | None = None
        self._copy: BackgroundCopy | None = None  # of the last snapshot, until the next optimizer step
        self.summary = TrainingSummary()
        self.rows_updated = 0  # embedding rows this rank updated since the last TensorBoard point
        self._last_log = (time.monotonic(), 0, 0)  # time, batches, bytes received

    def run(self, control: Control, checkpointer: Checkpointer | None) -> Outcome:
        """Train until the study ends or a stop is asked for; checkpoints on the way and last."""
        from torch.utils.tensorboard import SummaryWriter  # slow import, only when training

        # purge_step: a resumed run replaces what a dead one logged after its checkpoint (taken after batch b's points)
        self.writer = SummaryWriter(str(self.output / "tensorboard" / f"rank{self.rank}"),
                                    purge_step=self.summary.batches + 1)
        self.checkpointer = checkpointer
        start = time.monotonic()
        if self.summary.batches == 0:  # a resumed run validates where an uninterrupted one would
            self.validate()
        outcome = lockstep(self.comm, self.dataset.next_batch, self.step, control, self.receiver.buffer,
                           self.options.stall_timeout)
        self.summary.duration_s += time.monotonic() - start
        if outcome is Outcome.STOPPED_MIDWAY:
            logger.warning("stop requested, but for %g s some ranks always held a batch the others could not "
                           "match: stopping without a last checkpoint (a restart resumes from the last one written)",
                           STOP_WAIT)
        elif outcome is Outcome.STOPPED:
            logger.info("training stopped on request after %d batches", self.summary.batches)
        else:
            logger.info("training stopped after %d batches; %d buffered samples left untrained (training stops "
                        "when the first rank runs dry)", self.summary.batches, len(self.receiver.buffer))
            self.validate_unless_done()
        if checkpointer is not None:
            checkpointer.final(snapshot=outcome is not Outcome.STOPPED_MIDWAY, complete=outcome is Outcome.ENDED)
        self.writer.close()
        self.collectives.close()
        return outcome

    def step(self, batch: Any) -> None:
        self.module.train()
        self.averager.zero_grad()
        loss = self.module.training_step(to_device(batch, self.device))
        loss.backward()
        self.averager.average()
        if self._copy is not None:  # a checkpoint's copy of what the optimizers are about to change
            self._copy.wait()
            self._copy = None
        self.optimizer.step()
        for table in self.tables.values():
            self.rows_updated += table.apply_gradients()
        self.summary.batches += 1
        self.summary.samples += len(tree_leaves(batch)[0])
        if self.summary.batches % self.options.log_interval == 0:
            self.log_scalars(loss.detach().item())
        if self.summary.batches % self.options.nb_batches_update == 0:
            self.validate()
        interval = self.options.checkpoint_interval
        if self.checkpointer is not None and interval and self.summary.batches % interval == 0:
            self.checkpointer.snapshot()

    def log_scalars(self, loss: float) -> None:
        now, received = time.monotonic(), self.receiver.bytes_received
        then, batches, bytes_then = self._last_log
        elapsed = max(now - then, 1e-9)
        step, buffer = self.summary.batches, self.receiver.buffer
        for tag, value in (
            ("train/loss", loss),
            ("train/batches_per_s", (step - batches) / elapsed),
            ("buffer/size", len(buffer)),
            ("buffer/put_time", buffer.put_wait_seconds),
            ("buffer/get_time", buffer.get_wait_seconds),
            ("receive/bytes_per_s", (received - bytes_then) / elapsed),
            ("memory/rss_mb", rss_megabytes()),
            *((("embeddings/rows_updated", self.rows_updated),) if self.tables else ()),
        ):
            self.writer.add_scalar(tag, value, step)
        self.rows_updated = 0
        self._last_log = (now, step, received)

    def validate_unless_done(self) -> None:
        """Validate, unless the model of this batch already was (by a step, or before a restart)."""
        if not self.summary.validation or self.summary.validation[-1][0] != self.summary.batches:
            self.validate()

    @torch.no_grad()
    def validate(self) -> None:
        """Mean validation loss over every rank's share of the held-out samples (a collective)."""
        self.module.eval()
        totals = np.zeros(2)  # sum of loss x samples, samples
        chunk = self.options.validation_batch_size
        for i in range(0, len(self.validation_set), chunk):
            samples = self.validation_set[i : i + chunk]
            batch = to_device(collate([self.module.process(s) for s in samples]), self.device)
            totals += (float(self.module.validation_step(batch)) * len(samples), len(samples))
        self.comm.Allreduce(MPI.IN_PLACE, totals)
        if totals[1] == 0:
            return
        loss = totals[0] / totals[1]
        self.summary.validation.append((self.summary.batches, loss))
        self.writer.add_scalar("validation/loss", loss, self.summary.batches)
        if self.rank == 0:
            logger.info("validation loss %.6g after %d batches", loss, self.summary.batches)

    def save(self, output: Path) -> Path:
        """Rank 0 writes the module's state with every embedding table whole (a collective).

        The tables are gathered so that the file loads into the module on one
        rank (``load_state_dict(state, strict=False)``: the optimizer state of
        the shards is left out; checkpoints keep it).
        """
        state = self.module.state_dict()
        for name, table in self.tables.items():
            shards = self.comm.gather(table.shard.cpu().numpy())
            if self.rank == 0:
                state[f"{name}.shard"] = torch.from_numpy(np.concatenate(shards))
                state.pop(f"{name}._extra_state", None)
        path = output / "model.pt"
        if self.rank == 0:
            stream = io.BytesIO()
            torch.save(state, stream)
            write_atomic(path, stream.getbuffer())
        return path

    def state_dict(self, into: Any = None) -> dict[str, Any]:
        """What a restart needs from this rank, as CPU copies, so that training goes on while it is written.

        ``dense`` (rank 0 only: replicas are identical) holds the module
        without its sharded tables and the optimizer; ``tables`` this rank's
        shards with their row ranges and sparse optimizer state. The
        parameters, shards and optimizer states, which only the optimizer
        steps change, are copied by a thread while the next batch's forward
        and backward run (``step`` waits for it first): the ``BackgroundCopy``
        under ``"copied"``. The module's other buffers (a forward may change
        them), the RNG states and the counters are copied now. ``into``: a
        written snapshot's ``"copied"`` whose memory may be reused.
        """
        module = self.module.state_dict()
        tables = {name: {"shard": module.pop(f"{name}.shard"), "extra": module.pop(f"{name}._extra_state")}
                  for name in self.tables}
        parameters = {name for name, _ in self.module.named_parameters()}
        later: dict[str, Any] = {"tables": tables}
        now: dict[str, Any] = {"rng": rng_states(), "summary": copy.deepcopy(self.summary)}
        if self.rank == 0:
            later["parameters"] = {k: v for k, v in module.items() if k in parameters}
            later["optimizer"] = self.optimizer.state_dict()
            now["buffers"] = copy_to_cpu({k: v for k, v in module.items() if k not in parameters})
        self._copy = BackgroundCopy(later, into)
        return {**now, "copied": self._copy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint: ``dense``, ``rng``, ``summary``, and under ``tables``, per table, the old
        shards covering this rank's rows (``state_dict``'s, from one or several old ranks)."""
        dense, pieces = state["dense"], state["tables"]
        missing, unexpected = self.module.load_state_dict(dense["module"], strict=False)
        missing = [key for key in missing if key.split(".")[-1] not in ("shard", "_extra_state")
                   or key.rsplit(".", 1)[0] not in self.tables]
        if missing or unexpected:
            raise ConfigError(f"training.class_name: the checkpoint's module does not match {self.options.class_name} "
                              f"(missing {missing[:3]}, unexpected {unexpected[:3]}); start over with --fresh")
        self.optimizer.load_state_dict(dense["optimizer"])
        for name, table in self.tables.items():
            table.load_rows(pieces[name])
        set_rng_states(state["rng"])
        self.summary = state["summary"]


def rng_states() -> dict[str, Any]:
    """Every generator a module may draw from, so that a resumed run draws what the dead one would have."""
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
