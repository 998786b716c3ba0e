"""A heat simulation that asks the model the study trains, and records what it was answered (``--record DIR``).

Every simulation asks once before its first step (the first one launched is answered that no model exists) and
after every odd step, and records which server it asked (``MELISSA_SERVER``: a restarted server's is another).
Simulation 0 then, its steps sent, asks until a model answers; asks with a deadline shorter than the server's
``serving.max_wait`` (no answer), then again (answered, the late answer dropped); asks with a missing input
(refused here); and sends one request of a wrong shape from a socket of its own (refused by the rank, and
counted).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples" / "heat_pde"))
from solver import HeatSolver  # noqa: E402

from melissa_dl import Client, ClientError  # noqa: E402
from melissa_dl.wire.predictions import pack, unpack  # noqa: E402
from melissa_dl.wire.security import configure_client  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nx", type=int, required=True)
    parser.add_argument("--ny", type=int, required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--record", type=Path, required=True)
    args = parser.parse_args()
    with Client({"temperature": ("float32", (args.nx, args.ny))}) as client:
        question = {
            "parameters": client.parameters[None].astype(np.float32),
            "time_step": np.array([args.steps - 1], np.float32),
        }
        first = client.predict(question)
        record: dict = {"first": [first.status, first.version], "during": [], "server": os.environ["MELISSA_SERVER"]}
        solver = HeatSolver(client.parameters, args.nx, args.ny)
        for t in range(args.steps):
            client.send("temperature", t, solver.step())
            if t % 2:
                record["during"].append(client.predict(question).status)
        if client.simulation_id == 0:
            record.update(insist(client, question, args))
    (args.record / f"sim{client.simulation_id}.json").write_text(json.dumps(record))


def insist(client: Client, question: dict, args: argparse.Namespace) -> dict:
    while not (answer := client.predict(question)):
        time.sleep(0.05)  # no model yet: the other simulations' steps will make one
    field = answer.outputs["temperature"]
    late = client.predict(question, deadline=0.001)
    again = client.predict(question)
    try:
        client.predict({"parameters": question["parameters"]})
        refused = None
    except ClientError as error:
        refused = str(error)
    return {
        "answered": [answer.status, answer.version, list(field.shape), bool(np.isfinite(field).all())],
        "late": late.status,
        "again": [again.status, again.version],
        "refused_here": refused,
        "refused_there": wrong_shape(client),
    }


def wrong_shape(client: Client) -> dict:
    """A request the client would refuse, sent from a socket of our own with the study's credentials."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    configure_client(socket)
    socket.connect(client._predictor.endpoints[0])  # type: ignore[union-attr]
    socket.send(pack({"id": 1}, {"parameters": np.zeros((1, 4), np.float32), "time_step": np.zeros(1, np.float32)}))
    header, _ = unpack(socket.recv(), "answer")
    socket.close(linger=0)
    context.term()
    return header


if __name__ == "__main__":
    main()
