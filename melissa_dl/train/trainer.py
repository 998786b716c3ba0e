"""One rank's replica of the user's module: how it steps, validates, gives its model, and gives or takes its state.

The trainer knows nothing of where batches come from (``loop.py``) or when
checkpoints are taken (``checkpoint.manager``); it offers its state as two checkpoint parts:
itself (this rank's embedding shards, RNG states, counters and the losses
per sample not yet sent to rank 0) and ``dense`` (the module without its
sharded tables, and the optimizer's state over whole parameters: one for all
ranks, which rank 0 writes; :mod:`melissa_dl.train.data_parallel`).

When the study's sampler learns (``study.sampler`` ``adaptive``), every step
records each sample's loss with its ``(simulation, step)``
(:mod:`melissa_dl.study.learning`): ``training_step`` returns one loss per sample
(their mean is trained on), or the module defines ``sample_losses``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
import random
import resource
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from mpi4py import MPI

from melissa_dl.buffers.windows import stacked, windows_of
from melissa_dl.checkpoint.snapshots import BackgroundCopies, Live, copy_to_cpu
from melissa_dl.config.sections import TrainingConfig
from melissa_dl.embeddings.table import ShardedEmbedding, set_default_collectives, shard_range
from melissa_dl.errors import ConfigError
from melissa_dl.runtime.collectives import make_collectives
from melissa_dl.runtime.metrics import TRAIN_LOSS, VALIDATION_LOSS, Metrics
from melissa_dl.runtime.mpi import Comm
from melissa_dl.study.learning import LossLog, Records
from melissa_dl.train.data_parallel import make_data_parallel
from melissa_dl.train.dataset import Batch, collate
from melissa_dl.train.module import TrainingModule, check_prediction_inputs, load_module_class, take_logged
from melissa_dl.train.rollout import HORIZONS, at_horizons, rollout_errors, trajectories

if TYPE_CHECKING:
    from melissa_dl.buffers.sample import Sample
    from melissa_dl.checkpoint.recovery import OldRanks

logger = logging.getLogger(__name__)


def to_device(batch: Any, device: torch.device) -> Any:
    """``batch`` on ``device``. To a GPU through pinned memory, so that the copy does not hold the CPU back (it
    forms the next batch while the GPU copies and computes), and on a stream of its own: on the compute stream
    the copy would wait for the step still running there; the compute stream waits for it only from here on."""
    if device.type != "cuda":
        return _each_tensor(batch, lambda t: t.to(device))
    compute = torch.cuda.current_stream(device)

    def move(tensor: torch.Tensor) -> torch.Tensor:
        moved = (tensor if tensor.is_pinned() or tensor.is_cuda else tensor.pin_memory()).to(device, non_blocking=True)
        moved.record_stream(compute)  # its memory is not reused before the compute stream is done with it
        return moved

    with torch.cuda.stream(_copy_stream(device)):
        batch = _each_tensor(batch, move)
    compute.wait_stream(_copy_stream(device))
    return batch


@functools.cache
def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream batches are copied to ``device`` on, made once."""
    return torch.cuda.Stream(device)


