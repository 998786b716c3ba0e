"""A simulation whose start costs ``--setup`` seconds (a JIT, a mesh, a CUDA context) and whose solve costs
``--solve``: ``bench/persistent.py``'s. The same code runs one simulation per process or, as a persistent
worker, many (``Client.simulations``)."""

from __future__ import annotations

import argparse
import time

import numpy as np

from melissa_dl.wire.client import Client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--setup", type=float, default=5.0)
    parser.add_argument("--solve", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    time.sleep(args.setup)
    for client in Client.simulations({"u": ("float32", (64,))}):
        for t in range(args.steps):
            time.sleep(args.solve / args.steps)
            client.send("u", t, np.full(64, client.parameters[0] + t, dtype=np.float32))


if __name__ == "__main__":
    main()
