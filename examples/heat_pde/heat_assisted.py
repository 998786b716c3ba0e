"""The heat simulation helped by the surrogate the study trains (``"serving": {"online": true}``, config_assisted.json).

Two runs of the solver side by side: the full one, whose every step is sent (the model learns from the solver
only), and the helped one, whose every other step is the model's prediction instead of a solver step, once the
model answering has been trained for ``--threshold`` batches; until then, and whenever no answer comes within the
deadline, the helped run steps its own solver. At the end it prints how many steps were the model's and how far
the helped field drifted from the full one (relative L2 error), and with ``--report DIR`` writes them with the
drift of every step to ``DIR/assisted-<simulation>.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from solver import HeatSolver  # solver.py sits next to this script

from melissa_dl import Client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nx", type=int, default=32)
    parser.add_argument("--ny", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--threshold", type=int, default=200, help="batches the model must be trained to")
    parser.add_argument("--deadline", type=float, help="seconds to wait for an answer (default: serving.deadline)")
    parser.add_argument("--report", type=Path, help="folder of the JSON reports")
    args = parser.parse_args()
    with Client({"temperature": (np.float32, (args.nx, args.ny))}) as client:
        full = HeatSolver(client.parameters, args.nx, args.ny)
        helped = HeatSolver(client.parameters, args.nx, args.ny)
        parameters = client.parameters[None].astype(np.float32)  # one question: [1, 5]
        replaced, drift = [], []
        for t in range(args.steps):
            truth = full.step()
            client.send("temperature", t, truth)
            field = None
            if t % 2:  # every other step: the model's, if it is trained enough and answers in time
                question = {"parameters": parameters, "time_step": np.array([t], np.float32)}
                answer = client.predict(question, deadline=args.deadline)
                if answer and answer.version >= args.threshold:
                    field = answer.outputs["temperature"][0]
                    helped.resume_from(field)
                    replaced.append(t)
            if field is None:
                field = helped.step()
            drift.append(float(np.linalg.norm(field - truth) / np.linalg.norm(truth)))
    print(
        f"simulation {client.simulation_id}: {len(replaced)} of {args.steps} steps were the model's "
        f"(trained to {args.threshold} batches at least); drift from the full solver {drift[-1]:.2e} at the end, "
        f"{max(drift):.2e} at most"
    )
    if args.report is not None:
        report = {"simulation": client.simulation_id, "replaced": replaced, "drift": drift}
        (args.report / f"assisted-{client.simulation_id}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
