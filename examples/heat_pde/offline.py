"""The heat-equation study done the classic way: simulate to disk, then train.

This is the baseline that online training is measured against
(``bench/online_vs_offline.py``, docs/explanation/online-vs-offline.md#the-two-experiments).
It reads the same config as the server and trains the same ``TrainingModule`` with the same options, seed,
batch size and validation schedule, in two phases:

1. **Generate**: draw the study's parameter sets exactly as the server does
   (``melissa_dl.study.sampling.parameter_table``) and run the simulation program,
   ``heat.py``, once for each, with the grid and step count of
   ``launcher.command`` (``--nx``, ``--ny``, ``--steps``, ``--dt``,
   ``--refine``), ``launcher.env`` in its environment and
   ``launcher.job_limit`` of them at a time, as the server starts them; each
   writes its steps to ``<output>/simulations/simulation<s>.npy``
   (``[steps, nx, ny]`` float32) instead of sending them, and the parameters
   go to ``<output>/parameters.npy``. A simulation costs the same process
   start and solve on both sides; only the transport differs.
2. **Train**: load every step back into memory, then epochs of shuffled
   batches of ``training.batch_size`` samples, the optimizer from the
   module, until ``--batches`` batches or the time budget. With
   ``deterministic_process`` every sample is processed once and the outputs
   stacked, so a batch is one indexing per output (the fastest way through
   an in-memory data set); otherwise a ``DataLoader`` runs ``process`` on
   each sample it serves (``default_collate``). The held-out samples
   (``validation_samples()``, and the study's held-out simulations,
   ``study.validation``, generated in phase 1 like the others) are
   evaluated before the first batch, every
   ``training.nb_batches_update`` batches and at the end, with the server's
   rule (mean of ``validation_step`` over chunks of
   ``training.validation_batch_size``, weighted by chunk size); the report
   gives each as ``[batches, loss, seconds since this script started]``.
   ``--save-model`` writes the trained module's ``state_dict``.

Training is one process, no MPI: a "batch" here is ``batch_size`` samples,
one optimizer step. ``--generation-cpus`` and ``--training-cpus`` confine
each phase to some cores (the simulations inherit the first), as a cluster
confines simulations and training to their own nodes. torch keeps its default thread count (one per
core), the fastest on an
otherwise idle machine; with other busy processes on the cores, ``--threads
1`` is much faster (at this model size threads mostly wait for each other).
Time budgets: ``--seconds`` bounds the training phase (timed as the server
times its own); ``--total-seconds`` bounds the whole run from the start of
this script (imports, generation, loading and training), so that it can be
matched to the wall time of an online run; interpreter exit (0.5-1 s with
torch loaded) comes on top of either. Training runs on the CPU.

    python examples/heat_pde/offline.py [--config examples/heat_pde/config.json]
        [--seconds S | --total-seconds S] [--batches N] [--output DIR] [--report out.json]
"""

from __future__ import annotations

import time

START = time.monotonic()  # before the heavy imports: --total-seconds counts them

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from collections.abc import Iterable, Iterator, Sequence  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # solver.py and surrogate.py sit next to this script
sys.path.insert(0, str(HERE.parents[1]))  # the repository, when melissa_dl is not installed

import numpy as np  # noqa: E402
import torch  # noqa: E402
from solver import DEFAULT_DT  # noqa: E402
from torch.utils._pytree import tree_map  # noqa: E402
from torch.utils.data import DataLoader, Dataset, default_collate  # noqa: E402

from launcher.placeholders import placeholders_in  # noqa: E402
from melissa_dl import Sample, TrainingModule  # noqa: E402
from melissa_dl.config.sections import Config, TrainingConfig, load_config  # noqa: E402
from melissa_dl.study.sampling import held_out_table, parameter_table  # noqa: E402
from melissa_dl.train.module import load_module_class  # noqa: E402

FIELD = "temperature"
DEFAULT_BATCHES = 500


@dataclass
class Grid:
    """What each simulation computes, read from ``launcher.command``."""

    nx: int = 32
    ny: int = 32
    steps: int = 100
    dt: float = DEFAULT_DT
    refine: int = 1


def grid_of(config: Config) -> Grid:
    """The solver arguments of the study's command line (heat.py's defaults otherwise)."""
    command = config.launcher.command
    grid = Grid(steps=config.study.time_steps or Grid.steps)
    for flag, attr, kind in (
        ("--nx", "nx", int),
        ("--ny", "ny", int),
        ("--steps", "steps", int),
        ("--dt", "dt", float),
        ("--refine", "refine", int),
    ):
        if flag in command[:-1]:
            setattr(grid, attr, kind(command[command.index(flag) + 1]))
    return grid


