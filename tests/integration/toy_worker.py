"""A persistent worker for the integration tests (``launcher.persistent``): one process, many simulations.

It prints ``worker PID`` once at its start, then streams each simulation the
study hands it as ``toy_sim`` does (step t of simulation s: ``s * 1000 + t``),
and says when the study is over.
``--crash-simulation S`` makes the worker die at step 3 of simulation S's
first attempt; ``--mpi`` runs it on ``MPI.COMM_WORLD``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from melissa_dl.wire.client import Client


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--setup", type=float, default=0.0, help="seconds the worker's start costs")
    parser.add_argument("--solve", type=float, default=0.0, help="seconds each simulation costs")
    parser.add_argument("--crash-simulation", type=int, default=-1)
    parser.add_argument("--mpi", action="store_true")
    args = parser.parse_args()
    comm = None
    if args.mpi:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    rank = comm.Get_rank() if comm is not None else 0
    os.write(1, f"worker {os.getpid()}\n".encode())  # one write: MPI ranks share the log, a line must not split
    time.sleep(args.setup)
    for client in Client.simulations({"field": ("float32", (4, 8))}, comm=comm):
        print(f"simulation {client.simulation_id} attempt {client.attempt}", flush=True)
        for t in range(args.steps):
            if client.simulation_id == args.crash_simulation and client.attempt == 0 and t == 3:
                print("toy_worker: crashing on purpose at step 3", file=sys.stderr, flush=True)
                os._exit(1)
            time.sleep(args.solve / args.steps)
            client.send("field", t, np.full((4, 8), client.simulation_id * 1000 + t + rank * 0.5, dtype=np.float32))
    print("toy_worker: the study is over", flush=True)


if __name__ == "__main__":
    main()
