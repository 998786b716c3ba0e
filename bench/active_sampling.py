"""Active sampling against blind sampling, at the same number of simulations
(docs/explanation/performance.md#what-the-targets-are).

Runs the Burgers example (``examples/burgers``: ``c`` and ``nu`` swept, the
difficulty concentrated in the thin slab of small viscosities where shocks
form) as whole studies of the server, once per sampler (``uniform``,
``halton``, ``adaptive``) and seed, each in a fresh output folder, the
samplers' order rotating with the seed. Everything else is the example's
config: the same simulations (count, program, cost: ``--refine`` of the
solver), the same buffer, model, optimizer, batch and training seed, K ranks.
As on a cluster, the simulations run on cores of their own (all but the
first) and the server on the first, so that how many simulations run at a
moment does not change how fast the model trains. A study trains while its
simulations run and stops when they are all trained on, so each side's wall
time and batches are reported beside its errors: the adaptive sampler may
wait for the losses of a generation's candidate parents.

Each final model is judged on the same held-out set: ``--validation-simulations``
parameter sets drawn uniformly over the whole box (never trained on), solved
once before the first run. Per held-out sample, the mean squared error over
the field (normalised units); per run, the mean, 99th percentile and maximum
over the held-out samples. ``bench/active_sampling.png`` shows where each
sampler put its simulations (seed 0) and each held-out simulation's error
against its viscosity. Ends with the medians over seeds of the per-seed
ratios (> 1: adaptive better), against uniform and, for information, against
Halton::

    RESULT active_sampling_max ratio=<uniform max error / adaptive max error>
    RESULT active_sampling_p99 ratio=<uniform p99 / adaptive p99>
    RESULT active_sampling_mean ratio=<uniform mean / adaptive mean>

    python bench/active_sampling.py [--seeds 3] [--ranks 1] [--samplers uniform halton adaptive]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from studies import ROOT, environment, mpirun, p99, per_sample_errors  # bench/ is the script's folder

EXAMPLE = ROOT / "examples" / "burgers"
PICTURE = ROOT / "bench" / "active_sampling.png"
sys.path.insert(0, str(EXAMPLE))  # the surrogate imports solver.py from its folder

from melissa_dl.train.module import load_module_class  # noqa: E402

SAMPLERS = ("uniform", "halton", "adaptive")
HARD = 0.1  # the lowest tenth of the viscosity range: where the shocks are sharp
CORES = sorted(os.sched_getaffinity(0))
SERVER_CORES, SIMULATION_CORES = (CORES[:1], CORES[1:]) if len(CORES) > 1 else (CORES, CORES)


@dataclass
class Run:
    sampler: str
    seed: int
    wall_s: float
    batches: int
    parameters: np.ndarray  # [simulations, 2]: c, nu
    errors: np.ndarray  # per held-out sample

    def metric(self, name: str) -> float:
        return {"mean": float(self.errors.mean()), "p99": p99(self.errors), "max": float(self.errors.max())}[name]


def config_for(args: argparse.Namespace, sampler: str, seed: int, folder: Path) -> Path:
    """The example's config made into this run's: absolute paths, the sampler, the seeds, a fresh output folder."""
    data = json.loads((EXAMPLE / "config.json").read_text())
    data.pop("$schema")
    data["output_dir"] = str(folder / f"{sampler}-{seed}")
    data["study"].update(sampler=sampler, seed=seed)
    data["launcher"]["command"] = [
        "taskset",
        "-c",
        cpus(SIMULATION_CORES),
        sys.executable,
        str(EXAMPLE / "burgers.py"),
        *data["launcher"]["command"][2:],
    ]
    training = data["training"]
    training.update(module=str(EXAMPLE / "surrogate.py"), seed=seed)
    training["batch_size"] //= args.ranks  # the same global batch on every K
    training["options"].update(module_options(args, data))
    path = folder / f"{sampler}-{seed}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def module_options(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    return {
        **config["training"]["options"],
        "validation_simulations": args.validation_simulations,
        "validation_seed": 1,
        "validation_cache": str(args.validation_cache),
    }


def run_study(args: argparse.Namespace, sampler: str, seed: int, folder: Path, module: Any, held_out: list[Any]) -> Run:
    config = config_for(args, sampler, seed, folder)
    command = [
        "taskset",
        "-c",
        cpus(SERVER_CORES),
        mpirun(),
        "-n",
        str(args.ranks),
        sys.executable,
        "-m",
        "melissa_dl",
        "--fresh",
        str(config),
    ]
    start = time.perf_counter()
    with open(config.with_suffix(".log"), "w") as log:
        code = subprocess.run(command, env=environment(), stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode
    wall = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"the {sampler} study of seed {seed} exited {code}: see {config.with_suffix('.log')}")
    output = Path(json.loads(config.read_text())["output_dir"])
    report = json.loads((output / "report.json").read_text())
    sims = report["per_simulation"]
    run = Run(
        sampler,
        seed,
        wall,
        report["training"]["batches"],
        np.array([[s["parameters"]["c"], s["parameters"]["nu"]] for s in sims]),
        per_sample_errors(module, output / "model.pt", held_out),
    )
    hard = float(np.mean(run.parameters[:, 1] < hard_viscosity(module)))
    print(
        f"  seed {seed} {sampler:8s}: {len(sims)} simulations ({hard:.0%} in the hard slab), {run.batches} batches "
        f"in {wall:.1f} s; held-out error mean {run.metric('mean'):.3g}, p99 {run.metric('p99'):.3g}, "
        f"max {run.metric('max'):.3g}",
        flush=True,
    )
    return run


def cpus(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def hard_viscosity(module: Any) -> float:
    low, high = module.bounds[1]
    return low + HARD * (high - low)


def draw(runs: list[Run], module: Any, held_out: list[Any]) -> None:
    """Where each sampler put its simulations (seed 0), and each held-out simulation's worst step against nu."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = [r for r in runs if r.seed == min(run.seed for run in runs)]
    figure, axes = plt.subplots(1, len(first) + 1, figsize=(4.2 * (len(first) + 1), 3.8), constrained_layout=True)
    for ax, run in zip(axes, first):
        order = np.arange(len(run.parameters))
        points = ax.scatter(run.parameters[:, 0], run.parameters[:, 1], c=order, cmap="viridis", s=12)
        ax.axhline(hard_viscosity(module), color="grey", linewidth=0.8, linestyle="--")
        ax.set(title=f"{run.sampler} (seed {run.seed})", xlabel="c", ylabel="nu", yscale="log")
    figure.colorbar(points, ax=axes[len(first) - 1], label="simulation id (launch order)")
    nu = np.array([s.parameters[1] for s in held_out]).reshape(-1, module.steps)[:, 0]
    for run in first:
        worst = run.errors.reshape(-1, module.steps).max(axis=1)
        axes[-1].scatter(nu, worst, s=10, label=run.sampler)
    axes[-1].set(title="held-out simulations", xlabel="nu", ylabel="worst step's error", xscale="log", yscale="log")
    axes[-1].legend()
    figure.savefig(PICTURE, dpi=110)
    print(f"picture: {PICTURE}")