def training_config(config: Config, grid: Grid) -> TrainingConfig:
    """The config's ``training`` section, or the example's surrogate if there is none."""
    if config.training is not None:
        return config.training
    low = min(p.low for p in config.study.parameters)
    high = max(p.high for p in config.study.parameters)
    options = {"nx": grid.nx, "ny": grid.ny, "steps": grid.steps, "dt": grid.dt, "low": low, "high": high}
    return TrainingConfig(module="surrogate.py", class_name="HeatSurrogate", options=options)


def generate(parameters: np.ndarray, grid: Grid, folder: Path, jobs: int, env: dict[str, str]) -> None:
    """Phase 1: run the simulation program for every parameter set, ``jobs`` at a time, each writing its steps
    to one .npy file."""
    (folder / "simulations").mkdir(parents=True, exist_ok=True)
    np.save(folder / "parameters.npy", parameters)
    program = [
        sys.executable,
        str(HERE / "heat.py"),
        "--nx",
        str(grid.nx),
        "--ny",
        str(grid.ny),
        "--steps",
        str(grid.steps),
        "--dt",
        repr(grid.dt),
        "--refine",
        str(grid.refine),
    ]

    def simulate(sim: int) -> None:
        subprocess.run(
            [
                *program,
                "--output",
                str(folder / "simulations" / f"simulation{sim}.npy"),
                "--parameters",
                *map(repr, parameters[sim].tolist()),
            ],
            env=env,
            check=True,
        )

    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(simulate, range(len(parameters))))


def load(folder: Path) -> list[Sample]:
    """Every stored step as a ``Sample``, the form the module's ``process`` takes."""
    parameters = np.load(folder / "parameters.npy")
    samples = []
    for sim, values in enumerate(parameters):
        steps = np.load(folder / "simulations" / f"simulation{sim}.npy")
        samples += [Sample(sim, t, values, {FIELD: steps[t]}) for t in range(len(steps))]
    return samples


class ProcessedSamples(Dataset):
    """The loaded samples, each turned into tensors by the module when fetched."""

    def __init__(self, samples: list[Sample], module: TrainingModule) -> None:
        self.samples = samples
        self.module = module

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Any:
        return self.module.process(self.samples[index])


def epochs(samples: list[Sample], module: TrainingModule, batch_size: int, seed: int) -> Iterator[Iterable[Any]]:
    """Endless epochs, each an iterable of shuffled batches (the last partial one dropped when one full
    batch fits)."""
    generator = torch.Generator().manual_seed(seed)
    drop_last = len(samples) >= batch_size
    if not module.deterministic_process:
        loader = DataLoader(
            ProcessedSamples(samples, module),
            batch_size=batch_size,
            shuffle=True,
            drop_last=drop_last,
            generator=generator,
        )
        while True:
            yield loader
    stacked = default_collate([module.process(s) for s in samples])
    while True:
        order = torch.randperm(len(samples), generator=generator).split(batch_size)
        if drop_last and len(order[-1]) < batch_size:
            order = order[:-1]
        yield (tree_map(lambda column, idx=idx: column[idx], stacked) for idx in order)


@torch.no_grad()
def validate(module: TrainingModule, samples: list[Sample], chunk: int) -> float | None:
    """Mean validation loss over the held-out samples (the server's rule, on one rank)."""
    if not samples:
        return None
    module.eval()
    total = 0.0
    for i in range(0, len(samples), chunk):
        part = samples[i : i + chunk]
        batch = default_collate([module.process(s) for s in part])
        total += float(module.validation_step(batch)) * len(part)
    module.train()
    return total / len(samples)


def train(
    module: TrainingModule,
    samples: list[Sample],
    options: TrainingConfig,
    max_batches: int | None,
    seconds: float | None,
    deadline: float,
    log: bool,
    held_out: Sequence[Sample] = (),
) -> dict[str, Any]:
    """Phase 2: shuffled epochs over the loaded samples until the budget is spent.

    The clock starts where the server's does: module and optimizer built,
    just before the first validation. ``seconds`` counts from there,
    ``deadline`` is absolute (``time.monotonic()``); the first reached wins.
    """
    optimizer = module.configure_optimizer()
    validation_set = [*module.validation_samples(), *held_out]  # the study's held-out simulations too
    curve: list[list[float]] = []

    def record(batches: int) -> None:
        loss = validate(module, validation_set, options.validation_batch_size)
        if loss is not None:
            curve.append([batches, loss, round(time.monotonic() - START, 3)])
            if log:
                print(f"  validation loss {loss:.6g} after {batches} batches", flush=True)

    start = time.monotonic()
    if seconds is not None:
        deadline = min(deadline, start + seconds)
    batches = trained = 0
    record(0)
    module.train()
    done = max_batches == 0 or not samples or time.monotonic() >= deadline
    for epoch in epochs(samples, module, options.batch_size, options.seed):
        if done:
            break
        for batch in epoch:
            optimizer.zero_grad(set_to_none=True)
            loss = module.training_step(batch)
            loss.backward()
            optimizer.step()
            batches += 1
            trained += len(batch[0]) if isinstance(batch, (list, tuple)) else options.batch_size
            if batches % options.nb_batches_update == 0:
                record(batches)
            if batches == max_batches or time.monotonic() >= deadline:
                done = True
                break
    duration = time.monotonic() - start
    if batches % options.nb_batches_update:
        record(batches)
    return {
        "batches": batches,
        "samples_trained": trained,
        "duration_s": round(duration, 3),
        "batches_per_s": round(batches / duration, 3) if duration > 0 else 0.0,
        "validation": curve,
        "first_validation_loss": curve[0][1] if curve else None,
        "last_validation_loss": curve[-1][1] if curve else None,
    }


