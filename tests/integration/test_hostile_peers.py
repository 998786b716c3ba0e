"""Peers that are not clients: idle connections and descriptor exhaustion must not end a study."""
from __future__ import annotations

import json
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TOY_SIM, clean_environment, free_port, server_command, study_config

pytestmark = pytest.mark.timeout(180)


def connect_idle(port: int, count: int, deadline: float) -> list[socket.socket]:
    """Open up to ``count`` TCP connections that never say a word (those refused at once are retried)."""
    idle: list[socket.socket] = []
    while len(idle) < count and time.monotonic() < deadline:
        try:
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        except ConnectionRefusedError:  # not bound yet
            time.sleep(0.05)
    return idle


def test_a_thousand_idle_connections_under_a_low_descriptor_limit_are_refused_not_fatal(
    tmp_path: Path, output: Path
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if min(soft, hard) < 1400:
        pytest.skip(f"this test opens 1,100 connections; the open-file limit here is {soft}")
    port = free_port()
    config = study_config(output, [sys.executable, TOY_SIM, "--steps", "20", "--step-delay", "0.1"],
                          study={"time_steps": 20}, server={"handshake_port": port})
    command = ["bash", "-c", 'ulimit -n 512 && exec "$@"', "limited", *server_command(tmp_path, config, 2)]
    server = subprocess.Popen(command, env=clean_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
    try:
        idle = connect_idle(port, 1100, time.monotonic() + 60)
        log, _ = server.communicate(timeout=120)
    finally:
        server.kill()
    for connection in idle:
        connection.close()
    assert len(idle) == 1100
    assert server.returncode == 0, log
    report = json.loads((output / "report.json").read_text())
    assert report["samples_received"] == 80 and report["simulations"]["done"] == 4
    assert report["rejected"].get("handshake_connections", 0) > 0, report["rejected"]
    assert "closing a new one (raise `ulimit -n` for more)" in log