def summarise(args: argparse.Namespace, runs: list[Run], module: Any) -> list[str]:
    """The table (medians over seeds) and the RESULT lines."""
    print(
        "\n| sampler | simulations | in the hard slab | wall time | batches | mean error | p99 error | max error |\n"
        + "|---" * 8
        + "|"
    )
    for sampler in [s for s in SAMPLERS if any(r.sampler == s for r in runs)]:
        mine = [r for r in runs if r.sampler == sampler]
        hard = statistics.median(float(np.mean(r.parameters[:, 1] < hard_viscosity(module))) for r in mine)
        print(
            f"| {sampler} | {len(mine[0].parameters)} | {hard:.0%} | "
            f"{statistics.median(r.wall_s for r in mine):.1f} s | {statistics.median(r.batches for r in mine):.0f} | "
            + " | ".join(f"{statistics.median(r.metric(m) for r in mine):.3g}" for m in ("mean", "p99", "max"))
            + " |"
        )
    by = {(r.sampler, r.seed): r for r in runs}
    seeds = sorted({r.seed for r in runs})
    tail = f"seeds={len(seeds)} ranks={args.ranks} simulations={len(runs[0].parameters)}"
    lines = []
    for reference, prefix in (("uniform", "active_sampling"), ("halton", "active_sampling_vs_halton")):
        if any((name, s) not in by for name in (reference, "adaptive") for s in seeds):
            continue
        for metric, target in (("max", 2.0), ("p99", 1.5), ("mean", 0.9)):
            ratios = [by[reference, s].metric(metric) / by["adaptive", s].metric(metric) for s in seeds]
            per_seed = ",".join(f"{r:.2f}" for r in ratios)
            goal = f" target={target}" if reference == "uniform" else ""
            lines.append(
                f"RESULT {prefix}_{metric} ratio={statistics.median(ratios):.3f}{goal} per_seed={per_seed} {tail}"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--ranks", type=int, default=1, help="K, the server's ranks (all on the server's core)")
    parser.add_argument("--validation-simulations", type=int, default=128)
    parser.add_argument("--samplers", nargs="+", choices=SAMPLERS, default=list(SAMPLERS))
    args = parser.parse_args()
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="melissa_active_sampling_") as tmp:
        args.validation_cache = Path(tmp) / "held-out"
        options = module_options(args, json.loads((EXAMPLE / "config.json").read_text()))
        module = load_module_class(EXAMPLE / "surrogate.py", "BurgersSurrogate")(**options)
        held_out = module.validation_samples()  # solved here once, outside every run
        for seed in range(args.seeds):
            for i in range(len(args.samplers)):
                sampler = args.samplers[(i + seed) % len(args.samplers)]
                runs.append(run_study(args, sampler, seed, Path(tmp), module, held_out))
    draw(runs, module, held_out)
    print("\n".join(summarise(args, runs, module)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
