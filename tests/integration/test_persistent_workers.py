"""Persistent workers (``launcher.persistent``): few processes, every simulation once, a dead worker replaced."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from support import HERE, persistent_config, run_server, study_config

pytestmark = pytest.mark.timeout(240)

TOY_WORKER = str(HERE / "toy_worker.py")
SIMULATIONS, STEPS = 8, 10


def worker_pids(output: Path) -> list[int]:
    """The pid every worker process printed at its start, in the workers' logs."""
    logs = (output / "simulations").glob("worker*.start*.log")
    return [int(pid) for log in logs for pid in re.findall(r"^worker (\d+)$", log.read_text(), re.MULTILINE)]


@pytest.mark.parametrize("scheduler", ["local", "mpirun"])
def test_two_workers_run_every_simulation_once_each_and_a_dead_one_is_replaced(
    tmp_path: Path, output: Path, scheduler: str
) -> None:
    """Simulation 3's first attempt kills its worker: the study relaunches it, a new worker takes the slot."""
    command = [sys.executable, TOY_WORKER, "--steps", str(STEPS), "--crash-simulation", "3"]
    config = persistent_config(output, command, scheduler, SIMULATIONS, STEPS)
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None
    assert run.report["simulations"]["done"] == SIMULATIONS
    assert run.report["samples_received"] == SIMULATIONS * STEPS == run.report["samples_consumed"]
    assert [s["attempts"] for s in run.report["per_simulation"]] == [1, 1, 1, 2, 1, 1, 1, 1]
    assert "toy_worker: crashing on purpose at step 3" in run.report["per_simulation"][3]["reason"]
    ranks = 2 if scheduler == "mpirun" else 1
    assert len(worker_pids(output)) == 3 * ranks  # job_limit 2 workers, and the one that replaced the dead one
    logs = sorted((output / "simulations").glob("worker*.start*.log"))
    assert sum(log.read_text().count("toy_worker: the study is over") for log in logs) == 2 * ranks  # told, not killed
    attempt_log = output / "simulations" / "simulation0.attempt0.log"
    assert attempt_log.is_symlink() and "simulation 0 attempt 0" in attempt_log.read_text()


def test_worker_placeholders_other_than_slot_are_refused_at_check(tmp_path: Path, output: Path) -> None:
    config = study_config(output, [sys.executable, TOY_WORKER, "{simulation}"], launcher={"persistent": True})
    run = run_server(tmp_path, config, ranks=1)
    assert run.code == 2, run.log
    assert "launcher.command[2]: '{simulation}': unknown placeholder {simulation}; known: {slot} (with " in run.log
