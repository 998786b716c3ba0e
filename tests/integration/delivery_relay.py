"""Run a simulation behind a relay that loses answers of the server's delivery services.

    python delivery_relay.py --lose wait=close,swallow --lose ping=close -- COMMAND...

The relay stands between the simulation and the server, on real TCP
connections: the simulation's ``MELISSA_SERVER`` points at a relay of rank 0's
handshake service, which rewrites the handshake's answer so that each server
rank's delivery service is reached through a relay of its own. Those pass
everything but the first answers to questions of each kind named by
``--lose`` (``wait``: a finalize's; ``ping``: a blocked send's), one per
action listed: ``close`` closes both connections instead of passing the answer
on, as a failing link or a router's restart does; ``swallow`` drops it and
keeps the connection, as a rank whose queue to the client is full does. Each
loss, and the first answer of that kind passed on after the last, is printed
(into the simulation's log) and, with ``--record DIR``, noted as a file
``DIR/<simulation>.<kind>.<action>`` and ``.answered``, events a test can wait
on. The command runs with the environment otherwise unchanged; the relay exits
with its code.

ZMTP 3 is parsed frame by frame (a 64-byte greeting, then frames of a flags
byte and a 1- or 8-byte size); the message frames are readable with the
``token`` level (PLAIN) only, which the tests use.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

GREETING = 64
MORE, LONG, COMMAND = 1, 2, 4


class Frames:
    """One direction of a ZMTP connection, cut into its greeting and frames as bytes arrive."""

    def __init__(self) -> None:
        self.pending = bytearray()
        self.greeting = GREETING  # its bytes still to come: passed on as they come (the peers greet by halves)

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        """The items that ``data`` completes: ``(-1, bytes)`` for the greeting's, then ``(flags, body)`` per
        frame."""
        self.pending += data
        items: list[tuple[int, bytes]] = []
        if self.greeting:
            part = bytes(self.pending[: self.greeting])
            del self.pending[: self.greeting]
            self.greeting -= len(part)
            items.append((-1, part))
        while len(self.pending) >= 2:
            flags = self.pending[0]
            head = 9 if flags & LONG else 2
            if len(self.pending) < head:
                break
            size = int.from_bytes(self.pending[1:9], "big") if flags & LONG else self.pending[1]
            if len(self.pending) < head + size:
                break
            items.append((flags, bytes(self.pending[head : head + size])))
            del self.pending[: head + size]
        return items


def encode(flags: int, body: bytes) -> bytes:
    """A frame as ZMTP sends it (``flags < 0``: the greeting, as it came)."""
    if flags < 0:
        return body
    if len(body) > 255:
        return bytes([flags | LONG]) + len(body).to_bytes(8, "big") + body
    return bytes([flags & ~LONG, len(body)]) + body


def message(flags: int, body: bytes) -> dict | None:
    """A message frame's JSON object, if it is one."""
    if flags < 0 or flags & COMMAND:
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class Relay:
    """A listening port whose connections are relayed to ``upstream``; ``upstream_frame`` and ``client_frame``
    see each item of a connection (with that connection's state) and return the bytes to pass on, or None to close
    the connection."""

    def __init__(
        self,
        upstream: tuple[str, int],
        upstream_frame: Callable[[dict, int, bytes], bytes | None],
        client_frame: Callable[[dict, int, bytes], bytes | None] = lambda state, flags, body: encode(flags, body),
    ) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream = upstream
        self.upstream_frame, self.client_frame = upstream_frame, client_frame
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            client, _ = self.listener.accept()
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        state: dict = {"questions": collections.deque()}
        with client, socket.create_connection(self.upstream) as server:
            frames = {client: Frames(), server: Frames()}
            while True:
                ready, _, _ = select.select([client, server], [], [])
                for end in ready:
                    data = end.recv(65536)
                    if not data:
                        return
                    react = self.upstream_frame if end is server else self.client_frame
                    for flags, body in frames[end].feed(data):
                        passed = react(state, flags, body)
                        if passed is None:
                            return  # both connections close
                        (client if end is server else server).sendall(passed)


def endpoint_address(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


class Study:
    """The relays of one simulation process: the handshake's, and one per server rank's delivery service."""

    def __init__(self, server: str, lose: dict[str, list[str]], record: Path | None, simulation: str) -> None:
        self.lose, self.record, self.simulation = lose, record, simulation  # kind -> actions on its next answers
        self.lock = threading.Lock()
        self.delivery: dict[str, int] = {}  # a rank's delivery endpoint -> its relay's port
        self.handshake = Relay(endpoint_address(server), self._handshake_answer)

    def _handshake_answer(self, state: dict, flags: int, body: bytes) -> bytes:
        reply = message(flags, body)
        if reply is not None and "acks" in reply:
            reply["acks"] = [f"tcp://127.0.0.1:{self._delivery_port(endpoint)}" for endpoint in reply["acks"]]
            body = json.dumps(reply).encode()
        return encode(flags, body)

    def _delivery_port(self, endpoint: str) -> int:
        with self.lock:
            if endpoint not in self.delivery:
                self.delivery[endpoint] = Relay(endpoint_address(endpoint), self._answer, self._question).port
            return self.delivery[endpoint]

    def _question(self, state: dict, flags: int, body: bytes) -> bytes:
        question = message(flags, body)
        if question is not None:
            state["questions"].append("wait" if question.get("wait") else "ping")
        return encode(flags, body)

    def _answer(self, state: dict, flags: int, body: bytes) -> bytes | None:
        if message(flags, body) is None:
            return encode(flags, body)
        kind = state["questions"].popleft()
        with self.lock:
            actions = self.lose.get(kind)
            if actions:
                action = actions.pop(0)
                self._note(kind, action)
                return None if action == "close" else b""
            if actions == []:  # its losses are over: the first answer passed on after them
                del self.lose[kind]
                self._note(kind, "answered")
        return encode(flags, body)

    def _note(self, kind: str, event: str) -> None:
        words = {
            "close": "lost (its connection closed)",
            "swallow": "lost (its connection kept)",
            "answered": "asked again and answered",
        }[event]
        print(f"delivery_relay: simulation {self.simulation}: a {kind} question's answer {words}", flush=True)
        if self.record is not None:
            (self.record / f"{self.simulation}.{kind}.{event}").touch()


def losses(text: str) -> tuple[str, list[str]]:
    """``--lose``'s ``KIND=ACTION,ACTION...``."""
    kind, _, actions = text.partition("=")
    if kind not in ("wait", "ping") or not actions or set(actions.split(",")) - {"close", "swallow"}:
        raise argparse.ArgumentTypeError(f"{text!r}: expected wait|ping=close|swallow[,...]")
    return kind, actions.split(",")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lose", action="append", type=losses, default=[])
    parser.add_argument("--record", type=Path)
    parser.add_argument("command", nargs="+")
    args = parser.parse_args()
    study = Study(os.environ["MELISSA_SERVER"], dict(args.lose), args.record, os.environ["MELISSA_SIMULATION_ID"])
    environ = {**os.environ, "MELISSA_SERVER": f"tcp://127.0.0.1:{study.handshake.port}"}
    return subprocess.run(args.command, env=environ).returncode


if __name__ == "__main__":
    sys.exit(main())
