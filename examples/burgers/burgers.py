"""Burgers simulation instrumented with the melissa_dl client.

The launcher sets the parameters (``c`` and ``nu``, read by name) and the
server's endpoint in the environment; the amplitude ``a`` of the initial wave
is ``--amplitude``. This script solves the equation and sends ``u`` after
every step.
"""

from __future__ import annotations

import argparse

import numpy as np
from solver import BurgersSolver  # solver.py sits next to this script

from melissa_dl import Client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nx", type=int, default=256)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--refine", type=int, default=1, help="solve on a grid this many times finer, send nx cells")
    parser.add_argument("--amplitude", type=float, default=1.0, help="a, the initial wave's amplitude")
    args = parser.parse_args()
    with Client({"u": (np.float32, (args.nx,))}) as client:
        p = client.named_parameters
        solver = BurgersSolver(args.amplitude, p["c"], p["nu"], args.nx, args.steps, refine=args.refine)
        for t in range(args.steps):
            client.send("u", t, solver.step())


if __name__ == "__main__":
    main()
