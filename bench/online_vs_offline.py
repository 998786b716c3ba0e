"""Online against offline training, in a comparison that only honesty can win
(docs/explanation/performance.md#what-the-targets-are, row "online vs offline").

Both sides train the example's ``HeatSurrogate`` (same architecture, fused
Adam, lr, seed) on the heat equation with six parameters (five temperatures
and the diffusivity, which makes the field depend non-linearly on them) and
64x64 fields, and get:

- the same simulations: the same program, ``examples/heat_pde/heat.py``,
  one process per simulation, the same number at a time on the same cores;
  online it streams its steps to the server, offline (``offline.py``) it
  writes them to a ``.npy`` file that is read back before training;
- the same per-step batch (the experiment's): online, K ranks of
  ``batch / K`` samples each (gradients averaged); offline, one process on
  ``batch``;
- the same wall-clock budget ``--seconds``, counted from the launch of each
  side's process: online, ``mpirun`` of the server, stopped by SIGTERM at the
  budget (a graceful stop: the model at that moment is checkpointed, then
  exported); offline, ``examples/heat_pde/offline.py --total-seconds``,
  whose generation of the data set and its reading back count;
- the same memory for stored samples: the offline data set holds at most as
  many samples as the K online Reservoirs of ``capacity`` samples each, so
  offline generates ``K x capacity // steps`` simulations (as many as its
  memory holds) and trains epochs over them, while online streams as many
  simulations as its time allows through the Reservoirs;
- the same held-out validation set: the module's ``validation_samples()``,
  parameter sets drawn uniformly with their own seed, never trained on,
  solved once before the first run into the module's ``validation_cache``
  (outside both budgets: neither side spends its time on them), and the same
  validation schedule (every ``--validate-every`` steps).

Experiments (``--experiments``):

- **A, diversity at equal memory**: cheap simulations (the solver on the
  64x64 grid, well under a millisecond a step), K=2, a batch of 64,
  everything sharing the machine's cores: the online side's simulations (one
  per core, one thread each) and training ranks, the offline side's
  generation (one simulation per core) and training (torch's default
  threads) in turn;
- **B, simulation cost**: every step solved on a grid 8 times finer
  (``heat.py --refine 8``: about 8 ms a step of real solver work on one
  core), and a batch of 128, so that offline spends about as long generating
  its data (about 21 s) as training on them until its loss stops falling
  (about 13 s). A cluster in miniature: simulations run on cores of their
  own (all but the first) and training on the first, on both sides, two
  simulations per simulation core (one computes while the next starts);
  online runs K=1 rank on the training core. Its figure is the time to reach
  the offline side's final validation loss: offline has no model until its
  data is written.

Each experiment runs ``--seeds`` seeds (study sampler and training seed),
the two sides alternating which goes first, each in a fresh output folder.
After each run the bench evaluates the final model on every held-out sample:
the mean and 99th percentile of the per-sample mean squared error (in the
surrogate's normalised units). Validation curves against wall time go into
``bench/online_vs_offline.png``; the table of what each side got, medians
over seeds, is printed in Markdown. Ends with, per experiment, the medians of
the per-seed ratios (> 1: online better)::

    RESULT online_vs_offline_<X>_validation ratio=<offline mean error / online mean error>
    RESULT online_vs_offline_<X>_p99 ratio=<offline p99 error / online p99 error>
    RESULT online_vs_offline_<X>_time_to_target ratio=<offline time / online time to offline's final loss>

    python bench/online_vs_offline.py [--experiments A B] [--seeds 3] [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from studies import ROOT, environment, mpirun, p99, per_sample_errors  # bench/ is the script's folder

EXAMPLE = ROOT / "examples" / "heat_pde"
PICTURE = ROOT / "bench" / "online_vs_offline.png"
sys.path.insert(0, str(EXAMPLE))  # the surrogate imports solver.py from its folder

from melissa_dl.runtime.metrics import VALIDATION_LOSS  # noqa: E402
from melissa_dl.runtime.status import EXIT_STOPPED  # noqa: E402
from melissa_dl.study.plots import read_losses  # noqa: E402
from melissa_dl.train.module import load_module_class  # noqa: E402

DIFFUSIVITY = [0.2, 2.0]
SAMPLE_BYTES = 64 * 64 * 4  # a float32 field; the six parameters and the step come on top, the same on both sides


@dataclass(frozen=True)
class Experiment:
    name: str
    refine: int  # solver grid refinement: the cost of a simulation step
    capacity: int  # samples per rank's Reservoir; the offline data set holds ranks x capacity // steps simulations
    ranks: int  # K, server ranks of the online side
    batch: int  # samples per training step: batch / ranks per rank online
    dedicated: bool  # simulations on cores of their own, training on the others (on both sides), as on a cluster


EXPERIMENTS = {
    "A": Experiment("A", refine=1, capacity=500, ranks=2, batch=64, dedicated=False),
    "B": Experiment("B", refine=8, capacity=2000, ranks=1, batch=128, dedicated=True),
}
CORES = sorted(os.sched_getaffinity(0))
TRAINING_CORES, SIMULATION_CORES = CORES[:1], CORES[1:]  # of a dedicated experiment
ONE_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


@dataclass
class Run:
    """One side's run: validation curve (seconds from launch, loss) and what it got."""

    side: str
    curve: list[tuple[float, float]]
    ended: float  # seconds from launch to the final model
    stored_samples: int  # the most it could hold: its buffers' capacity, or its data set
    simulations: int
    unique_samples: int
    samples_trained: int
    training_s: float
    batches: int
    errors: np.ndarray = field(default_factory=lambda: np.zeros(0))
    generation_s: float = 0.0


