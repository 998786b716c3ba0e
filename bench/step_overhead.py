"""Per-step cost of the server's lockstep loop against a plain training loop
(issue 14, docs/explanation/performance.md#what-the-targets-are).

Run under ``mpirun -n K`` (K >= 2). Both sides train the same model (an MLP
from 5 parameters to a ``--side`` x ``--side`` field, Adam, MSE) on the same
per-rank batches of the same samples, with the server's thread count (cores /
ranks on the node), on every rank at once, so that both see the same
contention for cores and memory:

* plain: each rank alone, no communication: ``x[idx], y[idx]`` from tensors
  stacked once, then zero_grad, forward, backward, optimizer step;
* server: the server's own parts on pre-filled FIFO buffers (no simulations):
  a bound ``Receiver`` (its thread idle), ``Bookkeeping`` every
  ``control_interval`` (rank 0 has no study to advance), ``Loop.train`` with
  a ``Trainer`` and ``StreamDataset`` (the module declares
  ``deterministic_process``, as the demo's: batches are ``index_select`` of
  rows processed as the buffer filled): every step pays the round's flags,
  the batch, and the gradient all-reduce.

A side's per-step time is the wall time between its first and last step after
``--warmup`` steps, divided by the steps in between (the server's ranks step
together; the plain figure is the mean over ranks). Sides alternate
``--repeat`` times; the ratio is the median of the per-pair ratios. To explain
the gap, the same run times the pieces alone on the model: backward, the optimizer's
step on whole parameters (the plain side's), the server's dense step after
backward (``Trainer.parallel``: the gradients' reductions, its optimizer step
and, when it steps in shards, the gathering of the parameters), forming a
batch from a buffer (``StreamDataset.next_batch``; the plain side's
``index_select`` is not subtracted) and one round's flag exchange (``Loop``'s
all-reduce of five counters).

    mpirun -n 2 python bench/step_overhead.py [--models small,large] [--steps 200] [--repeat 5]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from melissa_dl import Sample, TrainingModule
from melissa_dl.buffers.kinds import make_buffer
from melissa_dl.checkpoint.manager import CheckpointManager
from melissa_dl.checkpoint.snapshots import BackgroundCopies
from melissa_dl.config.sections import Config, parse_config
from melissa_dl.ingest.assembly import StreamSpec
from melissa_dl.ingest.receiver import Receiver
from melissa_dl.runtime.metrics import Metrics
from melissa_dl.runtime.mpi import GracefulStop
from melissa_dl.study.sampling import parameter_table
from melissa_dl.train.dataset import StreamDataset
from melissa_dl.train.loop import Bookkeeping, Loop
from melissa_dl.train.trainer import Trainer

TARGET = 1.15
MODELS = {  # name: hidden width, depth, field side, batch
    "small": (256, 3, 32, 32),  # the demo's surrogate
    "large": (512, 3, 64, 128),  # backward >= 5 ms on one core: where the target applies
}
UNIQUE_SAMPLES = 1024  # distinct samples; the buffer holds references to them over and over
HERE = Path(__file__).resolve().parent


class Surrogate(TrainingModule):
    """Parameters -> field MLP, as the demo's (without its time input and normalisation)."""

    deterministic_process = True

    def __init__(self, hidden: int, depth: int, side: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = 5
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        self.net = nn.Sequential(*layers, nn.Linear(width, side * side))

    def configure_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def process(self, sample: Sample) -> tuple[np.ndarray, np.ndarray]:
        return sample.parameters.astype(np.float32), sample.fields["f"].reshape(-1)

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


def make_config(model: str, scratch: Path) -> Config:
    hidden, depth, side, batch = MODELS[model]
    return parse_config(
        {
            "study": {
                "fields": {"f": {"dtype": "float32", "shape": [side, side]}},
                "parameters": [{"name": f"p{i}", "low": 0.0, "high": 1.0} for i in range(5)],
                "simulations": 1,
            },
            "launcher": {"command": ["true"]},
            "buffer": {"kind": "fifo"},
            "training": {
                "module": Path(__file__).name,
                "class_name": "Surrogate",
                "batch_size": batch,
                "options": {"hidden": hidden, "depth": depth, "side": side},
                "log_interval": 1000,
                "nb_batches_update": 1 << 30,
            },
            "checkpoint": {"interval": 0},
            "output_dir": str(scratch),
        },
        HERE,
    )


def make_samples(side: int, rank: int) -> list[Sample]:
    rng = np.random.default_rng(rank)
    return [
        Sample(i, 0, rng.random(5), {"f": rng.random((side, side), dtype=np.float32)}) for i in range(UNIQUE_SAMPLES)
    ]


def per_step(stamps: list[float], warmup: int) -> float:
    return (stamps[-1] - stamps[warmup]) / (len(stamps) - 1 - warmup)


def plain_side(config: Config, comm: MPI.Intracomm, samples: list[Sample], steps: int, warmup: int) -> float:
    """Each rank's own loop on stacked tensors; mean per-step seconds over ranks."""
    trainer = Trainer(config.training, config.base_dir, comm, BackgroundCopies())  # same module, seed, threads
    module, optimizer, batch = trainer.module, trainer.optimizer, config.training.batch_size
    x = torch.from_numpy(np.stack([module.process(s)[0] for s in samples]))
    y = torch.from_numpy(np.stack([module.process(s)[1] for s in samples]))
    stamps = []
    comm.Barrier()
    for step in range(steps):
        idx = (torch.arange(batch) + step * batch) % len(samples)
        optimizer.zero_grad()
        module.training_step((x.index_select(0, idx), y.index_select(0, idx))).backward()
        optimizer.step()
        stamps.append(time.perf_counter())
    return comm.allreduce(per_step(stamps, warmup)) / comm.Get_size()


def server_side(
    config: Config, comm: MPI.Intracomm, samples: list[Sample], steps: int, warmup: int, scratch: Path
) -> float:
    """The server's loop over a pre-filled, closed FIFO of ``steps`` batches; per-step seconds."""
    rank, size = comm.Get_rank(), comm.Get_size()
    training = config.training
    buffer = make_buffer("fifo", capacity_samples=None, capacity_bytes=None, watermark=0, seed=rank)
    spec = StreamSpec.from_config(config.server, config.study, parameter_table(config.study), b"x" * 32, rank, size)
    receiver = Receiver(spec, buffer, "127.0.0.1", config.server.receive_queue_bytes)
    receiver.start_and_bind()
    checkpoints = CheckpointManager(config, comm)
    metrics = Metrics(config.output_path / "tensorboard" / f"rank{rank}", [receiver.scalars])
    trainer = Trainer(training, config.base_dir, comm, checkpoints.copies, metrics)
    dataset = StreamDataset(buffer, trainer.module.process, training.batch_size, Surrogate.deterministic_process)
    for i in range(steps * training.batch_size):  # as the receiver would: processed as they come
        buffer.put(samples[i % len(samples)])
    buffer.close()
    heartbeat = scratch / "heartbeat"
    heartbeat.touch()
    bookkeeping = Bookkeeping(comm, receiver, config.server.control_interval, heartbeat)
    loop = Loop(comm, bookkeeping, GracefulStop(), checkpoints)
    stamps: list[float] = []
    step = trainer.step
    trainer.step = lambda batch: (step(batch), stamps.append(time.perf_counter()))  # type: ignore[method-assign]
    comm.Barrier()
    loop.train(trainer, dataset.next_batch, training.stall_timeout)
    receiver.stop()
    metrics.close()  # as the server does when its run ends
    assert len(stamps) == steps, f"rank {rank} trained {len(stamps)} of {steps} batches"
    return comm.allreduce(per_step(stamps, warmup), op=MPI.MAX)


def timed(function: Callable[[], Any], repeat: int = 30) -> float:
    """Median seconds of one call."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def pieces(config: Config, comm: MPI.Intracomm, samples: list[Sample]) -> dict[str, float]:
    """Each alone, in ms (max over ranks): backward; the optimizer's step on whole parameters (the plain side's);
    the server's dense step after backward (``Trainer.parallel``: its reductions, its optimizer step and, sharded,
    its gathering); forming a batch from a buffer; one round's flag exchange."""
    trainer = Trainer(config.training, config.base_dir, comm, BackgroundCopies())
    module, parallel, batch = trainer.module, trainer.parallel, config.training.batch_size
    data = [torch.from_numpy(np.stack([module.process(s)[i] for s in samples[:batch]])) for i in (0, 1)]
    buffer = make_buffer("fifo", capacity_samples=None, capacity_bytes=None, watermark=0, seed=0)
    dataset = StreamDataset(buffer, module.process, batch, Surrogate.deterministic_process)
    for i in range(batch * 31):
        buffer.put(samples[i % len(samples)])
    buffer.close()
    times: dict[str, list[float]] = {"backward": [], "optimizer": [], "dense_step": []}

    def loss_after_barrier() -> torch.Tensor:
        parallel.zero_grad()
        loss = module.training_step(data)
        comm.Barrier()
        return loss

    for _ in range(30):
        loss = loss_after_barrier()
        start = time.perf_counter()
        loss.backward()
        middle = time.perf_counter()
        trainer.optimizer.step()  # the whole optimizer, as the plain side's
        times["backward"].append(middle - start)
        times["optimizer"].append(time.perf_counter() - middle)
        loss = loss_after_barrier()
        start = time.perf_counter()
        parallel.backward(loss)
        parallel.step()
        times["dense_step"].append(time.perf_counter() - start)
    flags = np.zeros(5, dtype=np.int64)
    result = {name: statistics.median(seconds) for name, seconds in times.items()}
    result["dense_step"] -= result["backward"]
    result.update(
        batch=timed(dataset.next_batch),
        flags=timed(lambda: (comm.Barrier(), comm.Iallreduce(MPI.IN_PLACE, flags).Wait())) - timed(comm.Barrier),
    )
    return {name: comm.allreduce(seconds, op=MPI.MAX) * 1e3 for name, seconds in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per side and repetition")
    parser.add_argument("--warmup", type=int, default=20, help="steps before the clock starts")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size < 2:
        raise SystemExit("run under mpirun -n 2 (or more): the server side trains in lockstep")
    scratch = Path(comm.bcast(tempfile.mkdtemp(prefix="step_overhead-") if rank == 0 else None))
    results = []
    for model in args.models.split(","):
        config = make_config(model, scratch)
        samples = make_samples(MODELS[model][2], rank)
        steps = args.steps + args.warmup + 1
        plain, server = [], []
        for _ in range(args.repeat):
            if rank == 0:
                shutil.rmtree(scratch, ignore_errors=True)
                scratch.mkdir(parents=True)
            comm.Barrier()
            plain.append(plain_side(config, comm, samples, steps, args.warmup))
            server.append(server_side(config, comm, samples, steps, args.warmup, scratch))
        parts = pieces(config, comm, samples)
        ratios = sorted(s / p for s, p in zip(server, plain))
        if rank == 0:
            hidden, depth, side, batch = MODELS[model]
            print(
                f"{model}: MLP 5->{depth}x{hidden}->{side}x{side}, batch {batch}, {size} ranks: plain "
                f"{statistics.median(plain) * 1e3:.2f} ms/step, server {statistics.median(server) * 1e3:.2f} "
                f"ms/step, ratios {ratios[0]:.3f}..{ratios[-1]:.3f}; alone: "
                + ", ".join(f"{name} {ms:.2f} ms" for name, ms in parts.items()),
                flush=True,
            )
            results.append(
                f"RESULT step_overhead_{model} ratio={statistics.median(ratios):.3f} target={TARGET} "
                f"plain_ms={statistics.median(plain) * 1e3:.2f} server_ms={statistics.median(server) * 1e3:.2f} "
                + " ".join(f"{name}_ms={ms:.2f}" for name, ms in parts.items())
                + f" ranks={size}"
            )
    if rank == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        print("\n".join(results))


if __name__ == "__main__":
    main()
