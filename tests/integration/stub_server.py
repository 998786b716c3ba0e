"""A one-rank server in a process of its own, for tests that freeze or kill it under a blocked client.

A receiver and a handshake service expecting attempt 0 of simulation 1 of a
study with the float32 field "field". Prints one JSON line, the client's
environment; then keeps its buffer (``--capacity`` samples) undrained for
``--hold`` seconds, so that clients block, and drains it afterwards. When its
stdin closes it prints a JSON line ``{"steps": [...], "announced": n}`` (the
steps drained and what the client's finalize announced) and exits 0.

    python stub_server.py [--timeout 1] [--capacity 2] [--hold 3.5] [--security token|curve]
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import threading
import time

import numpy as np

from melissa_dl.buffers.kinds import make_buffer
from melissa_dl.ingest.assembly import StreamSpec
from melissa_dl.ingest.handshake import HandshakeServer
from melissa_dl.ingest.receiver import Receiver
from melissa_dl.wire.security import Security

MIB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=1.0, help="the clients' client_timeout")
    parser.add_argument("--capacity", type=int, default=2)
    parser.add_argument("--hold", type=float, default=1e9, help="seconds before the buffer is drained")
    parser.add_argument("--security", default="token")
    args = parser.parse_args()
    token = secrets.token_bytes(32)
    security = Security.generate(args.security, token, args.timeout)
    spec = StreamSpec(["field"], np.zeros((4, 1)), token, server_rank=0, server_size=1, max_message_bytes=MIB)
    buffer = make_buffer("fifo", capacity_samples=args.capacity, capacity_bytes=None, watermark=1, seed=0)
    receiver = Receiver(spec, buffer, "127.0.0.1", receive_queue_bytes=2 * MIB, security=security)
    receiver.start_and_bind()
    handshake = HandshakeServer(
        token=token,
        fields=["field"],
        simulations=4,
        endpoints=[receiver.endpoints("127.0.0.1")],
        bind_simulation=False,
        max_message_bytes=MIB,
        bind_address="127.0.0.1",
        security=security,
    )
    environ = {
        "MELISSA_SERVER": f"tcp://127.0.0.1:{handshake.start_and_bind()}",
        "MELISSA_TOKEN": token.hex(),
        "MELISSA_SIMULATION_ID": "1",
        "MELISSA_ATTEMPT": "0",
        "MELISSA_PARAMETERS": "[0.0]",
        "MELISSA_CLIENT_TIMEOUT": str(args.timeout),
        "MELISSA_SEND_QUEUE_BYTES": str(2 * MIB),
        **security.client_environment(),
    }
    handshake.expect(1, 0)
    print(json.dumps(environ), flush=True)
    steps: list[int] = []
    closed = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), closed.set()), daemon=True).start()
    start = time.monotonic()
    while not closed.is_set():
        if time.monotonic() - start < args.hold:
            time.sleep(0.05)
            continue
        steps += [sample.time_step for sample in buffer.get_batch(1, timeout=0.05) or []]
    while args.hold < 1e9 and (batch := buffer.get_batch(1, timeout=0.5)):  # what came in meanwhile
        steps += [sample.time_step for sample in batch]
    progress = receiver.report().progress.get(1)
    receiver.stop()
    handshake.stop()
    print(json.dumps({"steps": steps, "announced": None if progress is None else progress.expected}), flush=True)


if __name__ == "__main__":
    main()
