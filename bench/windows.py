"""Windows of steps (``training.window``): batches from the buffer against pre-stacked windows, and the buffer's
memory against the steps the windows span (docs/explanation/performance.md#what-the-targets-are).

Batches: ``--simulations`` simulations of ``--steps`` steps of one 64x64
float32 field (and 3 float64 parameters) go into a buffer of each kind with
windows of ``--inputs`` (4) + ``--targets`` (1) steps, stride 1, which is
then closed, so nothing waits; ``StreamDataset`` drains it with the
``process`` an autoregressive module has (``u[:k], u[k:]`` and the
parameters, numpy views of the window). The baseline holds the same steps
pre-stacked in one ``[simulations, steps, 64, 64]`` tensor (and the
parameters in ``[simulations, 3]``) and gathers each batch's windows with
one indexing, ``X[sims, starts + arange(k + m)]``, in the order the buffer
served them, so both sides copy the same bytes, and each side holds its last
batch while it makes the next, as a training loop does. Refilling the buffer
is not timed. Each repetition times at least ``--min-seconds`` of each side; sides
alternate; each side's figure is the median of ``--repeat`` repetitions and
the ratio the median of the per-pair ratios. RESULT
``windows_pipeline_<kind>``, target 0.8.

Memory: the simulations streamed in turn, a step of each at a time, into an
open FIFO buffer large enough to hold them all, with ``tracemalloc``
counting every byte allocated for the steps and by the buffer (the arrays,
the windows, the bookkeeping), against the bytes of the steps the windows
span. RESULT ``windows_memory``, target <= 1.1. (Sending each window as
its own sample would hold each step ``k + m`` times.)

Balance (no target, no timing): how evenly the routing spreads the windows
over K = 2, 4 and 8 ranks (blocks of ``--block`` steps) for ``--simulations``
simulations of ``--steps`` steps and for a single one: the most windows a
rank makes over the mean, and the share of steps sent twice.

    python bench/windows.py [--simulations 16] [--steps 64] [--batch 32] [--repeat 5] [--min-seconds 0.5]
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import numpy as np
import torch

from melissa_dl.buffers.kinds import Buffer, make_buffer
from melissa_dl.buffers.sample import Sample
from melissa_dl.buffers.windows import Window, Windowing
from melissa_dl.config.registry import BUFFERS
from melissa_dl.train.dataset import END, StreamDataset
from melissa_dl.wire.protocol import Route

PIPELINE_TARGET, MEMORY_TARGET = 0.8, 1.1
SIDE = 64


def make_steps(simulations: int, steps: int) -> list[Sample]:
    """Every step, simulation by simulation interleaved, as the receivers would put them."""
    rng = np.random.default_rng(0)
    parameters = rng.random((simulations, 3))
    return [
        Sample(s, t, parameters[s], {"u": rng.random((SIDE, SIDE), dtype=np.float32)})
        for t in range(steps)
        for s in range(simulations)
    ]


def windowed_buffer(kind: str, capacity: int, length: int) -> Buffer:
    return make_buffer(
        kind,
        capacity_samples=capacity,
        capacity_bytes=None,
        watermark=0,
        seed=1,
        windowing=Windowing(length, 1, Route(1).owner, 0),
    )


class Process:
    """An autoregressive module's ``process``: the window's inputs and targets, and the parameters."""

    def __init__(self, inputs: int) -> None:
        self.inputs = inputs

    def __call__(self, window: Sample) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        u = window.fields["u"]
        return u[: self.inputs], u[self.inputs :], window.parameters


def pipeline_pass(kind: str, steps: list[Sample], inputs: int, length: int, batch: int) -> tuple[float, list]:
    """Seconds to drain a filled buffer of windows, and each batch's (simulation, start) ids."""
    buffer = windowed_buffer(kind, len(steps), length)
    dataset = StreamDataset(buffer, Process(inputs), batch)
    for step in steps:
        buffer.put(step)
    buffer.close()
    served, start = [], time.perf_counter()
    while (b := dataset.next_batch()) is not END:
        served.append(b.ids)  # type: ignore[union-attr]
    return time.perf_counter() - start, served


