"""Seeded mutations of data frames and handshakes, sent to a live server by ``bad_client.py --fuzz``.

The fuzzer is attempt 0 of simulation 0 of the study: it holds the study's
credentials, so its mutants reach the server's parsers instead of stopping at
the door. Its hellos claim attempt 1000, so that no mutant can be admitted in
place of a real client (and fail a simulation); its frames are those of
attempt 0, which the relaunch replaces. Besides, it opens idle connections,
half-spoken ZeroMQ greetings and unfinished multipart messages on raw TCP.
It writes what it sent and what the handshakes answered to ``fuzz_tally.json``.
"""

from __future__ import annotations

import json
import random
import socket as tcp
import struct
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from melissa_dl.wire.protocol import PROTOCOL_VERSION, Header, Kind, Route, encode_json, simulation_key

SHAPE = (4, 8)
GOOD = ["float32", list(SHAPE)]
JSON_MUTANTS: list[bytes] = [
    b"[" * 30_000 + b"]" * 30_000,  # deep JSON (far beyond json's recursion limit, within a hello's cap)
    b'{"fields": {"\\ud800": ["float32", [4, 8]]}}',  # a lone surrogate as a field name
    b'{"fields": {"field": ["\\udfff", [4, 8]]}}',
    b'{"fields": {"field": ["float32", [1e308]]}}',
    b'{"fields": {"field": ["float32", [4294967296, 4294967296]]}}',
    b'{"fields": {"field": ["float32", {"0": 4}]}}',
    b'{"steps": 18446744073709551617}',
    b'{"steps": -1}',
    b'{"steps": "\\ud800"}',
    b'"just a string"',
    b"null",
    b"\xff\xfe\x00garbage",
    b'{"fields": ' * 5000,
]


def _flip(rng: random.Random, data: bytes, flips: int) -> bytes:
    mutable = bytearray(data)
    for _ in range(flips):
        if mutable:
            position = rng.randrange(len(mutable))
            mutable[position] ^= 1 << rng.randrange(8)
    return bytes(mutable)


class FrameFuzzer:
    """Valid messages of one client rank, and mutants of them."""

    def __init__(self, rng: random.Random, token: bytes, sim: int, steps: int) -> None:
        self.rng = rng
        self.key = simulation_key(token, sim, 0)
        self.sim = sim
        self.steps = steps

    def header(
        self,
        kind: Kind,
        step: int = 0,
        dtype: str = "float32",
        shape: tuple[int, ...] = SHAPE,
        size: int | None = None,
        **change: Any,
    ) -> bytes:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize if size is None else size
        fields = {
            "kind": kind,
            "key": self.key,
            "simulation_id": self.sim,
            "attempt": 0,
            "time_step": step,
            "client_rank": 0,
            "client_size": 1,
            "field_id": 0,
            "dtype": dtype,
            "shape": shape,
            "payload_bytes": size,
        }
        return Header(**{**fields, **change}).pack()

    def json_message(self, kind: Kind, payload: bytes) -> list[bytes]:
        return [self.header(kind, dtype="uint8", shape=(), size=len(payload)), payload]

    def valid(self) -> list[bytes]:
        """A well-formed message: a declaration, a finalize, or a step (mostly beyond the study's steps)."""
        choice = self.rng.randrange(4)
        if choice == 0:
            return self.json_message(Kind.DECLARE, encode_json({"fields": {"field": GOOD}}))
        if choice == 1:
            return self.json_message(Kind.FINALIZE, encode_json({"steps": self.rng.randrange(100)}))
        step = self.steps + self.rng.randrange(1000) if choice == 2 else self.rng.randrange(self.steps)
        return [self.header(Kind.DATA, step=step), np.full(SHAPE, step, dtype=np.float32).tobytes()]

    def mutant(self) -> list[bytes]:
        rng = self.rng
        message = self.valid()
        mutations: list[Callable[[], list[bytes]]] = [
            lambda: [rng.randbytes(rng.randrange(200)) for _ in range(rng.randint(1, 3))],
            lambda: [m[: rng.randrange(len(m) + 1)] for m in message],  # truncations
            lambda: [_flip(rng, message[0], rng.randint(1, 8)), message[1]],  # bit flips of the header
            lambda: [message[0], _flip(rng, message[1], rng.randint(1, 8))],  # and of the payload
            lambda: [self.header(Kind.DATA, size=rng.choice([1 << 40, (1 << 64) - 1])), message[1]],  # huge lengths
            lambda: [self.header(Kind.DATA, shape=(1 << 31, 1 << 31), size=len(message[1])), message[1]],
            lambda: self.json_message(rng.choice([Kind.DECLARE, Kind.FINALIZE]), rng.choice(JSON_MUTANTS)),
            lambda: message[:1] if rng.random() < 0.5 else message + [b"extra"],
        ]
        return rng.choice(mutations)()