def _each_tensor(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` (tensors, or lists, tuples and dicts of them) with ``fn`` applied to each tensor."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_each_tensor(b, fn) for b in batch)
    if isinstance(batch, dict):
        return {k: _each_tensor(v, fn) for k, v in batch.items()}
    return batch


_STATM = os.open("/proc/self/statm", os.O_RDONLY)  # opened once: a rank out of descriptors still reads it


def learning_rates(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Each parameter group's learning rate, as a scheduler left it: ``training/learning_rate`` (then ``_1``,
    ``_2`` for the groups after the first)."""
    return {
        f"training/learning_rate{f'_{i}' if i else ''}": float(group["lr"])
        for i, group in enumerate(optimizer.param_groups)
        if "lr" in group
    }


def rss_megabytes() -> float:
    return int(os.pread(_STATM, 128, 0).split()[1]) * resource.getpagesize() / 1e6


def training_device(choice: str, comm: Comm) -> torch.device:
    """This rank's device (``training.device``; a collective, so that every rank decides alike): one GPU per
    rank, in turn over its node's GPUs, made current so that NCCL and a module's ``device="cuda"`` use it; the
    CPU for every rank where ``auto`` finds a host without a GPU."""
    without = sorted(
        {host for host in comm.allgather(None if torch.cuda.is_available() else socket.gethostname()) if host}
    )
    if choice == "cpu" or (choice == "auto" and without):
        return torch.device("cpu")
    if without:
        raise ConfigError(
            f'training.device: "cuda", but torch {torch.__version__} sees no CUDA device on {", ".join(without)}'
        )
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    node_rank = node.Get_rank()
    node.Free()
    device = torch.device("cuda", node_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def torch_threads(comm: Comm, simulations: int = 0) -> int:
    """One thread per core this rank may run on, less the ``simulations`` ranks the launcher may run at once
    on rank 0's node (0 on the others), shared with the ranks of its node allowed there too (all of them under
    ``mpirun`` without binding, none under ``srun --cpu-bind``): a core running two processes' OpenMP threads
    makes both spin and wait. The affinity mask, not the node's core count: Slurm's cpusets and ``taskset``
    give a process fewer cores than the node has."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    mine = os.sched_getaffinity(0)
    masks_and_roots = node.allgather((mine, comm.Get_rank() == 0))
    node.Free()
    sharing = sum(1 for cores, _ in masks_and_roots if cores & mine)
    launcher_here = any(root for _, root in masks_and_roots)
    return max(1, (len(mine) - (simulations if launcher_here else 0)) // sharing)


def set_threads(training: TrainingConfig, comm: Comm, simulations: int) -> int:
    """Set torch's intra- and inter-op threads (``training.threads``, else :func:`torch_threads`); rank 0 logs the
    choice of every rank once. Inter-op threads can be set once per process, before any inter-op work: a process
    that set them (a second trainer in a test) keeps its count."""
    threads = training.threads or torch_threads(comm, simulations)
    torch.set_num_threads(threads)
    if torch.get_num_interop_threads() != threads:
        with contextlib.suppress(RuntimeError):
            torch.set_num_interop_threads(threads)
    chosen = comm.gather(threads)
    if chosen is not None:
        counts = ", ".join(f"{n} on {chosen.count(n)} ranks" for n in sorted(set(chosen)))
        why = (
            "training.threads"
            if training.threads
            else f"the cores each rank may use, less {simulations} simulation ranks at once on rank 0's node "
            "(launcher.job_limit x launcher.client_ranks of a local scheduler), shared with the server ranks "
            "there; training.threads sets it"
        )
        logger.info("torch threads per rank (intra- and inter-op): %s (%s)", counts, why)
    return threads


@dataclass
class TrainingSummary:
    batches: int = 0
    samples: int = 0  # on this rank
    duration_s: float = 0.0
    validation: list[tuple[int, float]] = field(default_factory=list)
    rollout: tuple[tuple[int, dict[str, float]], ...] = ()  # with windows: (batches, error at each horizon)
    held_out_validated: bool = False  # the study's held-out set has been validated on (a resumed run: before)

    def to_dict(self) -> dict[str, Any]:
        losses = [loss for _, loss in self.validation]
        return {
            "batches": self.batches,
            "duration_s": round(self.duration_s, 3),
            "batches_per_s": round(self.batches / self.duration_s, 3) if self.duration_s > 0 else 0.0,
            "validation": [[b, loss] for b, loss in self.validation],
            "first_validation_loss": losses[0] if losses else None,
            "last_validation_loss": losses[-1] if losses else None,
            **({"rollout": [[b, errors] for b, errors in self.rollout]} if self.rollout else {}),
        }


class Trainer:
    """One rank's replica of the user's module and its optimizer; it writes its curves through ``metrics`` and
    waits for a checkpoint's ``copies`` of its state before each optimizer step."""

    def __init__(
        self,
        training: TrainingConfig,
        base_dir: Path,
        comm: Comm,
        copies: BackgroundCopies,
        metrics: Metrics | None = None,
        learning: bool = False,
        simulations: int = 0,
    ) -> None:
        """``simulations``: the simulation ranks the launcher may run at once on rank 0's node, whose cores they
        share with the server's ranks there (``set_threads``)."""
        if learning and training.window is not None:
            raise ConfigError(
                "training.window: the study's sampler learns from each step's loss, and windows are trained, not steps"
            )
        self.training = training  # the section
        self.copies = copies  # the checkpoints' copies of this state: waited for before each optimizer step
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.metrics = metrics if metrics is not None else Metrics(None)
        self.device = training_device(training.device, comm)
        logger.info("rank %d trains on %s", self.rank, self.device)
        set_threads(training, comm, simulations)
        torch.manual_seed(training.seed)  # the same seed everywhere: replicas start identical
        self.collectives = make_collectives(comm, self.device)
        set_default_collectives(self.collectives)  # the user's ShardedEmbeddings shard over these ranks
        module_class = load_module_class(base_dir / training.module, training.class_name)
        self.module: TrainingModule = module_class(**training.options)
        check_prediction_inputs(self.module)
        self.module.rank, self.module.world_size, self.module.window = self.rank, self.size, training.window
        self.module.to(self.device)
        self.tables = {name: m for name, m in self.module.named_modules() if isinstance(m, ShardedEmbedding)}
        self.optimizer = self.module.configure_optimizer()
        self.parallel = make_data_parallel(self.module, self.optimizer, self.collectives)
        self.validation_set: list[Any] = []  # this rank's share of the held-out samples, from begin()
        self.trajectories: list[Sample] = []  # with windows: every held-out trajectory, rolled out by validate()
        self.dense = Dense(self)
        self.summary = TrainingSummary()
        self.rows_updated: int | torch.Tensor = 0  # embedding rows this rank updated since the last TensorBoard point
        self.last_loss: float | None = None  # this rank's training loss at the last TensorBoard point
        self._last_log = (time.monotonic(), 0, 0)  # time, batches, samples
        self.losses = LossLog() if learning else None  # per sample, for a sampler that learns
        # odd while the optimizers change the module (counted up before and after): a serving replica
        # (``serving.online``) keeps a copy made between two looks that see the same even count, so that training
        # never waits for it (a sequence lock)
        self.step_sequence = 0

    def begin(self) -> None:
        """Take this rank's share of the held-out samples (here, once the study runs: a module may solve them,
        and the simulations need not wait for it); open the curves where the restored run left them; validate
        the untrained model. (A resumed run may have the study's held-out set already: ``take_held_out``.)"""
        self._hold_out(list(self.module.validation_samples()))
        # a resumed run replaces what a dead one logged after its checkpoint (taken after batch b's points)
        self.metrics.open(purge_step=self.summary.batches + 1)
        if self.summary.batches == 0:  # a resumed run validates where an uninterrupted one would
            self.validate_unless_done()

    def _hold_out(self, steps: list[Sample]) -> int:
        """Held-out steps (the same on every rank) as the samples the model trains on, this rank's share of them
        joining the validation set (with ``training.window``: every window they hold, and their trajectories for
        the rollouts); how many samples they make."""
        window = self.training.window
        if window is None:
            self.validation_set += self._share(steps)
            return len(steps)
        windows = windows_of(steps, window.length, window.stride)
        self.validation_set += self._share(windows)
        if self.module.rolls_out():
            self.trajectories += trajectories(steps, window.inputs)
        return len(windows)

    def _share(self, held_out: list[Any]) -> list[Any]:
        """This rank's share of ``held_out``: equal shares, so that every rank runs as many validation batches
        (lookups of sharded tables are collectives)."""
        return held_out[: len(held_out) - len(held_out) % self.size][self.rank :: self.size]

    def take_held_out(self, samples: list[Sample]) -> None:
        """Collective, once every held-out simulation of the study ended (``loop.Consumer``): the samples each
        rank received of them, gathered once and shared out again, join the validation set; the model is validated
        on it at once (unless a resumed run already was)."""
        gathered = [sample for part in self.comm.allgather(samples) for sample in part]
        gathered.sort(key=lambda sample: (sample.simulation_id, sample.time_step))  # the same order on every rank
        made = self._hold_out(gathered)
        if self.rank == 0:
            logger.info("held-out set: %d samples of the study's validation simulations", made)
        if not self.summary.held_out_validated:
            self.summary.held_out_validated = True
            self.validate()

    def close(self) -> None:
        """Training is over: the collectives' threads end (the TensorBoard writer is the server's to close)."""
        self.collectives.close()

    def consumed(self) -> int:
        """Samples this rank trained on (``loop.Consumer``)."""
        return self.summary.samples

    def take_losses(self) -> Records | None:
        """The losses per sample recorded since the last call, for a sampler that learns (``loop.Consumer``)."""
        return self.losses.take() if self.losses is not None else None

    def step(self, batch: Batch) -> None:
        self.module.train()
        self.parallel.zero_grad()
        data = to_device(batch.data, self.device)
        loss = self.module.training_step(data)
        if loss.ndim:  # one loss per sample
            if self.losses is not None:
                self.losses.record(batch.ids, loss.detach().cpu().numpy())
            loss = loss.mean()
        elif self.losses is not None:
            self.losses.record(batch.ids, self._sample_losses(data))
        self.parallel.backward(loss)
        self.copies.wait()  # a checkpoint's copy of what the optimizers are about to change
        self.step_sequence += 1
        self.parallel.step()
        for table in self.tables.values():
            self.rows_updated += table.apply_gradients()
        self.summary.batches += 1
        self.step_sequence += 1
        self.summary.samples += len(batch)
        if self.summary.batches % self.training.log_interval == 0:
            self.log_scalars(loss.detach().item())
        if self.summary.batches % self.training.nb_batches_update == 0:
            self.validate()

    def _sample_losses(self, data: Any) -> np.ndarray:
        """The module's ``sample_losses``, for one whose ``training_step`` returns the batch's mean."""
        hook = getattr(self.module, "sample_losses", None)
        if hook is None:
            raise ConfigError(
                f"study.sampler: the sampler learns from each sample's loss, but "
                f"{self.training.class_name}.training_step returns one loss per batch; return one per "
                "sample (the server trains on their mean) or define sample_losses(batch)"
            )
        with torch.no_grad():
            return hook(data).detach().cpu().numpy()

    def log_scalars(self, loss: float) -> None:
        now = time.monotonic()
        then, batches, samples = self._last_log
        step, seconds = self.summary.batches, max(now - then, 1e-9)
        values = {
            TRAIN_LOSS: loss,
            "training/batches_per_s": (step - batches) / seconds,
            "training/samples_per_s": (self.summary.samples - samples) / seconds,
            **learning_rates(self.optimizer),
            "system/rss_mb": rss_megabytes(),
            **take_logged(self.module),
        }
        if self.tables:
            values["training/rows_updated"] = int(self.rows_updated)  # a GPU kernel's count is read here only
        self.metrics.point(step, values)
        self.rows_updated = 0
        self.last_loss = loss
        self._last_log = (now, step, self.summary.samples)

    def status(self) -> dict[str, Any]:
        """Where training stands, for the study's status (``loop.Consumer``): batches, the last losses logged."""
        validation = self.summary.validation
        return {
            "batches": self.summary.batches,
            "loss": self.last_loss,
            "validation_loss": validation[-1][1] if validation else None,
        }

    def validate_unless_done(self) -> None:
        """Validate, unless the model of this batch already was (by a step, or before a restart)."""
        if not self.summary.validation or self.summary.validation[-1][0] != self.summary.batches:
            self.validate()

    @torch.no_grad()
    def validate(self) -> None:
        """Mean validation loss over every rank's share of the held-out samples (a collective)."""
        self.module.eval()
        totals = np.zeros(2)  # sum of loss x samples, samples
        chunk = self.training.validation_batch_size
        for i in range(0, len(self.validation_set), chunk):
            samples, views_of = self.validation_set[i : i + chunk], list[np.ndarray]()
            if self.training.window is not None:
                samples, views_of = stacked(samples)
            batch = to_device(collate([self.module.process(s) for s in samples], views_of), self.device)
            totals += (float(self.module.validation_step(batch).mean()) * len(samples), len(samples))
        self.comm.Allreduce(MPI.IN_PLACE, totals)
        if self.trajectories:
            self._validate_rollouts()
        for tag, value in take_logged(self.module).items():  # what its validation hooks logged, each rank its own
            self.metrics.scalar(tag, value, self.summary.batches)
        if totals[1] == 0:
            return
        loss = totals[0] / totals[1]
        self.summary.validation.append((self.summary.batches, loss))
        picture = self._picture() if self.rank == 0 or self.tables else None  # a table's lookups: collectives
        if self.rank == 0:  # the study's loss: one series, not one per rank
            self.metrics.scalar(VALIDATION_LOSS, loss, self.summary.batches)
            self.metrics.figure("validation/prediction", lambda: picture, self.summary.batches)
            logger.info("validation loss %.6g after %d batches", loss, self.summary.batches)

    def _picture(self) -> Any:
        """The module's ``plot`` of a held-out sample, or None: the same one every time, halfway through the
        first held-out simulation's steps that this rank holds."""
        if self.training.window is not None or not self.validation_set:
            return None
        first = [s for s in self.validation_set if s.simulation_id == self.validation_set[0].simulation_id]
        return self.module.plot(first[len(first) // 2])

    def _validate_rollouts(self) -> None:
        """The held-out trajectories rolled out (``train.rollout``), their mean errors at each horizon (a collective:
        each rank rolls its share out, or every trajectory where a sharded table's lookups are collectives)."""
        assert self.training.window is not None
        inputs, batches = self.training.window.inputs, self.summary.batches
        mine = self.trajectories if self.tables else self.trajectories[self.rank :: self.size]
        totals = np.zeros((len(HORIZONS), 2))  # sum of the errors, trajectories
        for trajectory in mine:
            totals += at_horizons(rollout_errors(self.module, trajectory, inputs))
        self.comm.Allreduce(MPI.IN_PLACE, totals)
        found = {h: float(s / n) for h, (s, n) in zip(HORIZONS, totals) if n}
        self.summary.rollout += ((batches, found),)
        if self.rank == 0:
            for horizon, error in found.items():
                self.metrics.scalar(f"validation/rollout_{horizon}", error, batches)
            said = ", ".join(f"{error:.4g} at {h}" for h, error in found.items())
            logger.info(
                "rollout error (relative L2, %d trajectories) %s after %d batches",
                len(self.trajectories),
                said,
                batches,
            )

    def model_state(self) -> dict[str, Any] | None:
        """On rank 0 (None elsewhere; a collective): the module's state on the CPU with every embedding table whole,
        so that it loads into the module on one rank, wherever (``load_state_dict(state, strict=False)``: the
        optimizer state of the shards is left out; checkpoints keep it)."""
        shards = {name: self.comm.gather(table.shard.cpu().numpy()) for name, table in self.tables.items()}
        if self.rank != 0:
            return None
        state = self.module.state_dict()
        for name in self.tables:
            del state[f"{name}.shard"], state[f"{name}._extra_state"]
        state = copy_to_cpu(state)
        for name, pieces in shards.items():
            assert pieces is not None  # gathered on rank 0
            state[f"{name}.shard"] = torch.from_numpy(np.concatenate(pieces))
        return state

    def state_dict(self) -> dict[str, Any]:
        """This rank's part of a checkpoint: its shards with their row ranges and sparse optimizer state
        (copied in the background: only optimizer steps change them), the RNG states and the counters."""
        module = self.module.state_dict()
        tables = {
            name: {"shard": module[f"{name}.shard"], "extra": module[f"{name}._extra_state"]} for name in self.tables
        }
        return {
            "tables": Live(tables),
            "rng": rng_states(self.device),
            "summary": copy.deepcopy(self.summary),
            "losses": self.losses.state_dict() if self.losses is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from this rank's part of a checkpoint of as many ranks."""
        for name, table in self.tables.items():
            table.load_rows([state["tables"][name]])
        set_rng_states(state["rng"], self.device)
        self.summary = state["summary"]
        if self.losses is not None and state.get("losses") is not None:
            self.losses.load_state_dict(state["losses"])

    def load_resharded(self, old: OldRanks) -> None:
        """Continue from a checkpoint of another number of ranks: each table's rows from the old shards that
        overlap this rank's range, the samples trained and the unsent losses regrouped so that their sums stay
        right."""
        own = self.rank if self.rank < old.size else 0
        sources = {own} | {
            rank
            for table in self.tables.values()
            for rank in range(old.size)
            if _overlap(shard_range(table.num_rows, old.size, rank), (table.start, table.stop))
        }
        states = {rank: old.read(rank) for rank in sorted(sources)}
        for name, table in self.tables.items():
            table.load_rows([state["tables"][name] for state in states.values()])
        set_rng_states(states[own]["rng"], self.device)
        self.summary = states[own]["summary"]
        self.summary.samples = sum(n for rank, n in enumerate(old.meta["samples"]) if rank % self.size == self.rank)
        if self.losses is not None:  # the old ranks' unsent losses, regrouped as the samples are
            for rank in range(self.rank, old.size, self.size):
                records = (states[rank] if rank in states else old.read(rank)).get("losses")
                if records is not None and records["records"] is not None:
                    self.losses.record(*records["records"])


class Dense:
    """The replicated part of a trainer's state: the module without its sharded tables, and the optimizer."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any] | None:
        """On rank 0 (None elsewhere; every rank calls it, as a sharded optimizer's state is gathered): the
        parameters and the optimizer's own state are copied in the background (only optimizer steps change them),
        the module's other buffers now (a forward may change them)."""
        trainer = self.trainer
        optimizer = trainer.parallel.state_dict()
        if trainer.rank != 0:
            return None
        module = trainer.module.state_dict()
        for name in trainer.tables:
            del module[f"{name}.shard"], module[f"{name}._extra_state"]
        parameters = {name for name, _ in trainer.module.named_parameters()}
        buffers = copy_to_cpu({k: v for k, v in module.items() if k not in parameters})
        dense = {**{k: v for k, v in module.items() if k in parameters}, **buffers}  # parameters first, as before
        return {
            "module": Live(dense),
            "optimizer": optimizer if trainer.parallel.state_is_copy else Live(optimizer),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        missing, unexpected = trainer.module.load_state_dict(state["module"], strict=False)
        missing = [
            key
            for key in missing
            if key.split(".")[-1] not in ("shard", "_extra_state") or key.rsplit(".", 1)[0] not in trainer.tables
        ]
        if missing or unexpected:
            raise ConfigError(
                f"training.class_name: the checkpoint's module does not match "
                f"{trainer.training.class_name} (missing {missing[:3]}, unexpected {unexpected[:3]}); "
                "start over with --fresh"
            )
        trainer.parallel.load_state_dict(state["optimizer"])


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


def rng_states(device: torch.device) -> dict[str, Any]:
    """Every generator a module may draw from, so that a resumed run draws what the dead one would have: on a GPU,
    the generator of the rank's own (a node's others are other ranks')."""
    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_states(states: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    cuda = states["cuda"]
    if isinstance(cuda, list):  # written before 2026-11-27: every GPU of the node, by index
        cuda = cuda[device.index] if device.type == "cuda" and device.index < len(cuda) else None
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)
