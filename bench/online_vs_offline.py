"""Online vs offline heat-equation study, in one run (DESIGN.md §11, last row).

Online: ``mpirun -n K python -m melissa_dl`` on a copy of
``examples/heat_pde/config.json`` (output in a temporary folder): the
simulations stream into K ranks that train the config's ``training`` module
while data arrives. Its wall time W (mpirun start to exit) and the
``training`` section of its ``report.json`` are recorded.

Offline: ``examples/heat_pde/offline.py`` on the same config with
``--total-seconds W``: the same simulations are solved and written to disk,
loaded back, and the same module (same options, seed, batch size and
validation schedule) is trained for whatever is left of W. Both sides thus
get the same wall-clock budget on the same machine, and are validated on the
same held-out simulations (the module's ``validation_samples``).

What a "batch" is differs, and the throughput ratio must be read with it:

- online, one batch is one synchronous optimizer step of the K ranks, each
  on its own ``batch_size`` samples (K x batch_size samples, gradients
  averaged across ranks); the simulations run on the same cores meanwhile;
- offline, one batch is one optimizer step of a single process on
  ``batch_size`` samples.

Online therefore trains on K times more samples per batch; the samples/s of
both sides are printed too. Each side runs ``--repeat`` times, alternately,
and the medians are reported. The environment is passed to both sides as is
(e.g. ``OMP_NUM_THREADS`` sets torch's threads on both). The offline wall
time comes out about 0.5-1 s above W: ``--total-seconds`` cannot cover the
interpreter's start and torch's teardown at exit (the online side pays them
inside W); the extra time only favours the offline side. Ends with one line
per figure (ratio > 1 means online is better on both lines)::

    RESULT online_vs_offline_throughput ratio=<online/offline batch/s> target=1 ...
    RESULT online_vs_offline_validation ratio=<offline/online final val loss> target=1 ...

    python bench/online_vs_offline.py [--config examples/heat_pde/config.json] [--ranks 2] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "heat_pde"


def portable_config(config_path: Path, folder: Path, simulations: int | None) -> Path:
    """Copy the config into ``folder`` with every file it names made absolute.

    Simulations run from the config's folder and ``training.module`` is
    relative to it, so a plain copy elsewhere would find neither.
    """
    data = json.loads(config_path.read_text())
    base = config_path.resolve().parent
    data["output_dir"] = str(folder / "online")
    data["launcher"]["command"] = [
        str(base / arg) if arg.endswith(".py") and (base / arg).is_file() else arg
        for arg in data["launcher"]["command"]
    ]
    if data.get("training") and "module" in data["training"]:
        data["training"]["module"] = str(base / data["training"]["module"])
    if simulations is not None:
        data["study"]["simulations"] = simulations
    path = folder / "config.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def environment() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def run_online(config: Path, ranks: int, folder: Path, timeout: float) -> dict[str, Any]:
    """One online study; its wall time and the training section of its report."""
    mpirun = Path(sys.executable).parent / "mpirun"
    command = [str(mpirun) if mpirun.exists() else "mpirun", "-n", str(ranks),
               sys.executable, "-m", "melissa_dl", "--fresh", str(config)]  # each repetition from scratch
    report_path = folder / "online" / "report.json"
    report_path.unlink(missing_ok=True)
    start = time.monotonic()
    done = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - start
    if done.returncode != 0 or not report_path.exists():
        raise RuntimeError(f"online study exited {done.returncode}:\n{done.stderr[-3000:]}")
    report = json.loads(report_path.read_text())
    training = report.get("training")
    if not training:
        raise RuntimeError(f"{report_path} has no 'training' section: is training configured?")
    return {"wall_s": wall, "training": training, "samples_received": report.get("samples", {})}


def run_offline(config: Path, seconds: float, folder: Path, threads: int | None, timeout: float) -> dict[str, Any]:
    """One offline study given ``seconds`` of wall time, imports included."""
    report_path = folder / "offline.json"
    command = [sys.executable, str(EXAMPLE / "offline.py"), "--config", str(config),
               "--total-seconds", f"{seconds:.3f}", "--output", str(folder / "offline"),
               "--report", str(report_path), "--quiet"]
    if threads is not None:
        command += ["--threads", str(threads)]
    start = time.monotonic()
    done = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - start
    if done.returncode != 0:
        raise RuntimeError(f"offline study exited {done.returncode}:\n{done.stderr[-3000:]}")
    report = json.loads(report_path.read_text())
    shutil.rmtree(folder / "offline", ignore_errors=True)  # the simulation files
    return {"wall_s": wall, **report}


def median(values: list[float]) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(values) if values else math.nan


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=EXAMPLE / "config.json")
    parser.add_argument("--ranks", type=int, default=2, help="K, server ranks of the online study")
    parser.add_argument("--simulations", type=int, help="override study.simulations")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each side; medians are reported")
    parser.add_argument("--offline-threads", type=int, help="torch threads of the offline process (offline.py's default otherwise)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before a run is abandoned")
    args = parser.parse_args()

    online_runs: list[dict[str, Any]] = []
    offline_runs: list[dict[str, Any]] = []
    batch_size = None
    with tempfile.TemporaryDirectory(prefix="melissa_online_vs_offline_") as tmp:
        folder = Path(tmp)
        config = portable_config(args.config, folder, args.simulations)
        batch_size = (json.loads(config.read_text()).get("training") or {}).get("batch_size", 32)
        try:
            for i in range(args.repeat):
                online = run_online(config, args.ranks, folder, args.timeout)
                t = online["training"]
                print(f"online  run {i}: wall {online['wall_s']:.1f} s, training {t['duration_s']:.1f} s, "
                      f"{t['batches']} batches ({t['batches_per_s']:.1f} batch/s, {t['samples_trained']} samples), "
                      f"validation {t['first_validation_loss']} -> {t['last_validation_loss']}", flush=True)
                offline = run_offline(config, online["wall_s"], folder, args.offline_threads, args.timeout)
                o = offline["training"]
                print(f"offline run {i}: wall {offline['wall_s']:.1f} s (generation {offline['generation_s']:.2f} s, "
                      f"load {offline['load_s']:.2f} s, training {o['duration_s']:.1f} s), {o['batches']} batches "
                      f"({o['batches_per_s']:.1f} batch/s, {o['samples_trained']} samples), "
                      f"validation {o['first_validation_loss']} -> {o['last_validation_loss']}", flush=True)
                online_runs.append(online)
                offline_runs.append(offline)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"run failed: {exc}", file=sys.stderr, flush=True)

    def side(runs: list[dict[str, Any]], key: str) -> float:
        return median([r["training"][key] for r in runs])

    on_rate, off_rate = side(online_runs, "batches_per_s"), side(offline_runs, "batches_per_s")
    on_loss, off_loss = side(online_runs, "last_validation_loss"), side(offline_runs, "last_validation_loss")
    on_samples = median([r["training"]["samples_trained"] / r["training"]["duration_s"] for r in online_runs
                         if r["training"]["duration_s"] > 0])
    off_samples = median([r["training"]["samples_trained"] / r["training"]["duration_s"] for r in offline_runs
                          if r["training"]["duration_s"] > 0])
    print(f"\nmedians over {len(online_runs)} run(s); online: K={args.ranks} ranks x batch {batch_size} per batch, "
          f"offline: 1 process x batch {batch_size} per batch")
    print(f"  throughput: online {on_rate:.1f} batch/s ({on_samples:.0f} samples/s), "
          f"offline {off_rate:.1f} batch/s ({off_samples:.0f} samples/s)")
    print(f"  final validation loss: online {on_loss:.4g}, offline {off_loss:.4g}")
    throughput = on_rate / off_rate if off_rate > 0 else math.nan
    validation = off_loss / on_loss if on_loss > 0 else math.nan
    print(f"RESULT online_vs_offline_throughput ratio={throughput:.3f} target=1 "
          f"online={on_rate:.1f}batch/s offline={off_rate:.1f}batch/s")
    print(f"RESULT online_vs_offline_validation ratio={validation:.3f} target=1 "
          f"online={on_loss:.4g} offline={off_loss:.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