def config_for(args: argparse.Namespace, experiment: Experiment, seed: int, side: str, folder: Path) -> Path:
    """The example's config made into this run's: absolute paths, the experiment's problem and budgets."""
    data = json.loads((EXAMPLE / "config.json").read_text())
    offline = side == "offline"
    # online: more than the budget lets it run (it stops on time); offline: what its memory holds
    simulations = experiment.ranks * experiment.capacity // args.steps if offline else 5000
    data["output_dir"] = str(folder / side)
    data["server"]["status_interval"] = 0.5  # the last status before the stop gives the online side's counts
    data["study"].update(simulations=simulations, seed=seed, time_steps=args.steps)
    data["study"]["parameters"].append({"name": "diffusivity", "low": DIFFUSIVITY[0], "high": DIFFUSIVITY[1]})
    pinned = ["taskset", "-c", cpus(SIMULATION_CORES)] if experiment.dedicated else []
    data["launcher"].update(
        command=[
            *pinned,
            "python",
            str(EXAMPLE / "heat.py"),
            "--nx",
            "64",
            "--ny",
            "64",
            "--steps",
            str(args.steps),
            "--refine",
            str(experiment.refine),
        ],
        # each simulation on one thread (BLAS threads spin when they share cores); dedicated: two per core
        # of their own, so that one computes while the next starts; otherwise one per core
        job_limit=2 * len(SIMULATION_CORES) if experiment.dedicated else len(CORES),
        env=ONE_THREAD,
    )
    per_rank = experiment.batch // experiment.ranks
    data["buffer"].update(kind="reservoir", capacity_samples=experiment.capacity, per_server_watermark=per_rank)
    training = data["training"]
    training.update(
        module=str(EXAMPLE / "surrogate.py"),
        seed=seed,
        batch_size=experiment.batch if offline else per_rank,
        nb_batches_update=args.validate_every,
    )
    training["options"] = module_options(args, experiment)
    data["checkpoint"] = {"interval": 0}
    path = folder / f"{side}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def module_options(args: argparse.Namespace, experiment: Experiment) -> dict[str, Any]:
    return {
        "hidden": 256,
        "depth": 3,
        "lr": 2e-3,
        "nx": 64,
        "ny": 64,
        "steps": args.steps,
        "diffusivity": DIFFUSIVITY,
        "refine": experiment.refine,
        "validation_simulations": args.validation_simulations,
        "validation_seed": 1,
        "validation_cache": str(args.validation_cache),
    }


