"""Training after the data (``training.epochs_after_data``): passes over what the buffers hold once every
simulation has ended, stopped and resumed in their middle (issue 54, item 2)."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from support import HERE, TOY_SIM, run_server, server_command, start, study_config, wait_for

from melissa_dl.runtime.status import EXIT_STOPPED, STATUS

pytestmark = pytest.mark.timeout(240)

SIMULATIONS, STEPS, PASSES, BATCH = 4, 5, 4, 2
PER_RANK = SIMULATIONS * STEPS // 2  # step t of simulation s goes to rank (s + t) % 2: 10 samples each
BATCHES = PASSES * PER_RANK // BATCH  # per rank, in lockstep: 20


def passes_done(output: Path) -> int:
    """The passes every rank finished after the data, as the latest status says (-1 before it says any)."""
    path = output / STATUS
    if not path.exists():
        return -1
    after = (json.loads(path.read_text()).get("training") or {}).get("after_data")
    return -1 if after is None else min(after["passes_done"])


def test_passes_after_the_data_train_what_the_buffers_held_and_resume_midway(tmp_path: Path, output: Path) -> None:
    """The watermark is above what a rank receives, so no batch is served before every simulation has ended; then
    4 passes over each rank's 10 samples (20 batches of 2), 0.2 s each. SIGTERM once a pass is done: the stop's
    checkpoint holds the passes midway, and the same command resumes them: 20 batches in all, not one more."""
    config = study_config(
        output,
        [sys.executable, TOY_SIM, "--steps", str(STEPS)],
        study={"simulations": SIMULATIONS, "time_steps": STEPS},
        server={"status_interval": 0.2},
        buffer={"kind": "reservoir", "capacity_samples": 100, "per_server_watermark": 100},
        launcher={"job_limit": SIMULATIONS},
        training={
            "module": str(HERE / "tiny_module.py"),
            "class_name": "Tiny",
            "options": {"step_delay": 0.2},
            "batch_size": BATCH,
            "nb_batches_update": 5,
            "log_interval": 1,
            "device": "cpu",
            "seed": 3,
            "epochs_after_data": PASSES,
        },
        checkpoint={"interval": 1000},
    )
    process = start(server_command(tmp_path, config, 2))
    wait_for(lambda: passes_done(output) >= 1, process)
    process.send_signal(signal.SIGTERM)
    log, _ = process.communicate(timeout=120)
    assert process.returncode == EXIT_STOPPED, log
    assert "after the data: pass 2 of 4" in log
    status = json.loads((output / STATUS).read_text())
    assert status["state"] == "stopped" and status["simulations"]["done"] == SIMULATIONS
    stopped_at = status["training"]["batches"]
    assert 0 < stopped_at < BATCHES  # the stop came during the passes (the status lags the batch in hand by one)

    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0 and run.report is not None, run.log
    assert "resuming from checkpoint" in run.log
    training = run.report["training"]
    assert training["batches"] == BATCHES and training["samples_trained"] == 2 * BATCHES * BATCH
    assert training["after_data"] == {"passes": PASSES, "passes_done": [PASSES, PASSES]}
    assert run.report["samples_received"] == SIMULATIONS * STEPS
    assert [batch for batch, _ in training["validation"]][-1] == BATCHES
    assert f"ended when a rank finished its {PASSES} passes over what its buffer held" in run.log
