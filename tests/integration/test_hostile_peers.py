"""Peers that are not clients: idle connections, descriptor exhaustion and big messages before any login must
not end a study, nor cost it more than a little memory."""

from __future__ import annotations

import contextlib
import json
import re
import resource
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from support import TOY_SIM, clean_environment, free_port, server_command, study_config

pytestmark = pytest.mark.timeout(180)


def connect_idle(port: int, count: int, deadline: float) -> list[socket.socket]:
    """Open up to ``count`` TCP connections that never say a word (those refused or timed out are retried)."""
    idle: list[socket.socket] = []
    while len(idle) < count and time.monotonic() < deadline:
        try:
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except (ConnectionRefusedError, TimeoutError):  # not bound yet, or its listen backlog full on a busy machine
            time.sleep(0.05)
    return idle


def test_a_thousand_idle_connections_under_a_low_descriptor_limit_are_refused_not_fatal(
    tmp_path: Path, output: Path
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if min(soft, hard) < 1400:
        pytest.skip(f"this test opens 1,100 connections; the open-file limit here is {soft}")
    port = free_port()
    go = tmp_path / "go"  # the simulations' first step waits for it: the study outlasts the connections, at any load
    config = study_config(
        output,
        [sys.executable, TOY_SIM, "--steps", "20", "--step-delay", "0.1", "--go", str(go)],
        study={"time_steps": 20},
        server={"handshake_port": port},
    )
    # 384 descriptors: 42 a socket (connection_cap), below PENDING_PER_HOST: the descriptor cap is what refuses
    command = ["bash", "-c", 'ulimit -n 384 && exec "$@"', "limited", *server_command(tmp_path, config, 2)]
    server = subprocess.Popen(
        command, env=clean_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        idle = connect_idle(port, 1100, time.monotonic() + 90)  # under launcher.simulation_timeout (120 s)
        go.touch()
        log, _ = server.communicate(timeout=120)
    finally:
        server.kill()
    for connection in idle:
        connection.close()
    assert len(idle) == 1100, log[-3000:]
    assert server.returncode == 0, log
    report = json.loads((output / "report.json").read_text())
    assert report["samples_received"] == 80 and report["simulations"]["done"] == 4
    assert report["rejected"].get("handshake_connections", 0) > 0, report["rejected"]
    assert "closing a new one (raise `ulimit -n` for more)" in log


PEERS = 32  # connections at once, each announcing a message part just under 64 MiB before any login
PART = (64 << 20) - 1


def rank_pids(config: Path, ranks: int, timeout: float = 60) -> dict[int, int]:
    """The server ranks running ``config``: rank -> pid (found by their command line and MPI environment)."""
    found: dict[int, int] = {}
    deadline = time.monotonic() + timeout
    while len(found) < ranks and time.monotonic() < deadline:
        for entry in Path("/proc").iterdir():
            try:
                if not entry.name.isdigit() or str(config) not in (entry / "cmdline").read_text():
                    continue
                environ = dict(
                    item.split("=", 1) for item in (entry / "environ").read_text().split("\0") if "=" in item
                )
            except OSError:
                continue
            if "PMI_RANK" in environ and "mpirun" not in (entry / "cmdline").read_text().split("\0")[0]:
                found[int(environ["PMI_RANK"])] = int(entry.name)
        time.sleep(0.1)
    return found


class Lines(threading.Thread):
    """A process's output, read as it comes; ``wait_for`` a pattern in it."""

    def __init__(self, stream: Any) -> None:
        super().__init__(daemon=True)
        self.stream, self.lines, self.changed = stream, [], threading.Condition()
        self.start()

    def run(self) -> None:
        for line in self.stream:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()

    def wait_for(self, pattern: str, count: int, timeout: float = 60) -> list[re.Match[str]]:
        def found() -> list[re.Match[str]]:
            return [m for line in self.lines if (m := re.search(pattern, line))]

        with self.changed:
            self.changed.wait_for(lambda: len(found()) >= count or not self.is_alive(), timeout)
            return found()


def megabytes(pid: int, key: str) -> float:
    return int(re.search(rf"{key}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1e3  # type: ignore


def attack(port: int, mechanism: str | None, deadline: float, made: Counter[int]) -> None:
    """Until ``deadline``: connect, greet as ZeroMQ would, announce a command of PART bytes and send them (or, with
    no mechanism, send what an HTTP client would), until the server closes the connection; count every connection
    made."""
    if mechanism is None:
        opening, payload = b"GET / HTTP/1.1\r\nHost: melissa\r\n\r\n", memoryview(b"")
    else:
        greeting = b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + mechanism.encode().ljust(20, b"\0") + bytes(32)
        opening, payload = greeting + b"\x06" + PART.to_bytes(8, "big"), memoryview(bytes(PART))
    while time.monotonic() < deadline:
        try:
            peer = socket.create_connection(("127.0.0.1", port), timeout=10)
        except OSError:
            continue
        made[port] += 1
        with peer, contextlib.suppress(OSError):
            peer.sendall(opening)
            peer.sendall(payload)
            while peer.recv(1 << 16):
                pass


@pytest.mark.parametrize("level, language, seconds", [("token", "python", 30), ("curve", "c", 10)])
def test_peers_without_credentials_sending_64_mib_or_garbage_before_login_cost_a_rank_almost_nothing(
    tmp_path: Path, output: Path, native: Path, level: str, language: str, seconds: float
) -> None:
    go = tmp_path / "go"
    command = (
        [sys.executable, TOY_SIM, "--steps", "5", "--shape", "8", "--go", str(go)]
        if language == "python"
        else [str(native / "scale_client"), "5", "8", "0", str(go)]
    )
    port = free_port()
    config = study_config(
        output,
        command,
        study={"time_steps": 5},
        launcher={"job_limit": 4},
        server={"handshake_port": port, "security": level, "max_message_bytes": 64 << 20},
    )
    server = subprocess.Popen(
        server_command(tmp_path, config, 2),
        env=clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        output_lines = Lines(server.stdout)
        pids = rank_pids(tmp_path / "config.json", 2)
        bound = output_lines.wait_for(r"data at tcp://127.0.0.1:(\d+), delivery service at tcp://127.0.0.1:(\d+)", 2)
        assert len(bound) == 2 and output_lines.wait_for("handshake at", 1), "".join(output_lines.lines)
        targets = [port] + [int(p) for match in bound for p in match.groups()]
        before = {rank: megabytes(pid, "VmRSS") for rank, pid in pids.items()}
        for pid in pids.values():
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS
        made: Counter[int] = Counter()
        end = time.monotonic() + seconds
        attackers = [
            threading.Thread(
                target=attack,
                args=(
                    targets[i % len(targets)],  # 3 of 4 big, 1 not ZeroMQ
                    mechanism(level) if i % 4 else None,
                    end,
                    made,
                ),
            )
            for i in range(PEERS)
        ]
        for thread in attackers:
            thread.start()
        for thread in attackers:
            thread.join()
        grown = {rank: megabytes(pid, "VmHWM") - before[rank] for rank, pid in pids.items()}
        go.touch()
        server.wait(timeout=120)
        output_lines.join(timeout=10)
    finally:
        server.kill()
    log = "".join(output_lines.lines)
    assert server.returncode == 0, log
    assert all(g < 64 for g in grown.values()), f"peak resident memory grew by {grown} MB"
    report = json.loads((output / "report.json").read_text())
    assert report["samples_received"] == 20 and report["simulations"]["done"] == 4
    assert report["samples_consumed"] == 20 and report["duplicate_frames_dropped"] == 0
    refused = report["rejected"]
    assert set(refused) == {"handshake_cut", "data_cut", "ack_cut"}, refused
    assert refused["handshake_cut"] == made[port] > 0
    assert refused["data_cut"] + refused["ack_cut"] == sum(made.values()) - made[port], (refused, made)


def mechanism(level: str) -> str:
    return "PLAIN" if level == "token" else "CURVE"
