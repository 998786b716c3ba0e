"""Starting one simulation from a server holding a large table: ``setpriv`` (vfork) against a preexec_fn (fork).

Rank 0 starts simulations in the bookkeeping round while every rank waits in
it (issue 14). A preexec_fn forces a full fork, whose cost grows with the
server's memory; ``launcher.schedulers._spawn`` instead lets ``setpriv`` set
the death signal after a vfork. Both start ``true`` in a new session, from
this process holding ``--gib`` GiB of touched memory, median of ``--runs``.
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from launcher.schedulers import _setpriv, die_with_parent  # noqa: E402


def start_time(argv: list[str], runs: int, **options: object) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        process = subprocess.Popen(argv, start_new_session=True, **options)  # type: ignore[call-overload]
        times.append(time.perf_counter() - start)
        process.wait()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=2.0, help="memory the starting process holds")
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    setpriv = _setpriv()
    if setpriv is None:
        sys.exit("bench/spawn.py: no setpriv with --pdeathsig here: the server falls back to the preexec_fn")
    held = torch.ones(int(args.gib * (1 << 28)))  # float32: 4 bytes each, every page touched
    fork = start_time(["true"], args.runs, preexec_fn=die_with_parent(signal.SIGTERM))
    vfork = start_time([setpriv, "--pdeathsig=TERM", "--", "true"], args.runs)
    print(
        f"RESULT spawn ratio={fork / vfork:.1f} preexec_fn_ms={fork * 1e3:.2f} setpriv_ms={vfork * 1e3:.2f} "
        f"held_gib={held.numel() * 4 / (1 << 30):.1f}"
    )


if __name__ == "__main__":
    main()
