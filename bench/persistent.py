"""Persistent workers against one process per simulation, on a code whose start is costly (issue 35).

The same study twice, under ``mpirun -n 1 melissa-server`` without
training: ``--simulations`` simulations of ``bench/costly_start.py``, whose
start costs ``--setup`` seconds and whose solve ``--solve`` seconds,
``--job-limit`` at once; first one process per simulation, then
``launcher.persistent`` (``--job-limit`` workers, each paying the start
once). Prints ``RESULT persistent_speedup``: the first study's wall time over
the second's (target >= 4; the ideal, ``(setup + solve) * simulations /
job_limit`` over ``setup + solve * simulations / job_limit``, is 6.8 at the
defaults, less the server's own start, paid by both).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from studies import ROOT, environment, mpirun  # bench/ is the script's folder


def study(folder: Path, args: argparse.Namespace, persistent: bool) -> float:
    """Wall seconds of one study, checked complete."""
    config = {
        "output_dir": str(folder / "output"),
        "study": {
            "fields": ["u"],
            "parameters": [{"name": "a", "low": 0.0, "high": 1.0}],
            "simulations": args.simulations,
            "time_steps": 5,
        },
        "buffer": {"kind": "fifo", "capacity_samples": 1000},
        "launcher": {
            "command": [sys.executable, str(ROOT / "bench" / "costly_start.py"), "--setup", str(args.setup)]
            + ["--solve", str(args.solve)],
            "job_limit": args.job_limit,
            "persistent": persistent,
        },
    }
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    start = time.monotonic()
    done = subprocess.run(
        [mpirun(), "-n", "1", sys.executable, "-m", "melissa_dl", str(path)],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=3600,
    )
    wall = time.monotonic() - start
    report = json.loads((folder / "output" / "report.json").read_text()) if done.returncode == 0 else None
    if report is None or report["simulations"]["done"] != args.simulations:
        sys.exit(
            f"bench/persistent.py: the {'persistent' if persistent else 'per-process'} study failed:\n"
            + done.stdout
            + done.stderr
        )
    return wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--simulations", type=int, default=64)
    parser.add_argument("--job-limit", type=int, default=4)
    parser.add_argument("--setup", type=float, default=5.0, help="seconds a simulation's process start costs")
    parser.add_argument("--solve", type=float, default=0.5, help="seconds a simulation's solve costs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as per_process, tempfile.TemporaryDirectory() as persistent:
        each = study(Path(per_process), args, persistent=False)
        workers = study(Path(persistent), args, persistent=True)
    print(
        f"RESULT persistent_speedup ratio={each / workers:.3f} target=4 per_process_s={each:.1f} "
        f"persistent_s={workers:.1f} simulations={args.simulations} job_limit={args.job_limit} "
        f"setup_s={args.setup:g} solve_s={args.solve:g}"
    )


if __name__ == "__main__":
    main()
