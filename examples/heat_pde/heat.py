"""Heat-equation simulation instrumented with the melissa_dl client.

The launcher sets the simulation id, parameters and server endpoint in the
environment; this script solves the PDE and sends the field after every step.
Run with ``--mpi`` under mpirun for a domain-decomposed client (each rank
sends its own rows). ``--crash-at``/``--crash-simulation`` make one
simulation die on its first attempt, so tests can exercise restarts.
``--output FILE --parameters P...`` runs it the classic way instead: the
steps go to one ``.npy`` file (``[steps, nx, ny]``), which is how
``offline.py`` generates its data set.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
from solver import DEFAULT_DT, HeatSolver, local_shape  # solver.py sits next to this script


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nx", type=int, default=32)
    parser.add_argument("--ny", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--dt", type=float, default=DEFAULT_DT)
    parser.add_argument("--refine", type=int, default=1, help="solve on a grid this many times finer, send nx x ny")
    parser.add_argument("--mpi", action="store_true", help="decompose over COMM_WORLD")
    parser.add_argument("--crash-at", type=int, metavar="STEP", help="exit 1 before sending STEP")
    parser.add_argument("--crash-simulation", type=int, metavar="SID", help="the one that crashes")
    parser.add_argument("--output", type=Path, help="write the steps to this .npy file instead of sending them")
    parser.add_argument("--parameters", type=float, nargs="+", help="with --output: the parameter set")
    args = parser.parse_args()
    if args.output is not None:
        if not args.parameters:
            parser.error("--output needs --parameters")
        solver = HeatSolver(np.array(args.parameters), args.nx, args.ny, args.dt, refine=args.refine)
        np.save(args.output, np.stack([solver.step() for _ in range(args.steps)]))
        return
    from melissa_dl import Client  # only when streaming: the classic run needs neither ZeroMQ nor the client

    comm = None
    if args.mpi:
        from mpi4py import MPI  # imported only when asked: plain runs need no MPI

        comm = MPI.COMM_WORLD
    # Each rank declares and sends its own block of rows; the server stacks them.
    fields = {"temperature": (np.float32, local_shape(args.nx, args.ny, comm))}
    with Client(fields, comm=comm) as client:
        solver = HeatSolver(client.parameters, args.nx, args.ny, args.dt, comm=comm, refine=args.refine)
        crash = client.simulation_id == args.crash_simulation and client.attempt == 0
        for t in range(args.steps):
            if crash and t == args.crash_at:
                os._exit(1)  # a hard crash: no finalize, no cleanup
            client.send("temperature", t, solver.step())


if __name__ == "__main__":
    main()
