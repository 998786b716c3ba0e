"""Studies whose samples are windows of consecutive steps (docs/how-to/windows.md): across ranks, a kill -9
and a restart on another number of ranks, bad input."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support import HERE, TOY_SIM, committed, run_server, server_command, start, study_config, wait_for
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_fault_tolerance import processes_mentioning

from melissa_dl.runtime.status import EXIT_FAILED_SIMULATIONS

pytestmark = pytest.mark.timeout(240)

SIMULATIONS, STEPS, INPUTS, TARGETS = 6, 12, 2, 1


def windows_config(output: Path, *toy: str, **training: object) -> dict:
    """6 simulations of 12 paced steps, trained on windows of 3 steps; blocks of 4 steps, so that two of every
    simulation's windows span two ranks' blocks."""
    return study_config(
        output,
        [sys.executable, TOY_SIM, "--steps", str(STEPS), "--step-delay", "0.05", *toy],
        study={"simulations": SIMULATIONS, "time_steps": STEPS},
        buffer={"kind": "fifo", "capacity_samples": 1000},
        launcher={"job_limit": 2},
        training={
            "module": str(HERE / "window_module.py"),
            "class_name": "Windows",
            "options": {"simulations": SIMULATIONS, "steps": STEPS},
            "window": {"inputs": INPUTS, "targets": TARGETS, "block": 4},
            "batch_size": 4,
            "nb_batches_update": 1000,
            "device": "cpu",
            **training,
        },
        checkpoint={"interval": 2},
    )


def trained_windows(output: Path) -> np.ndarray:
    """How many times each window (simulation x first step) was trained, from the model the study saved."""
    return torch.load(output / "model.pt", weights_only=True)["seen"].numpy()


def every_window_once() -> np.ndarray:
    expected = np.zeros((SIMULATIONS, STEPS))
    expected[:, : STEPS - INPUTS - TARGETS + 1] = 1
    return expected


def test_a_study_of_windows_on_two_ranks_trains_every_window_once(tmp_path: Path, output: Path) -> None:
    run = run_server(tmp_path, windows_config(output), ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None and run.report["simulations"]["done"] == SIMULATIONS
    np.testing.assert_array_equal(trained_windows(output), every_window_once())
    # each step counted once, though the first 2 of blocks 1 and 2 went to two ranks; a window trained per sample
    assert run.report["samples_received"] == SIMULATIONS * STEPS
    assert run.report["samples_consumed"] == SIMULATIONS * (STEPS - INPUTS - TARGETS + 1)


def test_a_study_of_windows_killed_on_two_ranks_and_resumed_on_one_trains_every_window_once(
    tmp_path: Path, output: Path
) -> None:
    config = windows_config(output)
    process = start(server_command(tmp_path, config, 2))
    wait_for(lambda: committed(output), process)
    for pid in processes_mentioning(str(tmp_path)):  # mpirun, both ranks, the simulations
        os.kill(pid, signal.SIGKILL)
    process.communicate(timeout=30)
    assert process.returncode != 0
    assert not (output / "report.json").exists(), "the study should have been cut short"
    run = run_server(tmp_path, config, ranks=1)
    assert run.code == 0, run.log
    assert "written by 2 ranks" in run.log
    assert run.report is not None and run.report["simulations"]["done"] == SIMULATIONS
    np.testing.assert_array_equal(trained_windows(output), every_window_once())


def test_a_simulation_that_skips_a_step_is_refused_in_one_line_and_every_other_window_trains(
    tmp_path: Path, output: Path
) -> None:
    """On one rank, so that every window made is trained (on two, the rank that runs dry first ends training)."""
    config = windows_config(output, "--skip-simulation", "2", "--skip-step", "7")
    config["launcher"]["max_retries"] = 2
    run = run_server(tmp_path, config, ranks=1)
    assert run.code == EXIT_FAILED_SIMULATIONS and run.report is not None, run.log
    refusal = (
        "simulation 2, step 8: sent after step 6 without step 7; windows of steps (training.window) need every step, "
        "in order"
    )
    assert refusal in run.log
    per = {entry["id"]: entry for entry in run.report["per_simulation"]}
    assert per[2]["state"] == "failed" and per[2]["attempts"] == 1  # not run again: it would skip the same step
    expected = every_window_once()
    expected[2, 5:] = 0  # windows 5.. of simulation 2 need its step 7 or a step refused after it
    np.testing.assert_array_equal(trained_windows(output), expected)


@pytest.mark.parametrize("increment", [1.0, 0.0])
def test_held_out_simulations_are_rolled_out_and_their_errors_reported(
    tmp_path: Path, output: Path, increment: float
) -> None:
    """Two held-out simulations (ids 6 and 7), rolled out from their first 2 steps over the 10 others by a model
    that adds ``increment`` to the last step: toy_sim's rule (no error), or a model that stands still (its error
    at horizon h is h over the true value)."""
    config = windows_config(output)
    config["study"]["validation"] = {"simulations": 2}
    config["training"]["options"] = {"simulations": SIMULATIONS + 2, "steps": STEPS, "increment": increment}
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0 and run.report is not None, run.log
    rollouts = run.report["training"]["rollout"]
    assert rollouts and all(set(errors) == {"1", "10", "end"} for _, errors in rollouts)
    _, last = rollouts[-1]
    if increment:
        assert last == {"1": 0.0, "10": 0.0, "end": 0.0}
    else:
        truth = {h: [1000.0 * s + INPUTS - 1 + h for s in (6, 7)] for h in (1, 10)}
        expected = {str(h): np.mean([h / value for value in truth[h]]) for h in (1, 10)}
        assert last["1"] == pytest.approx(expected["1"]) and last["10"] == pytest.approx(expected["10"])
        assert last["end"] == last["10"]  # 12 steps: the end is 10 steps after the first 2
    assert "rollout error (relative L2)" in run.log
    events = EventAccumulator(str(output / "tensorboard" / "rank0"))
    events.Reload()
    assert {"validation/rollout_1", "validation/rollout_10", "validation/rollout_end"} <= set(events.Tags()["scalars"])
