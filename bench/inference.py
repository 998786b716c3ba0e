"""Predictions while the model trains (``serving.online``): latency, throughput and what serving costs training.

One study of the heat example's surrogate (32 x 32 field, 3 hidden layers of 256) on 2 server ranks, trained on
what ``--clients`` + 1 simulations (``bench/inference_sim.py``) sent, served online; the simulations stay open,
so the ranks keep training on their reservoirs, while the bench measures, in turn:

1. training alone: batches per second over ``--window`` seconds (``status.json``'s count);
2. the baselines, in this process while the ranks train: a raw pyzmq REQ/REP round trip of the same bytes as a
   request and its answer (to an echo process), and an in-process forward of the same model, one question
   (``--asks`` of each, on one torch thread as each rank has); and in-process forwards of ``--clients``
   questions at once for ``--window`` seconds;
3. one client's latency: simulation 0 asks ``--asks`` questions one after the other;
4. ``--clients`` clients at once, each asking one question at a time in a closed loop, for ``--window`` seconds,
   while training's batches per second are counted again.

RESULT ``inference_latency_p50`` and ``_p99``: the client's round trip against the raw round trip plus the
forward at the same percentile (targets <= 1.5 and <= 2); ``inference_throughput``: answers per second of the
clients against the batched forwards' questions per second (>= 0.7); ``inference_training_cost``: training's
batches per second while serving against alone (>= 0.85). One run is one repetition.

    python bench/inference.py [--clients 64] [--asks 1000] [--window 10]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zmq

ROOT = Path(__file__).resolve().parents[1]
HEAT = ROOT / "examples" / "heat_pde"
sys.path.insert(0, str(HEAT))
from surrogate import HeatSurrogate  # noqa: E402

from melissa_dl.wire.predictions import pack  # noqa: E402

NX = NY = 32
STEPS = 10
OPTIONS = {"hidden": 256, "depth": 3, "lr": 2e-3, "nx": NX, "ny": NY, "steps": 100, "validation_simulations": 0}
ECHO = """
import sys, zmq
socket = zmq.Context().socket(zmq.REP)
port = socket.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
answer = bytes(int(sys.argv[1]))
while socket.recv() != b"stop":
    socket.send(answer)
