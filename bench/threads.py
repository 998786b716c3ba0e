"""torch's threads per server rank: the default (``training.threads`` null) against torch's own and fixed counts
(issue 54, item 3).

The heat study (``examples/heat_pde``: its solver, surrogate and settings) on 2 server ranks with 4 local
simulations at once, each solving on a grid ``--refine`` times finer than it sends, so that the simulations keep
the cores busy while training runs; ``--simulations`` of them, a Reservoir of ``--capacity`` samples. The same
study once per thread count: the default (what the server picks: the log says), torch's own default (what
``torch.get_num_threads()`` says in a fresh process: one thread per core, in every rank), and 1, 2 and every
core. The figure is training's batches per second while simulations run (``progress.jsonl``: from the first
status with a batch to the last with a simulation running), the part of a study where they share the cores.

Prints ``RESULT threads_default``: the default's batches/s over torch's own default's (target >= 1.3), and
``RESULT threads_default_vs_best``: over the best of 1, 2 and every core (target >= 0.9).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from studies import ROOT, environment, mpirun  # bench/ is the script's folder

HEAT = ROOT / "examples" / "heat_pde"
CHOSEN = re.compile(r"torch threads per rank \(intra- and inter-op\): (\d+) on 2 ranks")


def study(folder: Path, args: argparse.Namespace, threads: int | None) -> tuple[float, int]:
    """Batches per second of one heat study trained with ``threads`` (None: the default), and the count used."""
    for name in ("heat.py", "solver.py", "surrogate.py"):
        shutil.copy(HEAT / name, folder / name)
    config = json.loads((HEAT / "config.json").read_text())
    config.update(output_dir=str(folder / "output"), plots=False)
    config["server"]["status_interval"] = 0.5
    config["study"].update(simulations=args.simulations, validation={"simulations": 2, "seed": 1})
    config["buffer"].update(capacity_samples=args.capacity)
    config["launcher"]["command"] = [sys.executable, "heat.py", "--refine", str(args.refine)]
    config["launcher"]["job_limit"] = 4
    config["training"].update(threads=threads)
    config.pop("$schema", None)
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    done = subprocess.run(
        [mpirun(), "-n", "2", sys.executable, "-m", "melissa_dl", "--fresh", str(path)],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=3600,
    )
    report_path = folder / "output" / "report.json"
    report = json.loads(report_path.read_text()) if done.returncode == 0 and report_path.exists() else None
    chosen = CHOSEN.search(done.stdout + done.stderr)
    if report is None or report["simulations"]["done"] != args.simulations + 2 or chosen is None:
        sys.exit(f"bench/threads.py: the study with threads={threads} failed:\n{done.stdout[-3000:]}{done.stderr}")
    return contended_rate(folder / "output" / "progress.jsonl"), int(chosen.group(1))


def contended_rate(history: Path) -> float:
    """Batches per second from the first status with a batch to the last with a simulation running."""
    statuses = [json.loads(line) for line in history.read_text().splitlines()]
    running = [s for s in statuses if s["simulations"]["running"] > 0 and s["training"]["batches"] > 0]
    first, last = running[0], running[-1]
    if last["elapsed_s"] <= first["elapsed_s"]:
        sys.exit(f"bench/threads.py: too few statuses while simulations ran in {history}")
    return (last["training"]["batches"] - first["training"]["batches"]) / (last["elapsed_s"] - first["elapsed_s"])


def torch_default() -> int:
    """torch's own thread count in a fresh process of this environment (what a rank gets unless it is set)."""
    found = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(found.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--simulations", type=int, default=16)
    parser.add_argument("--refine", type=int, default=4, help="each simulation solves on a grid this much finer")
    parser.add_argument("--capacity", type=int, default=256, help="samples of each rank's Reservoir")
    args = parser.parse_args()
    cores, torch_threads = len(os.sched_getaffinity(0)), torch_default()
    fixed = sorted({1, min(2, cores), cores, torch_threads})
    rates: dict[int, float] = {}
    default, chosen = 0.0, 0
    with tempfile.TemporaryDirectory() as scratch:
        for threads in [None, *fixed]:
            folder = Path(scratch) / str(threads)
            folder.mkdir()
            rate, used = study(folder, args, threads)
            print(f"threads={used}{' (the default)' if threads is None else ''}: {rate:.2f} batch/s", flush=True)
            if threads is None:
                default, chosen = rate, used
            else:
                rates[threads] = rate
    best = max((1, min(2, cores), cores), key=lambda n: rates[n])
    common = f"default_threads={chosen} cores={cores} simulations={args.simulations} refine={args.refine}"
    print(
        f"RESULT threads_default ratio={default / rates[torch_threads]:.3f} target=1.3 "
        f"default_batches_per_s={default:.2f} torch_threads={torch_threads} "
        f"torch_batches_per_s={rates[torch_threads]:.2f} {common}"
    )
    print(
        f"RESULT threads_default_vs_best ratio={default / rates[best]:.3f} target=0.9 "
        f"default_batches_per_s={default:.2f} best_threads={best} best_batches_per_s={rates[best]:.2f} {common}"
    )


if __name__ == "__main__":
    main()
