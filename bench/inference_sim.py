"""A simulation of bench/inference.py: sends its heat steps, waits for a model, then asks it as the bench says.

Its steps sent and a model answering, it creates ``CONTROL/ready-<id>``. Simulation 0 then waits for
``CONTROL/go-latency``, asks ``--asks`` questions one after the other and writes their round-trip times to
``CONTROL/latency.json``; the others wait for ``CONTROL/go-throughput``, ask in a closed loop until
``CONTROL/stop`` appears, and write how many were answered to ``CONTROL/throughput-<id>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "heat_pde"))
from solver import HeatSolver  # noqa: E402

from melissa_dl import Client  # noqa: E402

POLL = 0.05  # seconds between two looks at a control file (65 processes look)
WARM_UP = 50  # questions asked before the timed ones


def wait_for(path: Path) -> None:
    while not path.exists():
        time.sleep(POLL)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nx", type=int, required=True)
    parser.add_argument("--ny", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--asks", type=int, required=True)
    parser.add_argument("--control", type=Path, required=True)
    args = parser.parse_args()
    control = args.control
    with Client({"temperature": ("float32", (args.nx, args.ny))}) as client:
        solver = HeatSolver(client.parameters, args.nx, args.ny)
        for t in range(args.steps):
            client.send("temperature", t, solver.step())
        question = {"parameters": client.parameters[None].astype(np.float32), "time_step": np.ones(1, np.float32)}
        while not client.predict(question, deadline=60):
            time.sleep(POLL)  # no model yet
        sid = client.simulation_id
        (control / f"ready-{sid}").touch()
        if sid == 0:
            wait_for(control / "go-latency")
            for _ in range(WARM_UP):
                client.predict(question, deadline=60)
            times = []
            for _ in range(args.asks):
                start = time.perf_counter()
                assert client.predict(question, deadline=60)
                times.append(time.perf_counter() - start)
            (control / "latency.json").write_text(json.dumps(times))
        else:
            wait_for(control / "go-throughput")
            stop, answered = control / "stop", 0
            while not stop.exists():
                answered += bool(client.predict(question, deadline=60))
            (control / f"throughput-{sid}.json").write_text(json.dumps(answered))


if __name__ == "__main__":
    main()