socket.send(b"")
"""


def config(output: Path, control: Path, clients: int, asks: int) -> dict:
    simulations = clients + 1
    command = [
        sys.executable, str(ROOT / "bench" / "inference_sim.py"), "--nx", str(NX), "--ny", str(NY),
        "--steps", str(STEPS), "--asks", str(asks), "--control", str(control),
    ]  # fmt: skip
    bounds = [{"name": f"p{i}", "low": 100.0, "high": 500.0} for i in range(5)]
    return {
        "output_dir": str(output),
        "plots": False,
        "study": {"fields": ["temperature"], "parameters": bounds, "simulations": simulations, "time_steps": STEPS},
        "server": {"status_interval": 0.5},
        "buffer": {"kind": "reservoir", "capacity_samples": 1000, "per_server_watermark": 32},
        "launcher": {"command": command, "job_limit": simulations, "client_timeout": 600},
        "training": {
            "module": str(HEAT / "surrogate.py"),
            "class_name": "HeatSurrogate",
            "options": OPTIONS,
            "batch_size": 32,
            "nb_batches_update": 10**9,
            "device": "cpu",
        },
        "checkpoint": {"interval": 0},
        "serving": {"online": True},
    }


def batches(output: Path) -> tuple[float, int]:
    """When rank 0 last wrote its status, and the batches trained then."""
    status = json.loads((output / "status.json").read_text())
    return status["updated"], status["training"]["batches"]


def training_rate(output: Path, window: float) -> float:
    """Batches per second over ``window`` seconds, between two status updates."""
    then, before = batches(output)
    time.sleep(window)
    now, after = batches(output)
    return (after - before) / (now - then)


def percentiles(seconds: list[float]) -> tuple[float, float]:
    return float(np.percentile(seconds, 50)), float(np.percentile(seconds, 99))


def round_trips(request: bytes, answer_bytes: int, asks: int) -> list[float]:
    """Raw REQ/REP round trips of ``request`` and an answer of ``answer_bytes`` bytes, to an echo process."""
    echo = subprocess.Popen([sys.executable, "-c", ECHO, str(answer_bytes)], stdout=subprocess.PIPE, text=True)
    assert echo.stdout is not None
    context = zmq.Context()
    socket = context.socket(zmq.REQ)
    socket.connect(f"tcp://127.0.0.1:{echo.stdout.readline().strip()}")
    times = []
    for i in range(asks + 50):  # 50 to warm up
        start = time.perf_counter()
        socket.send(request)
        socket.recv()
        if i >= 50:
            times.append(time.perf_counter() - start)
    socket.send(b"stop")
    socket.recv()
    echo.wait(timeout=30)
    context.destroy(linger=0)
    return times


@torch.no_grad()
def forwards(model: HeatSurrogate, questions: int, asks: int = 0, window: float = 0.0) -> list[float]:
    """Times of ``model.predict`` of ``questions`` at once: ``asks`` of them, or as many as ``window`` seconds
    hold."""
    inputs = {"parameters": torch.full((questions, 5), 300.0), "time_step": torch.ones(questions)}
    for _ in range(20):
        model.predict(inputs)
    times: list[float] = []
    end = time.perf_counter() + window
    while len(times) < asks or time.perf_counter() < end:
        start = time.perf_counter()
        model.predict(inputs)
        times.append(time.perf_counter() - start)
    return times


def wait_for(condition: object, server: subprocess.Popen, what: str, timeout: float = 900) -> None:
    end = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if server.poll() is not None:
            raise SystemExit(f"inference: the server exited ({server.returncode}) while waiting for {what}")
        if time.monotonic() > end:
            raise SystemExit(f"inference: no {what} within {timeout:g} s")
        time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--asks", type=int, default=1000)
    parser.add_argument("--window", type=float, default=10.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="inference-"))
    output, control = folder / "output", folder / "control"
    control.mkdir()
    (folder / "config.json").write_text(json.dumps(config(output, control, args.clients, args.asks)))
    mpirun, server = Path(sys.executable).parent / "mpirun", Path(sys.executable).parent / "melissa-server"
    log = (folder / "server.log").open("w")
    study = subprocess.Popen([str(mpirun), "-n", "2", str(server), str(folder / "config.json")], stdout=log, stderr=log)
    ready = lambda: len(list(control.glob("ready-*"))) == args.clients + 1  # noqa: E731
    wait_for(ready, study, "simulation ready with a model")

    alone = training_rate(output, args.window)
    model = HeatSurrogate(**OPTIONS).eval()
    question = {"parameters": np.full((1, 5), 300.0, np.float32), "time_step": np.ones(1, np.float32)}
    answer = {"temperature": np.zeros((1, NX, NY), np.float32)}
    raw = round_trips(
        pack({"id": 1}, question), len(pack({"id": 1, "status": "answered", "version": 10**6}, answer)), args.asks
    )
    single = forwards(model, 1, asks=args.asks)
    batched = forwards(model, args.clients, window=args.window)

    (control / "go-latency").touch()
    wait_for(lambda: (control / "latency.json").exists(), study, "the latency of one client")
    latency = json.loads((control / "latency.json").read_text())

    started = time.perf_counter()
    (control / "go-throughput").touch()
    serving = training_rate(output, args.window)
    (control / "stop").touch()
    stopped = time.perf_counter()
    done = lambda: len(list(control.glob("throughput-*"))) == args.clients  # noqa: E731
    wait_for(done, study, "the clients' counts")
    answered = sum(json.loads(path.read_text()) for path in control.glob("throughput-*"))
    code = study.wait(timeout=600)
    log.close()
    if code != 0:
        raise SystemExit(f"inference: the server exited with {code}: {folder / 'server.log'}")

    ours, base = percentiles(latency), [a + b for a, b in zip(percentiles(raw), percentiles(single))]
    for name, mine, theirs, target in zip(("p50", "p99"), ours, base, (1.5, 2.0)):
        print(
            f"RESULT inference_latency_{name} ratio={mine / theirs:.3f} target={target} "
            f"client_ms={mine * 1e3:.3f} raw_round_trip_plus_forward_ms={theirs * 1e3:.3f}"
        )
    rate, in_process = answered / (stopped - started), args.clients * len(batched) / sum(batched)
    print(
        f"RESULT inference_throughput ratio={rate / in_process:.3f} target=0.7 "
        f"clients_per_s={rate:.0f} in_process_per_s={in_process:.0f} clients_at_once={args.clients}"
    )
    print(
        f"RESULT inference_training_cost ratio={serving / alone:.3f} target=0.85 "
        f"batches_per_s_serving={serving:.2f} alone={alone:.2f}"
    )
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