class HelloFuzzer:
    """Mutants of a hello that no server would admit (attempt 1000 runs nowhere)."""

    def __init__(self, rng: random.Random, token: str, sim: int) -> None:
        self.rng = rng
        self.hello = {
            "protocol": PROTOCOL_VERSION,
            "token": token,
            "simulation_id": sim,
            "attempt": 1000,
            "client_rank": 0,
            "client_size": 1,
            "fields": {"field": GOOD},
        }

    def mutant(self) -> list[bytes]:
        rng = self.rng
        text = encode_json(self.hello)
        key = rng.choice(list(self.hello))
        mutations: list[Callable[[], list[bytes]]] = [
            lambda: [rng.randbytes(rng.randrange(300))],
            lambda: [text[: rng.randrange(len(text))]],
            lambda: [_flip(rng, text, rng.randint(1, 8))],
            lambda: [rng.choice(JSON_MUTANTS)],
            lambda: [encode_json({**self.hello, key: "\ud800" * rng.randint(1, 50)})],  # lone surrogates
            lambda: [encode_json({**self.hello, key: rng.choice([None, [], {}, 1e308, 1 << 70, -1, True])})],
            lambda: [encode_json({**self.hello, "fields": {f"f{i}": GOOD for i in range(1000)}})],
            lambda: [text, text],  # two parts
        ]
        return rng.choice(mutations)()


def raw_peers(endpoints: list[str], rng: random.Random) -> list[tcp.socket]:
    """Idle connections, half a ZeroMQ greeting, and a multipart message that never ends (NULL mechanism)."""
    peers = []
    for endpoint in endpoints:
        host, port = endpoint.rsplit("/", 1)[-1].rsplit(":", 1)
        for variant in range(12):
            peer = tcp.create_connection((host, int(port)), timeout=5)
            if variant % 3 == 1:
                peer.sendall(b"\xff" + bytes(8) + b"\x7f\x03")  # the first bytes of a greeting, then silence
            elif variant % 3 == 2:
                greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0") + b"\0" + bytes(31)
                ready = b"\x04" + bytes([26]) + b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
                part = b"\x03" + struct.pack(">Q", 1 << 20) + rng.randbytes(1 << 20)  # long frame, MORE set
                try:
                    peer.sendall(greeting + ready + part * 2)
                except OSError:
                    pass  # the server may close it first: that is the point
            peers.append(peer)
    return peers


def fuzz(
    context: zmq.Context,
    secure: Callable[[zmq.Socket], None],
    handshake_endpoint: str,
    endpoints: list[str],
    token: bytes,
    sim: int,
    steps: int,
    frames: int,
    hellos: int,
    seed: int,
) -> None:
    rng = random.Random(seed)
    peers = raw_peers([handshake_endpoint, *endpoints], rng)
    tally: dict[str, Any] = {"data_frames": 0, "handshakes": 0, "refused": Counter(), "unanswered": 0}
    pushes = []
    for endpoint in endpoints:
        push = context.socket(zmq.PUSH)
        secure(push)
        push.connect(endpoint)
        pushes.append(push)
    frame_fuzzer = FrameFuzzer(rng, token, sim, steps)
    for _ in range(frames):
        target = pushes[rng.randrange(len(pushes))] if rng.random() < 0.3 else pushes[Route(len(pushes)).owner(sim, 0)]
        target.send_multipart(frame_fuzzer.mutant())
        tally["data_frames"] += 1
    hello_fuzzer = HelloFuzzer(rng, token.hex(), sim)
    request = None
    for _ in range(hellos):
        if request is None:
            request = context.socket(zmq.REQ)
            secure(request)
            request.connect(handshake_endpoint)
        request.send_multipart(hello_fuzzer.mutant())
        tally["handshakes"] += 1
        if request.poll(5000):
            reply = json.loads(request.recv())
            assert not reply["ok"], reply
            tally["refused"][reply["kind"]] += 1
        else:
            tally["unanswered"] += 1
            request.close(linger=0)
            request = None
    for socket in pushes + ([request] if request is not None else []):
        socket.close(linger=30_000)
    for peer in peers:
        peer.close()
    with open("fuzz_tally.json", "w") as out:
        json.dump(tally, out)