def baseline_pass(x: torch.Tensor, p: torch.Tensor, batches: list[np.ndarray], inputs: int, length: int) -> float:
    offsets = torch.arange(length)
    ids = [torch.from_numpy(b) for b in batches]
    batch = None
    start = time.perf_counter()
    for b in ids:  # the last batch is held while the next is gathered, as by the pipeline side's loop
        windows = x[b[:, :1], b[:, 1:] + offsets]
        batch = (windows[:, :inputs], windows[:, inputs:], p[b[:, 0]])
    del batch
    return time.perf_counter() - start


def memory_ratio(simulations: int, steps: int, length: int) -> tuple[float, int, int]:
    """Bytes allocated for the steps and by the buffer, over the bytes of the steps its windows span."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    buffer = windowed_buffer("fifo", simulations * steps, length)
    for step in make_steps(simulations, steps):
        buffer.put(step)
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    windows = buffer.get_batch(len(buffer))
    assert windows is not None
    spanned = {(w.simulation_id, s.time_step): s.nbytes for w in windows if isinstance(w, Window) for s in w.steps}
    return held / sum(spanned.values()), held, sum(spanned.values())


def balance(simulations: int, steps: int, length: int, block: int, ranks: int) -> tuple[float, float]:
    """The most windows one rank makes over the mean, and the steps sent twice over the steps."""
    route = Route(ranks, block=block, overlap=length - 1)
    made = np.zeros(ranks)
    for sim in range(simulations):
        for start in range(steps - length + 1):
            made[route.owner(sim, start)] += 1
    sent = sum(len(route.ranks(sim, t)) for sim in range(simulations) for t in range(steps))
    return made.max() / made.mean(), sent / (simulations * steps) - 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--simulations", type=int, default=16)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--inputs", type=int, default=4)
    parser.add_argument("--targets", type=int, default=1)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--min-seconds", type=float, default=0.5, help="timed work per side and repetition")
    parser.add_argument("--block", type=int, default=64, help="steps routed to one rank in a row")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both sides")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    length = args.inputs + args.targets
    steps = make_steps(args.simulations, args.steps)
    x = torch.from_numpy(np.stack([s.fields["u"] for s in steps]).reshape(args.steps, args.simulations, SIDE, SIDE))
    x = x.transpose(0, 1).contiguous()  # [simulations, steps, 64, 64]
    p = torch.from_numpy(np.stack([steps[s].parameters for s in range(args.simulations)]))
    window_bytes = length * steps[0].fields["u"].nbytes
    results = []
    for kind in BUFFERS:
        pipe, base, ratios = [], [], []
        for _ in range(args.repeat):
            seconds, baseline, count = 0.0, 0.0, 0
            while seconds < args.min_seconds:  # the baseline gathers what the buffer served, in its order
                taken, batches = pipeline_pass(kind, steps, args.inputs, length, args.batch)
                seconds += taken
                baseline += baseline_pass(x, p, batches, args.inputs, length)
                count += sum(len(b) for b in batches)
            pipe.append(count / seconds)
            base.append(count / baseline)
            ratios.append(baseline / seconds)
        a, b = statistics.median(pipe), statistics.median(base)
        print(
            f"{kind:10s}: buffer {a:8.0f} windows/s {a * window_bytes / 1e6:6.0f} MB/s | "
            f"pre-stacked {b:8.0f} windows/s {b * window_bytes / 1e6:6.0f} MB/s | "
            f"ratios {min(ratios):.3f}..{max(ratios):.3f}"
        )
        results.append(
            f"RESULT windows_pipeline_{kind} ratio={statistics.median(ratios):.3f} target={PIPELINE_TARGET} "
            f"buffer={a:.0f} prestacked={b:.0f} windows/s window={window_bytes}B batch={args.batch}"
        )
    for ranks in (2, 4, 8):
        for simulations in (args.simulations, 1):
            worst, twice = balance(simulations, args.steps * 8, length, args.block, ranks)
            print(
                f"balance: {simulations:3d} simulations of {args.steps * 8} steps on {ranks} ranks, blocks of "
                f"{args.block}: busiest rank {worst:.2f}x the mean, {twice:.1%} of steps sent twice"
            )
    ratio, held, spanned = memory_ratio(args.simulations, args.steps, length)
    print(
        f"memory: {held / 1e6:.1f} MB allocated for {spanned / 1e6:.1f} MB of steps spanned (one sample per window "
        f"would hold {length}x)"
    )
    results.append(f"RESULT windows_memory ratio={ratio:.3f} target={MEMORY_TARGET} held={held}B spanned={spanned}B")
    print("\n".join(results))


if __name__ == "__main__":
    main()
