"""A simulation that first sends every kind of bad handshake and bad frame.

Attempt 0 of simulation 0 plays a broken client and exits with code 3; every
other attempt streams ``--steps`` steps of a (4, 8) float32 field "field"
normally. The test checks that the server refused and counted each kind and
still completed. With ``--fuzz SEED``, attempt 0 of simulation 0 sends seeded
mutants instead (``fuzz.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import zmq
from fuzz import fuzz

from melissa_dl.wire.client import Client
from melissa_dl.wire.protocol import PROTOCOL_VERSION, Header, Kind, Route, encode_json, simulation_key
from melissa_dl.wire.security import configure_client

SHAPE = (4, 8)
GOOD = ["float32", list(SHAPE)]


def secure(socket: zmq.Socket) -> None:
    """Give a raw socket the study's credentials, as the client does."""
    configure_client(socket, os.environ)


def handshake(context: zmq.Context, endpoint: str, request: bytes | list[bytes]) -> dict:
    socket = context.socket(zmq.REQ)
    secure(socket)
    socket.connect(endpoint)
    socket.send_multipart(request if isinstance(request, list) else [request])
    assert socket.poll(10_000), "no handshake answer"
    reply = json.loads(socket.recv())
    socket.close(linger=0)
    return reply


def good_hello(token: str, sim: int) -> dict:
    """The hello of this simulation's first attempt, as a client sends it."""
    return {
        "protocol": PROTOCOL_VERSION,
        "token": token,
        "simulation_id": sim,
        "attempt": 0,
        "client_rank": 0,
        "client_size": 1,
        "fields": {"field": GOOD},
    }


def bad_handshakes(context: zmq.Context, endpoint: str, token: str, sim: int) -> dict:
    """Refusals that a relaunch would not meet again: the simulation is not failed for them."""
    hello = good_hello(token, sim)
    variants = [
        {"protocol": 99},
        {"protocol": "9" * 50_000},  # echoed back cut, not whole
        {"token": "00" * 32},
        {"token": "\ud800"},  # a lone surrogate: no str.encode() may choke on it
        {"simulation_id": 999},
        {"attempt": 1},
    ]
    assert not handshake(context, endpoint, b"not json")["ok"]
    assert not handshake(context, endpoint, [encode_json(hello), b"more"])["ok"]
    for change in variants:
        reply = handshake(context, endpoint, encode_json({**hello, **change}))
        assert not reply["ok"], change
        assert len(reply["error"]) < 400, change
    reply = handshake(context, endpoint, encode_json(hello))
    assert reply["ok"], reply
    return reply


def bad_frames(context: zmq.Context, endpoints: list[str], token: bytes, sim: int, steps: int) -> None:
    key = simulation_key(token, sim, 0)
    size = len(endpoints)
    sockets = []
    for endpoint in endpoints:
        sockets.append(context.socket(zmq.PUSH))
        secure(sockets[-1])
        sockets[-1].connect(endpoint)

    def frame(
        kind: Kind = Kind.DATA,
        step: int = 0,
        field: int = 0,
        dtype: str = "float32",
        shape: tuple[int, ...] = SHAPE,
        payload: bytes | None = None,
        simulation: int = sim,
        frame_key: bytes = key,
    ) -> list[bytes]:
        payload = np.zeros(shape, dtype=dtype).tobytes() if payload is None else payload
        return [Header(kind, frame_key, simulation, 0, step, 0, 1, field, dtype, shape, len(payload)).pack(), payload]

    def send(message: list[bytes], step: int = 0) -> None:
        sockets[Route(size).owner(sim, step)].send_multipart(message)

    declaration = encode_json({"fields": {"field": GOOD}})
    send(frame())  # undeclared: no DECLARE on this connection yet
    send([b"short"])  # malformed
    header, payload = frame()
    send([header[:4] + (99).to_bytes(2, "little") + header[6:], payload])  # version
    send(frame(frame_key=b"x" * 8))  # credentials: an unknown peer
    send(frame(simulation=999))  # unknown_simulation
    send(frame(Kind.DECLARE, payload=b"{not json"))  # malformed
    send(frame(Kind.DECLARE, payload=encode_json({"fields": {"field": ["float32", [1 << 20, 1 << 10]]}})))  # oversize
    send(frame(Kind.DECLARE, payload=declaration))
    send(frame(field=7))  # unknown_field
    send(frame(dtype="float64"))  # dtype
    send(frame(shape=(8, 4)))  # shape
    send(frame(payload=np.full(SHAPE, np.nan, dtype=np.float32).tobytes()))  # non_finite
    send(frame(step=steps), step=steps)  # time_step
    sockets[(Route(size).owner(sim, 0) + 1) % size].send_multipart(frame())  # routing (only with 2+ ranks)
    for socket in sockets:
        socket.close(linger=10_000)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--fuzz", type=int, help="seed: send seeded mutants instead of the scripted bad input")
    parser.add_argument("--fuzz-frames", type=int, default=6000)
    parser.add_argument("--fuzz-hellos", type=int, default=1200)
    args = parser.parse_args()
    sim = int(os.environ["MELISSA_SIMULATION_ID"])
    if sim == 0 and os.environ["MELISSA_ATTEMPT"] == "0":
        context = zmq.Context()
        server, token = os.environ["MELISSA_SERVER"], os.environ["MELISSA_TOKEN"]
        if args.fuzz is None:
            reply = bad_handshakes(context, server, token, sim)
            bad_frames(context, reply["endpoints"], bytes.fromhex(token), sim, args.steps)
        else:
            endpoints = handshake(context, server, encode_json(good_hello(token, sim)))["endpoints"]
            fuzz(
                context,
                secure,
                server,
                endpoints,
                bytes.fromhex(token),
                sim,
                args.steps,
                args.fuzz_frames,
                args.fuzz_hellos,
                args.fuzz,
            )
        context.term()
        sys.exit(3)  # its one hello was spent on the raw frames: the relaunch streams the steps
    with Client({"field": ("float32", SHAPE)}) as client:
        for t in range(args.steps):
            client.send("field", t, np.full(SHAPE, t, dtype=np.float32))


if __name__ == "__main__":
    main()
