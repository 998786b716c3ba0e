"""Gray–Scott simulation instrumented with the melissa_dl client.

The launcher sets the simulation id, parameters (feed, kill, seed) and the
server's endpoint in the environment; this script solves the equations and
sends both fields, ``u`` and ``v`` (float32 ``n x n``), after every step.
``--output FILE --parameters F K SEED`` runs it the classic way instead: the
steps go to one ``.npy`` file (``[steps, 2, n, n]``, ``u`` then ``v``), as
an offline data set is generated (``bench/online_vs_offline_rollout.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from solver import FIELDS, GrayScott  # solver.py sits next to this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64, help="grid points per side")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--substeps", type=int, default=20, help="explicit steps per step sent")
    parser.add_argument("--output", type=Path, help="write the steps to this .npy file instead of sending them")
    parser.add_argument("--parameters", type=float, nargs=3, metavar=("FEED", "KILL", "SEED"))
    args = parser.parse_args()
    if args.output is not None:
        if args.parameters is None:
            parser.error("--output needs --parameters")
        feed, kill, seed = args.parameters
        solver = GrayScott(feed, kill, seed, n=args.n, substeps=args.substeps)
        np.save(args.output, solver.solve(args.steps))
        return
    from melissa_dl import Client  # only when streaming: the classic run needs neither ZeroMQ nor the client

    with Client({name: (np.float32, (args.n, args.n)) for name in FIELDS}) as client:
        named = client.named_parameters  # by name: the study may list them in any order
        solver = GrayScott(named["feed"], named["kill"], named["seed"], n=args.n, substeps=args.substeps)
        for t in range(args.steps):
            for name, field in zip(FIELDS, solver.step()):
                client.send(name, t, field)


if __name__ == "__main__":
    main()
