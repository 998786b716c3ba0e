"""``melissa-launcher config.json``: start the server under mpirun.

It runs ``mpirun -n K melissa-server config.json`` with the mpirun of the
server's own environment and returns the server's exit code, so a batch script
needs one command. (Restarting a dead server from its checkpoints comes with
checkpoints.)
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="melissa-launcher", description=__doc__.splitlines()[0])
    parser.add_argument("config", help="the study's JSON configuration")
    parser.add_argument("-n", "--ranks", type=int, default=1, help="server ranks (default 1)")
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error("--ranks must be at least 1")
    bindir = os.path.dirname(sys.executable)
    mpirun = os.path.join(bindir, "mpirun")
    command = [mpirun if os.path.exists(mpirun) else "mpirun", "-n", str(args.ranks),
               sys.executable, "-m", "melissa_dl.server", args.config]
    return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
