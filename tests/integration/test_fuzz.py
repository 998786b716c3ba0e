"""A seeded fuzz test: mutated frames, hellos and raw TCP peers against a live 2-rank study."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support import HERE, clean_environment, server_command, study_config

pytestmark = pytest.mark.timeout(120)

SEED = 20261123
CONNECTION_KINDS = ("_connections", "_accept_failed", "auth")


def rss_megabytes(pid: int) -> float | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # the rank has ended
        return None
    found = re.search(r"VmRSS:\s+(\d+) kB", status)  # none in a rank that has just exited
    return int(found.group(1)) / 1e3 if found else None


def test_fuzzed_frames_and_hellos_are_refused_counted_and_survived(tmp_path: Path, output: Path) -> None:
    steps = 10
    command = [sys.executable, str(HERE / "bad_client.py"), "--fuzz", str(SEED), "--steps", str(steps)]
    config = study_config(
        output, command, server={"max_message_bytes": 1 << 20}, launcher={"simulation_timeout": 60, "max_retries": 1}
    )
    config["study"]["fields"] = {"field": {"dtype": "float32", "shape": [4, 8]}}
    server = subprocess.Popen(
        server_command(tmp_path, config, 2),
        env=clean_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(server.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    pids: dict[int, int] = {}
    first: dict[int, float] = {}
    peak: dict[int, float] = {}
    try:
        while server.poll() is None:
            for line in lines:
                found = re.search(r"\[rank (\d)\] INFO .*server rank \d of 2, pid (\d+)", line)
                if found:
                    pids[int(found.group(1))] = int(found.group(2))
            for rank, pid in pids.items():
                rss = rss_megabytes(pid)
                if rss is not None:
                    first.setdefault(rank, rss)
                    peak[rank] = max(peak.get(rank, 0.0), rss)
            time.sleep(0.1)
    finally:
        server.kill()
        reader.join(10)
    log = "".join(lines)
    assert server.returncode == 0, log
    report = json.loads((output / "report.json").read_text())
    assert report["simulations"] == {"queued": 0, "running": 0, "done": 4, "failed": 0}, log
    assert report["samples_received"] == 4 * steps == report["samples_consumed"]  # every sample exactly once
    fuzzer = report["per_simulation"][0]
    assert fuzzer["attempts"] == 2 and fuzzer["reason"].startswith("exit code 3"), (
        fuzzer
    )  # ran to its end, then behaved
    tally = json.loads((tmp_path / "fuzz_tally.json").read_text())
    assert tally["data_frames"] >= 5000 and tally["handshakes"] >= 1000 and tally["unanswered"] == 0
    refused = report["rejected"]
    hello_kinds = {
        k[len("handshake_") :]: n
        for k, n in refused.items()
        if k.startswith("handshake_") and not k.endswith(CONNECTION_KINDS)
    }
    assert hello_kinds == tally["refused"]  # every refused hello counted, under the kind it was told
    frame_kinds = {
        k: n for k, n in refused.items() if not k.startswith("handshake_") and not k.endswith(CONNECTION_KINDS)
    }
    assert {"malformed", "credentials", "version", "time_step", "dtype", "shape"} <= set(frame_kinds), frame_kinds
    assert 0.8 * tally["data_frames"] <= sum(frame_kinds.values()) <= tally["data_frames"], frame_kinds
    assert set(pids) == {0, 1} and all(peak[r] - first[r] < 100 for r in pids), (first, peak)