def cpus(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def run_for_budget(command: list[str], config: Path, seconds: float) -> tuple[float, float]:
    """Run the server ``command`` on ``config`` for ``seconds`` from its launch, stop it by SIGTERM (a graceful
    stop, exit 75: every rank checkpoints) and export its model; when it was launched and how long it ran."""
    launched = time.time()
    with open(config.with_suffix(".log"), "w") as log:
        server = subprocess.Popen(command, env=environment(), stdout=log, stderr=subprocess.STDOUT)
        try:
            server.wait(timeout=seconds)
            raise RuntimeError(f"the online study ended (exit {server.returncode}) before its budget: see {log.name}")
        except subprocess.TimeoutExpired:
            server.send_signal(signal.SIGTERM)  # mpirun forwards it
        stopped = time.time() - launched
        code = server.wait(timeout=120)
    if code != EXIT_STOPPED:
        raise RuntimeError(f"the online study exited {code} on SIGTERM, not {EXIT_STOPPED}: see {log.name}")
    export = subprocess.run(
        [mpirun(), "-n", "1", sys.executable, "-m", "melissa_dl", "--export-model", str(config)],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    if export.returncode != 0:
        hint = "a budget too short for the server to checkpoint a model leaves none to export"
        raise RuntimeError(f"--export-model exited {export.returncode} ({hint}):\n{export.stderr[-2000:]}")
    return launched, stopped


def run_online(config: Path, args: argparse.Namespace, experiment: Experiment) -> tuple[Run, Path]:
    """The server on K ranks, stopped at the budget; its curve and the path of its final model."""
    data = json.loads(config.read_text())
    output = Path(data["output_dir"])
    pinned = ["taskset", "-c", cpus(TRAINING_CORES)] if experiment.dedicated else []
    command = [
        *pinned,
        mpirun(),
        "-n",
        str(experiment.ranks),
        sys.executable,
        "-m",
        "melissa_dl",
        "--fresh",
        str(config),
    ]
    launched, stopped = run_for_budget(command, config, args.seconds)
    _, times, values = read_losses(output / "tensorboard" / "rank0", launched, 1.0)[VALIDATION_LOSS]
    status = json.loads((output / "status.json").read_text())  # the last one before the stop (no report then)
    run = Run(
        "online",
        list(zip(times, values)),
        stopped,
        experiment.ranks * experiment.capacity,
        simulations=status["simulations"]["done"],
        unique_samples=status["samples"]["received"],
        samples_trained=status["samples"]["consumed"],
        training_s=stopped - times[0],
        batches=status["training"]["batches"],
    )
    return run, output / "model.pt"


def run_offline(config: Path, args: argparse.Namespace, experiment: Experiment) -> tuple[Run, Path]:
    """offline.py within the budget, imports and generation included; its curve and its final model."""
    folder = config.parent
    model, report_path = folder / "offline_model.pt", folder / "offline_report.json"
    command = [
        sys.executable,
        str(EXAMPLE / "offline.py"),
        "--config",
        str(config),
        "--quiet",
        "--total-seconds",
        f"{args.seconds:.3f}",
        "--output",
        str(folder / "offline"),
        "--report",
        str(report_path),
        "--save-model",
        str(model),
    ]
    env = environment()
    if experiment.dedicated:  # generation where the simulations run, training where the server does, one thread each
        command += [
            "--generation-cpus",
            cpus(SIMULATION_CORES),
            "--training-cpus",
            cpus(TRAINING_CORES),
            "--threads",
            str(len(TRAINING_CORES)),
        ]
        env.update(OPENBLAS_NUM_THREADS=str(len(SIMULATION_CORES)), OMP_NUM_THREADS=str(len(TRAINING_CORES)))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.seconds + 300)
    if done.returncode != 0:
        raise RuntimeError(f"offline.py exited {done.returncode}:\n{done.stderr[-2000:]}")
    report = json.loads(report_path.read_text())
    training = report["training"]
    curve = [(t, loss) for _, loss, t in training["validation"]]
    run = Run(
        "offline",
        curve,
        curve[-1][0],
        report["samples"],
        simulations=report["simulations"],
        unique_samples=report["samples"],
        samples_trained=training["samples_trained"],
        training_s=training["duration_s"],
        batches=training["batches"],
        generation_s=report["generation_s"],
    )
    return run, model


def time_to(curve: list[tuple[float, float]], target: float) -> float:
    """Seconds from launch until the validation loss first reached ``target`` (inf if never)."""
    return next((t for t, loss in curve if loss <= target), math.inf)


def run_seed(args: argparse.Namespace, experiment: Experiment, seed: int, folder: Path) -> tuple[Run, Run]:
    """Both sides of one seed, in fresh folders, the first side alternating with the seed."""
    module = load_module_class(EXAMPLE / "surrogate.py", "HeatSurrogate")(**module_options(args, experiment))
    held_out = module.validation_samples()
    runs: dict[str, Run] = {}
    for side in ("online", "offline") if seed % 2 == 0 else ("offline", "online"):
        config = config_for(args, experiment, seed, side, folder)
        run, model = (run_online if side == "online" else run_offline)(config, args, experiment)
        run.errors = per_sample_errors(module, model, held_out)
        if side == "online":  # its last point: the final model, at the moment it was stopped
            run.curve.append((run.ended, float(run.errors.mean())))
        runs[side] = run
        shutil.rmtree(folder / side, ignore_errors=True)
        shutil.rmtree(folder / "offline", ignore_errors=True)
    online, offline = runs["online"], runs["offline"]
    for run in (online, offline):
        print(
            f"  {experiment.name} seed {seed} {run.side:7s}: {run.simulations} simulations, "
            f"{run.unique_samples} unique samples, {run.batches} steps in {run.training_s:.1f} s "
            f"({run.samples_trained / run.training_s:.0f} samples/s trained), mean error "
            f"{run.errors.mean():.4g}, p99 {p99(run.errors):.4g}, time to offline's final "
            f"{time_to(run.curve, offline.curve[-1][1]):.1f} s"
            + (f", generation {run.generation_s:.1f} s" if run.side == "offline" else ""),
            flush=True,
        )
    return online, offline


def draw(results: dict[str, list[tuple[Run, Run]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(
        1, len(results), figsize=(5.5 * len(results), 4), constrained_layout=True, squeeze=False
    )
    for ax, (name, pairs) in zip(axes[0], results.items()):
        for i, (online, offline) in enumerate(pairs):
            for run, colour in ((online, "tab:blue"), (offline, "tab:orange")):
                t, loss = zip(*run.curve)
                ax.plot(
                    t,
                    loss,
                    color=colour,
                    alpha=0.8,
                    marker="o",
                    markersize=2,
                    linewidth=1,
                    label=run.side if i == 0 else None,
                )
        ax.set(
            title=f"experiment {name}", xlabel="seconds from launch", ylabel="held-out validation loss", yscale="log"
        )
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    figure.savefig(PICTURE, dpi=110)
    print(f"curves: {PICTURE}")


def summarise(args: argparse.Namespace, experiment: Experiment, pairs: list[tuple[Run, Run]]) -> list[str]:
    """The experiment's table of what each side got (medians over seeds) and its RESULT lines."""
    name, targets = experiment.name, [offline.curve[-1][1] for _, offline in pairs]
    print(
        "\n| exp. | side | budget | batch | stored samples | simulations | unique samples | generation"
        " | epochs | samples/s trained | mean error | p99 error | time to offline's final loss |\n" + "|---" * 13 + "|"
    )
    for side in (0, 1):
        runs = [pair[side] for pair in pairs]
        cells = [
            f"{statistics.median(values):{form}}"
            for form, values in (
                (".1f", [r.stored_samples * SAMPLE_BYTES / 1e6 for r in runs]),
                (".0f", [r.simulations for r in runs]),
                (".0f", [r.unique_samples for r in runs]),
                (".1f", [r.generation_s for r in runs]),
                (".1f", [r.samples_trained / max(r.unique_samples, 1) for r in runs]),
                (".0f", [r.samples_trained / r.training_s for r in runs]),
                (".3g", [float(r.errors.mean()) for r in runs]),
                (".3g", [p99(r.errors) for r in runs]),
                (".1f", [time_to(r.curve, target) for r, target in zip(runs, targets)]),
            )
        ]
        cells[3] = f"{cells[3]} s" if runs[0].side == "offline" else "(streamed)"
        print(
            f"| {name} | {runs[0].side} | {args.seconds:.0f} s | {experiment.batch} | {cells[0]} MB | "
            + " | ".join(cells[1:-1])
            + f" | {cells[-1]} s |"
        )
    validation = statistics.median([float(off.errors.mean() / on.errors.mean()) for on, off in pairs])
    tail_ratio = statistics.median([p99(off.errors) / p99(on.errors) for on, off in pairs])
    speed = statistics.median(
        [time_to(off.curve, target) / time_to(on.curve, target) for (on, off), target in zip(pairs, targets)]
    )
    tail = f"seeds={len(pairs)} seconds={args.seconds:.0f} ranks={experiment.ranks} dedicated={experiment.dedicated}"
    return [
        f"RESULT online_vs_offline_{name}_validation ratio={validation:.3f} target=1 {tail}",
        f"RESULT online_vs_offline_{name}_p99 ratio={tail_ratio:.3f} target=1 {tail}",
        f"RESULT online_vs_offline_{name}_time_to_target ratio={speed:.3f} target=1 {tail}",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experiments", nargs="+", choices=sorted(EXPERIMENTS), default=sorted(EXPERIMENTS))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=60.0, help="wall-clock budget of each side")
    parser.add_argument("--steps", type=int, default=50, help="time steps per simulation")
    parser.add_argument("--validate-every", type=int, default=100, help="steps between two validations")
    parser.add_argument("--validation-simulations", type=int, default=8)
    args = parser.parse_args()
    results: dict[str, list[tuple[Run, Run]]] = {}
    lines = []
    with tempfile.TemporaryDirectory(prefix="melissa_online_vs_offline_") as tmp:
        args.validation_cache = Path(tmp) / "held-out"  # solved before the first run, outside both budgets
        for name in args.experiments:
            results[name] = [run_seed(args, EXPERIMENTS[name], seed, Path(tmp)) for seed in range(args.seeds)]
            lines += summarise(args, EXPERIMENTS[name], results[name])
    draw(results)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