def cpu_list(text: str) -> set[int]:
    return {int(core) for core in text.split(",")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=HERE / "config.json")
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--seconds", type=float, help="wall-time budget of the training phase")
    budget.add_argument("--total-seconds", type=float, help="wall-time budget of the whole run, imports included")
    parser.add_argument(
        "--batches", type=int, help=f"stop after N batches (default {DEFAULT_BATCHES} without a time budget)"
    )
    parser.add_argument(
        "--output", type=Path, help="folder of the simulation files (default <config dir>/output_offline)"
    )
    parser.add_argument("--report", type=Path, help="JSON report (default <output>/report.json)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's own, one per core)")
    parser.add_argument(
        "--generation-cpus",
        type=cpu_list,
        metavar="0,1",
        help="run the generation on these cores only (default: wherever this process may)",
    )
    parser.add_argument(
        "--training-cpus",
        type=cpu_list,
        metavar="0,1",
        help="run the loading and training on these cores only (default: wherever this process may)",
    )
    parser.add_argument("--save-model", type=Path, help="write the trained module's state_dict here")
    parser.add_argument("--quiet", action="store_true", help="print the summary only")
    args = parser.parse_args(argv)

    config = load_config(args.config)
    grid = grid_of(config)
    options = training_config(config, grid)
    output = args.output or config.base_dir / "output_offline"
    report_path = args.report or output / "report.json"
    max_batches = args.batches
    if max_batches is None and args.seconds is None and args.total_seconds is None:
        max_batches = DEFAULT_BATCHES

    parameters = parameter_table(config.study, config.base_dir)
    if args.generation_cpus:
        os.sched_setaffinity(0, args.generation_cpus)
    t0 = time.monotonic()
    if any(placeholders_in(value) for value in config.launcher.env.values()):
        sys.exit("offline.py: launcher.env has placeholders ({slot}, ...): offline runs have no slots; remove them")
    environment = {**os.environ, **config.launcher.env}
    generate(parameters, grid, output, config.launcher.job_limit, environment)
    held_out_parameters = held_out_table(config.study)  # the study's held-out simulations
    if len(held_out_parameters):
        generate(held_out_parameters, grid, output / "held_out", config.launcher.job_limit, environment)
    generation_s = time.monotonic() - t0
    if args.training_cpus:
        os.sched_setaffinity(0, args.training_cpus)

    t0 = time.monotonic()
    samples = load(output)
    held_out = load(output / "held_out") if len(held_out_parameters) else []
    load_s = time.monotonic() - t0

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(options.seed)  # as the server does, so that both start from the same weights
    module = load_module_class(config.base_dir / options.module, options.class_name)(**options.options)
    deadline = START + args.total_seconds if args.total_seconds is not None else math.inf
    if not args.quiet:
        print(
            f"generated {len(parameters)} simulations x {grid.steps} steps ({grid.nx}x{grid.ny}) "
            f"in {generation_s:.3f} s, loaded {len(samples)} samples in {load_s:.3f} s; training "
            f"{options.class_name} (batch {options.batch_size}, validation every {options.nb_batches_update})",
            flush=True,
        )
    training = train(module, samples, options, max_batches, args.seconds, deadline, not args.quiet, held_out)
    if args.save_model is not None:
        torch.save(module.state_dict(), args.save_model)
    report = {
        "config": str(args.config),
        "simulations": len(parameters),
        "samples": len(samples),
        "generation_s": round(generation_s, 3),
        "load_s": round(load_s, 3),
        "training_s": training["duration_s"],
        "total_s": round(time.monotonic() - START, 3),
        "torch_threads": torch.get_num_threads(),
        "training": training,
    }
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    first, last = training["first_validation_loss"], training["last_validation_loss"]
    reduction = f", {first / last:.1f}x lower" if first and last else ""
    print(
        f"offline: generation {generation_s:.2f} s, load {load_s:.2f} s, training {training['duration_s']:.2f} s; "
        f"{training['batches']} batches ({training['batches_per_s']:.1f} batch/s); "
        f"validation loss {first} -> {last}{reduction}; report {report_path}",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
