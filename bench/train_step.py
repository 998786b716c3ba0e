"""Buffer -> batch -> training step of the heat surrogate, against the same steps on tensors already on the device.

The server's side: heat samples (5 parameters and an ``nx x ny`` float32
field, as the receiver makes them) put into a FIRO buffer after the dataset
was made, so that the surrogate's ``process`` runs once per sample as it is
put (``deterministic_process``, untimed like the receiver's work); then
timed: ``StreamDataset.next_batch`` (gathered into pinned memory for a GPU,
as the server asks), ``to_device`` (a non-blocking copy on a stream of its own), ``training_step``,
backward and Adam's step.
The baseline: the same processed samples stacked once on the device, each
batch ``X[idx], Y[idx]`` of random indices already there, then the same
step. Sides alternate; figures are medians of ``--repeat`` repetitions and
the ratio (server's samples/s over the baseline's) the median of
per-repetition ratios: RESULT ``train_step_<device>``. On a GPU a third side
gathers into pageable memory and copies it as it is (``.to(device)``),
RESULT ``train_step_unpinned_cuda``, to show what pinning gives.

    python bench/train_step.py [--device cpu|cuda] [--nx 64] [--batch 256] [--samples 8192] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pipeline import filled

from melissa_dl.buffers.sample import Sample
from melissa_dl.train.dataset import END, Batch, StreamDataset
from melissa_dl.train.trainer import to_device

sys.path.insert(0, str(Path(__file__).parent.parent / "examples" / "heat_pde"))
from surrogate import FIELD, HeatSurrogate  # noqa: E402  (the example's own folder, put on the path above)


def make_samples(n: int, nx: int, seed: int = 0) -> list[Sample]:
    rng = np.random.default_rng(seed)
    params = rng.uniform(100, 500, (n, 5))
    fields = rng.uniform(100, 500, (n, nx, nx)).astype(np.float32)
    return [Sample(i, i % 100, params[i], {FIELD: fields[i]}) for i in range(n)]


def train_step(model: HeatSurrogate, optimizer: torch.optim.Optimizer, data: Any) -> None:
    optimizer.zero_grad()
    model.training_step(data).backward()
    optimizer.step()


def timed(device: torch.device, run: Callable[[], int]) -> float:
    """Samples per second of ``run`` (which returns how many it trained on), the GPU's work included."""
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    sync()
    start = time.perf_counter()
    count = run()
    sync()
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--nx", type=int, default=64, help="the field is nx x nx")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    model = HeatSurrogate(nx=args.nx, ny=args.nx, steps=100).to(device)
    optimizer = model.configure_optimizer()
    samples = make_samples(args.samples, args.nx)
    stacked = [torch.stack(column).to(device) for column in zip(*(model.process(s) for s in samples))]
    generator = torch.Generator(device=device).manual_seed(1)

    def server(move: Callable[[Any], Any], pin_memory: bool) -> Callable[[], int]:
        _, dataset = filled(
            "firo", samples, lambda buffer: StreamDataset(buffer, model.process, args.batch, True, pin_memory)
        )
        assert dataset is not None

        def run() -> int:
            count = 0
            while isinstance(batch := dataset.next_batch(), Batch):
                train_step(model, optimizer, move(batch.data))
                count += len(batch)
            assert batch is END
            return count

        return run

    def baseline() -> int:
        order = torch.randperm(args.samples, generator=generator, device=device)
        for idx in order.split(args.batch):
            train_step(model, optimizer, [column[idx] for column in stacked])
        return args.samples

    sides: dict[str, Callable[[], Callable[[], int]]] = {
        "server": lambda: server(lambda data: to_device(data, device), pin_memory=device.type == "cuda"),
        "baseline": lambda: baseline,
    }
    if device.type == "cuda":
        sides["unpinned"] = lambda: server(lambda data: [t.to(device) for t in data], pin_memory=False)
    rates: dict[str, list[float]] = {side: [] for side in sides}
    for make in sides.values():  # warm up: kernels, allocator, pinned blocks
        timed(device, make())
    for _ in range(args.repeat):  # interleaved, so drifts hit every side
        for side, make in sides.items():
            run = make()  # the buffer filled (and processed) untimed
            rates[side].append(timed(device, run))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    sample_bytes = samples[0].nbytes
    print(f"torch {torch.__version__} device={name} nx={args.nx} batch={args.batch} sample={sample_bytes} B")
    for side, values in rates.items():
        print(f"  {side:9s}: {statistics.median(values):10.0f} samples/s  ({', '.join(f'{v:.0f}' for v in values)})")
    for side in (s for s in sides if s != "baseline"):
        ratio = statistics.median(a / b for a, b in zip(rates[side], rates["baseline"]))
        label = "train_step" if side == "server" else f"train_step_{side}"
        print(
            f"RESULT {label}_{device.type} ratio={ratio:.3f} target=0.8 "
            f"samples_per_s={statistics.median(rates[side]):.0f} "
            f"baseline_samples_per_s={statistics.median(rates['baseline']):.0f} "
            f"sample={sample_bytes}B batch={args.batch}"
        )


if __name__ == "__main__":
    main()
