"""Studies at scale: simulations that outrun training and exit while the server is far behind, and a thousand
simulations at once (issue 31)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support import HERE, TOY_SIM, clean_environment, run_server, server_command, study_config, wait_for

pytestmark = pytest.mark.timeout(150)

SIMULATIONS, STEPS, SHAPE = 12, 10, (4, 8)  # the field Tiny learns


def test_training_much_slower_than_a_dozen_short_simulations_fails_none(tmp_path: Path, output: Path) -> None:
    """12 simulations of 10 steps, all at once, exit within a second or two; training takes 0.5 s per batch
    of 2 on each rank (8 samples/s), so the server's 4-sample FIFO is full for about 15 s and its receivers stop
    reading: every simulation ends with its last frames still queued towards the server (ZeroMQ allows 4 messages
    per connection with the default server.max_message_bytes; the rest waits in the kernel's socket buffers).

    Before issue 31 was fixed, the server's ZMTP heartbeats (every client_timeout / 10 = 1 s) met the exited
    simulations' closed sockets; the reset made libzmq abort both ranks (`Assertion failed: !_io_error
    (src/stream_engine_base.cpp:310)`, exit 6, no report) within about 7 s; with client_timeout 300 and a study
    lagging over 30 s the same reset dropped each simulation's unread frames instead (`exited 0 without
    finalize`). Back-pressure, however long, must fail nobody and lose nothing."""
    config = study_config(
        output,
        [sys.executable, TOY_SIM, "--steps", str(STEPS), "--shape", *map(str, SHAPE)],
        study={"simulations": SIMULATIONS, "time_steps": STEPS},
        buffer={"kind": "fifo", "capacity_samples": 4, "per_server_watermark": 1},
        launcher={"job_limit": SIMULATIONS, "client_timeout": 10, "simulation_timeout": 120, "max_retries": 0},
    )
    config["training"] = {
        "module": str(HERE / "tiny_module.py"),
        "class_name": "Tiny",
        "options": {"step_delay": 0.5},
        "batch_size": 2,
        "nb_batches_update": 1000,
        "log_interval": 1,
        "device": "cpu",
        "seed": 3,
    }
    run = run_server(tmp_path, config, ranks=2, timeout=120)
    end = "\n".join(run.log.splitlines()[-15:])
    assert run.code == 0 and "Assertion failed" not in run.log, f"exit code {run.code}; the log ends:\n{end}"
    assert run.report is not None, end
    report = run.report
    assert report["simulations"] == {"queued": 0, "running": 0, "done": SIMULATIONS, "failed": 0}, [
        (s["id"], s["state"], s.get("reason")) for s in report["per_simulation"]
    ]
    assert all(s["attempts"] == 1 for s in report["per_simulation"]), report["per_simulation"]
    assert report["samples_received"] == SIMULATIONS * STEPS == report["samples_expected"]
    assert report["samples_consumed"] == SIMULATIONS * STEPS  # each sample served once by the FIFO
    assert report["duplicate_frames_dropped"] == 0 and report["rejected"] == {}


def test_a_thousand_simulations_at_once_each_sample_once(tmp_path: Path, output: Path, native: Path) -> None:
    """1,000 C clients of 5 steps: each handshakes, connects to both ranks and waits until the test sees all of
    them running at once (the status counts them), then they all stream and finalize together."""
    simulations, steps = 1000, 5
    go = tmp_path / "go"
    config = study_config(
        output,
        [str(native / "scale_client"), str(steps), "64", "0", str(go)],
        study={"simulations": simulations, "time_steps": steps},
        server={"status_interval": 0.5},
        buffer={"kind": "fifo", "capacity_samples": simulations * steps},
        launcher={"job_limit": simulations, "client_timeout": 60, "simulation_timeout": 120, "max_retries": 0},
    )
    log = tmp_path / "server.log"  # a pipe nobody reads while the test waits would fill and stall the server
    with open(log, "w") as sink:
        server = subprocess.Popen(
            server_command(tmp_path, config, 2), env=clean_environment(), stdout=sink, stderr=subprocess.STDOUT
        )
    try:
        wait_for(lambda: running(output) == simulations, server, timeout=120)
        go.touch()
        server.wait(timeout=120)
    finally:
        server.kill()
    assert server.returncode == 0, log.read_text()[-3000:]
    report = json.loads((output / "report.json").read_text())
    assert report["simulations"] == {"queued": 0, "running": 0, "done": simulations, "failed": 0}
    assert all(s["attempts"] == 1 and s["samples"] == steps for s in report["per_simulation"])
    assert report["samples_received"] == report["samples_expected"] == simulations * steps
    assert report["samples_consumed"] == simulations * steps
    refusals = [line for line in log.read_text().splitlines() if "refused (" in line]  # which socket, which errno
    assert report["duplicate_frames_dropped"] == 0 and report["rejected"] == {}, refusals
    history = [json.loads(line)["simulations"] for line in (output / "progress.jsonl").read_text().splitlines()]
    assert max(h["running"] for h in history) == simulations  # never more than job_limit


def running(output: Path) -> int:
    try:
        return json.loads((output / "status.json").read_text())["simulations"]["running"]
    except (OSError, ValueError):  # not written yet
        return 0
