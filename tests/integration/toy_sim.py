"""A simulation for the integration tests: deterministic fields, scripted failures.

Step t of simulation s sends the field ``s * 1000 + t`` (so a test can check
what the server assembled). ``--fail`` makes simulation ``--fail-simulation``
misbehave on its first ``--fail-attempts`` attempts, at step ``--fail-at``:
``crash`` exits 1, ``hang`` sleeps forever, ``no-finalize`` exits 0 without
announcing its steps, ``client-error`` sends a field it did not declare (a
``ClientError``, uncaught). ``--step-delay`` paces the steps, so that a test can
interrupt the server in the middle of a study, and ``--go FILE`` holds the
first step until FILE exists (of every simulation but ``--go-now``; ``{simulation}``
in FILE stands for the simulation's id, so that each may have a file of its own). Simulation ``--odd-simulation``
declares and sends ``--odd-dtype`` and ``--odd-shape`` instead; ``--skip-simulation`` never sends its step
``--skip-step``. ``--argv SIMULATION ATTEMPT PARAMETERS...``
(from ``launcher.command`` placeholders) must say what the environment says, and the simulation prints
``slot TOY_SLOT``.
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
    parser.add_argument("--shape", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--mpi", action="store_true")
    parser.add_argument("--fail", choices=["crash", "hang", "no-finalize", "client-error"])
    parser.add_argument("--fail-simulation", type=int, default=-1)
    parser.add_argument("--fail-attempts", type=int, default=1)
    parser.add_argument("--fail-at", type=int, default=3)
    parser.add_argument("--step-delay", type=float, default=0.0)
    parser.add_argument("--odd-simulation", type=int, default=-1)
    parser.add_argument("--odd-dtype", default="float32")
    parser.add_argument("--odd-shape", type=int, nargs="+")
    parser.add_argument("--nan-at", type=int, default=-1, help="send NaN values from this step on")
    parser.add_argument("--skip-simulation", type=int, default=-1, help="a simulation that skips --skip-step")
    parser.add_argument("--skip-step", type=int, default=-1)
    parser.add_argument("--go", help="a file to wait for before the first step")
    parser.add_argument("--go-now", type=int, default=-1, help="a simulation that does not wait for --go")
    parser.add_argument("--argv", type=float, nargs="+", help="simulation, attempt, parameters: checked")
    args = parser.parse_args()
    comm = None
    if args.mpi:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    dtype, shape = "float32", tuple(args.shape)
    if int(os.environ["MELISSA_SIMULATION_ID"]) == args.odd_simulation:
        dtype, shape = args.odd_dtype, tuple(args.odd_shape or shape)
    client = Client({"field": (dtype, shape)}, comm=comm)
    if args.argv is not None:
        told = [client.simulation_id, client.attempt, *client.parameters.tolist()]
        assert args.argv == told, f"argv {args.argv} but environment {told}"
        print(f"slot {os.environ['TOY_SLOT']}", flush=True)
    failing = client.simulation_id == args.fail_simulation and client.attempt < args.fail_attempts
    rank = comm.Get_rank() if comm is not None else 0
    go = args.go.format(simulation=client.simulation_id) if args.go is not None else None
    while go is not None and client.simulation_id != args.go_now and not os.path.exists(go):
        time.sleep(0.05)
    for t in range(args.steps):
        if failing and t == args.fail_at:
            if args.fail == "crash":
                print(f"toy_sim: crashing on purpose at step {t}", file=sys.stderr, flush=True)
                os._exit(1)
            if args.fail == "hang":
                time.sleep(3600)
            if args.fail == "client-error":
                client.send("undeclared", t, np.zeros(shape, dtype=dtype))
            client.close()
            return
        time.sleep(args.step_delay)
        if client.simulation_id == args.skip_simulation and t == args.skip_step:
            continue
        value = client.simulation_id * 1000 + t + rank * 0.5 if not 0 <= args.nan_at <= t else np.nan
        client.send("field", t, np.full(shape, value, dtype=dtype))
    client.finalize()


if __name__ == "__main__":
    main()
