"""Buffer -> batch pipeline against iterating pre-stacked tensors
(docs/explanation/performance.md#what-the-targets-are).

The pipeline side is the real path: a buffer from ``make_buffer(kind, ...)``
holding ``Sample``s of numpy arrays (as the receiver builds them), pre-filled
with capacity = number of samples and closed, so nothing ever waits; it is
drained by ``StreamDataset(buffer, process, batch, deterministic).next_batch()``
with ``process = (parameters, field)`` returning the numpy arrays as they are.
Two paths, each against the baseline: ``deterministic`` (the module declares
``deterministic_process``: the dataset is made before the buffer fills, so
``process`` runs once per sample as it is put, untimed like the receiver's
work, and each batch is one ``index_select`` per output; RESULT
``pipeline_<kind>_<size>``, target 0.8) and per serving (``process`` on
every serving, then ``StreamDataset`` stacks the numpy outputs once per batch;
RESULT ``pipeline_per_serving_<kind>_<size>``, no target). The baseline
stacks the same samples into tensors X, Y once, then forms each batch as
``X[idx], Y[idx]`` with the same batch composition (contiguous indices for
FIFO, a random permutation for FIRO and Reservoir), so both sides copy the same
bytes. Refilling the buffer between drains is not timed. Each repetition runs
drains until at least ``--min-seconds`` of timed work. Pipeline and baseline
repetitions alternate; each side's figure is the median of ``--repeat``
repetitions and the ratio is the median of the per-pair ratios, so that a load
burst from another process skews one pair rather than one side. Two sample
sizes: small (5 float64 parameters + a 32x32 float32 field, ~4 KiB) and large
(the same parameters + a 512x512 float32 field, 1 MiB). Torch runs
``--threads`` intra-op threads (default 1) on both sides: on a shared machine,
two OpenMP threads slow small ``index_select`` calls up to 100x whenever
another process takes a core, which would make the baseline meaningless.

    python bench/pipeline.py [--batch 32] [--repeat 5] [--samples 8192] [--large-samples 256] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from melissa_dl.buffers.kinds import Buffer, make_buffer
from melissa_dl.buffers.sample import Sample
from melissa_dl.config.registry import BUFFERS
from melissa_dl.train.dataset import END, StreamDataset, collate

TARGET = 0.8
SHAPES = {"small": (32, 32), "large": (512, 512)}


def process(s: Sample) -> tuple[np.ndarray, np.ndarray]:
    return s.parameters, s.fields["f"]


def make_samples(n: int, shape: tuple[int, ...], seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    params = rng.random((n, 5))  # float64 rows, as StreamSpec.parameters[sim]
    return [Sample(i, 0, params[i], {"f": rng.random(shape, dtype=np.float32)}) for i in range(n)]


def filled(
    kind: str, samples: list[Sample], dataset: Callable[[Buffer], StreamDataset] | None = None
) -> tuple[Buffer, StreamDataset | None]:
    """A closed buffer holding ``samples``, and the ``dataset`` made on it before they came (as the server's)."""
    buffer = make_buffer(kind, capacity_samples=len(samples), capacity_bytes=None, watermark=0, seed=1)
    made = dataset(buffer) if dataset is not None else None
    for s in samples:
        buffer.put(s)
    buffer.close()
    return buffer, made


def batch_indices(kind: str, n: int, batch: int, gen: torch.Generator) -> list[torch.Tensor]:
    order = torch.arange(n) if kind == "fifo" else torch.randperm(n, generator=gen)
    return list(order.split(batch))


def run_for(min_seconds: float, one_pass: Callable[[], tuple[float, int]]) -> float:
    """Samples/s over as many passes as needed to time ``min_seconds``."""
    elapsed, count = 0.0, 0
    while elapsed < min_seconds:
        t, c = one_pass()
        elapsed, count = elapsed + t, count + c
    return count / elapsed


def pipeline_pass(kind: str, samples: list[Sample], batch: int, deterministic: bool) -> tuple[float, int]:
    _, dataset = filled(kind, samples, lambda buffer: StreamDataset(buffer, process, batch, deterministic))
    assert dataset is not None
    count = 0
    start = time.perf_counter()
    while (b := dataset.next_batch()) is not END:
        count += len(b)
    return time.perf_counter() - start, count


def baseline_pass(x: torch.Tensor, y: torch.Tensor, indices: list[torch.Tensor]) -> tuple[float, int]:
    count = 0
    start = time.perf_counter()
    for idx in indices:
        b = (x[idx], y[idx])
        count += len(b[0])
    return time.perf_counter() - start, count


def profile(samples: list[Sample], batch: int, kind: str = "firo") -> None:
    """Where a small-sample batch's time goes, stage by stage."""
    stages = {"get_batch": 0.0, "process": 0.0, "collate": 0.0}
    (buffer, _), batches = filled(kind, samples), 0
    while got := buffer.get_batch(batch):
        t0 = time.perf_counter()
        items = [process(s) for s in got]
        t1 = time.perf_counter()
        collate(items)
        t2 = time.perf_counter()
        stages["process"] += t1 - t0
        stages["collate"] += t2 - t1
        batches += 1
    (buffer, _), start = filled(kind, samples), time.perf_counter()
    while buffer.get_batch(batch):
        pass
    stages["get_batch"] = time.perf_counter() - start
    total = sum(stages.values())
    print(
        f"profile ({kind}, small, batch={batch}, {batches} batches): "
        f"{total / batches * 1e6:.1f} us/batch = "
        + ", ".join(f"{k} {v / batches * 1e6:.1f} us ({v / total:.0%})" for k, v in stages.items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--samples", type=int, default=8192, help="small samples in the buffer")
    parser.add_argument("--large-samples", type=int, default=256, help="large samples in the buffer")
    parser.add_argument("--min-seconds", type=float, default=0.2, help="timed work per side and repetition")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both sides")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    results: list[str] = []
    for size, n in (("small", args.samples), ("large", args.large_samples)):
        samples = make_samples(n, SHAPES[size])
        x = torch.from_numpy(np.stack([process(s)[0] for s in samples]))
        y = torch.from_numpy(np.stack([process(s)[1] for s in samples]))
        nbytes = samples[0].nbytes
        if size == "small":
            profile(samples, args.batch)
        for kind, deterministic in itertools.product(BUFFERS, (True, False)):
            indices = batch_indices(kind, n, args.batch, gen)
            pipe, base = [], []
            for _ in range(args.repeat):  # interleaved, so drifts hit both sides
                pipe.append(
                    run_for(
                        args.min_seconds, functools.partial(pipeline_pass, kind, samples, args.batch, deterministic)
                    )
                )
                base.append(run_for(args.min_seconds, functools.partial(baseline_pass, x, y, indices)))
            ratios = sorted(a / b for a, b in zip(pipe, base))
            p, b = statistics.median(pipe), statistics.median(base)
            name = f"{kind}_{size}" if deterministic else f"per_serving_{kind}_{size}"
            print(
                f"{name:24s}: pipeline {p:10.0f}/s {p * nbytes / 1e6:7.0f} MB/s | "
                f"baseline {b:10.0f}/s {b * nbytes / 1e6:7.0f} MB/s | "
                f"ratios {ratios[0]:.3f}..{ratios[-1]:.3f}"
            )
            results.append(
                f"RESULT pipeline_{name} ratio={statistics.median(ratios):.3f} "
                f"target={TARGET if deterministic else 'none'} "
                f"pipeline={p:.0f} baseline={b:.0f} sample={nbytes}B batch={args.batch}"
            )
        del samples, x, y
    print("\n".join(results))


if __name__ == "__main__":
    main()
