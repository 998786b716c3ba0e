"""Whole studies: `mpirun -n K melissa-server` with real simulation processes."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from support import HERE, TOY_SIM, Run, run_server, study_config

from melissa_dl.runtime.status import EXIT_FAILED_SIMULATIONS

pytestmark = pytest.mark.timeout(180)

HEAT = HERE.parent.parent / "examples" / "heat_pde" / "heat.py"


def assert_clean_study(run: Run, simulations: int, steps: int) -> None:
    """Exit 0, every step received and consumed once, nothing refused."""
    assert run.code == 0, run.log
    assert run.report is not None
    assert_every_step_once(run.report, simulations, steps)
    assert run.report["rejected"] == {}


def assert_every_step_once(report: dict, simulations: int, steps: int) -> None:
    assert report["simulations"]["done"] == simulations
    assert report["samples_received"] == simulations * steps == report["samples_expected"]
    assert report["samples_consumed"] == simulations * steps  # each sample served once by the FIFO


def test_mpi_clients_and_a_crash_deliver_every_step_exactly_once(tmp_path: Path, output: Path) -> None:
    steps = 30
    command = [
        sys.executable,
        str(HEAT),
        "--mpi",
        "--nx",
        "16",
        "--ny",
        "8",
        "--steps",
        str(steps),
        "--crash-at",
        "12",
        "--crash-simulation",
        "1",
    ]
    config = study_config(output, command)
    config["study"].update(
        simulations=3,
        time_steps=steps,
        fields=["temperature"],
        parameters=[{"name": n, "low": 100.0, "high": 500.0} for n in ("initial", "left", "right", "bottom", "top")],
    )
    config["launcher"].update(scheduler="mpirun", client_ranks=2, job_limit=2)
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None
    assert_every_step_once(run.report, 3, steps)
    attempts = {s["id"]: s["attempts"] for s in run.report["per_simulation"]}
    assert attempts == {0: 1, 1: 2, 2: 1}
    assert run.report["duplicate_frames_dropped"] <= 12 * 2  # steps the crashed attempt delivered, resent
    assert run.report["per_rank_samples"][0] > 0 and run.report["per_rank_samples"][1] > 0


@pytest.mark.parametrize(
    "mode, timeout, reason",
    [
        ("crash", 120, "exit code 1; output ("),  # not 3 s: a start slowed by load ends it first
        ("hang", 3, "no data for 3 s"),
        ("no-finalize", 120, "exited 0 without finalize"),
    ],
)
def test_a_failing_simulation_is_relaunched_and_completes(
    tmp_path: Path, output: Path, mode: str, timeout: float, reason: str
) -> None:
    command = [sys.executable, TOY_SIM, "--fail", mode, "--fail-simulation", "2"]
    config = study_config(output, command, launcher={"simulation_timeout": timeout})
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None
    assert_every_step_once(run.report, 4, 10)
    failed = run.report["per_simulation"][2]
    assert failed["attempts"] == 2 and failed["reason"].startswith(reason), failed
    assert reason in run.log
    if mode == "crash":  # the simulation's own last words, and where its whole output is
        assert failed["reason"].endswith("simulation2.attempt0.log): toy_sim: crashing on purpose at step 3"), failed


@pytest.mark.parametrize("scheduler", ["local", "mpirun"])
def test_placeholders_give_each_attempt_its_parameters_on_argv_and_its_slot_in_env(
    tmp_path: Path, output: Path, scheduler: str
) -> None:
    """Simulation 2 crashes once: its relaunch has attempt 1 on argv. Each attempt prints its ``{slot}``."""
    command = [sys.executable, TOY_SIM, "--fail", "crash", "--fail-simulation", "2"]
    command += ["--argv", "{simulation}", "{attempt}", "{parameters}"]
    config = study_config(output, command, launcher={"scheduler": scheduler, "env": {"TOY_SLOT": "{slot}"}})
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None
    assert_every_step_once(run.report, 4, 10)
    assert [s["attempts"] for s in run.report["per_simulation"]] == [1, 1, 2, 1]
    logs = sorted((output / "simulations").glob("simulation*.attempt*.log"))
    assert len(logs) == 5
    slots = [re.findall(r"^slot (\d+)$", log.read_text(), re.MULTILINE) for log in logs]
    assert all(len(found) == 1 and found[0] in ("0", "1") for found in slots), slots  # job_limit 2


def test_a_simulation_that_always_fails_is_reported_failed(tmp_path: Path, output: Path) -> None:
    command = [sys.executable, TOY_SIM, "--fail", "crash", "--fail-simulation", "1", "--fail-attempts", "99"]
    config = study_config(output, command, launcher={"max_retries": 2})
    run = run_server(tmp_path, config, ranks=1)
    assert run.code == 3, run.log
    assert run.report is not None
    assert run.report["simulations"] == {"queued": 0, "running": 0, "done": 3, "failed": 1}
    failed = run.report["per_simulation"][1]
    assert (failed["state"], failed["attempts"]) == ("failed", 3)
    assert failed["reason"] == (
        f"exit code 1; output ({output / 'simulations' / 'simulation1.attempt2.log'}): "
        "toy_sim: crashing on purpose at step 3"
    )
    assert f"simulation 1 failed after 3 attempts: {failed['reason']}" in run.log


@pytest.mark.parametrize("kind", ["fifo", "firo", "reservoir"])
def test_every_buffer_kind_receives_and_drains_everything(tmp_path: Path, output: Path, kind: str) -> None:
    config = study_config(
        output,
        [sys.executable, TOY_SIM, "--steps", "25"],
        study={"time_steps": 25},
        buffer={"kind": kind, "capacity_samples": 8, "per_server_watermark": 4},
    )
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None
    assert run.report["samples_received"] == 100
    assert run.report["samples_consumed"] >= 100  # the reservoir may serve a sample more than once
    assert not list(output.glob("*.png")) and "plots:" not in run.log  # "plots": false


def test_bad_frames_and_handshakes_are_refused_counted_and_survived(tmp_path: Path, output: Path) -> None:
    config = study_config(output, [sys.executable, str(HERE / "bad_client.py")], server={"max_message_bytes": 1 << 20})
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None
    assert_every_step_once(run.report, 4, 10)
    rejected = run.report["rejected"]
    frame_kinds = [
        "malformed",
        "version",
        "credentials",
        "unknown_simulation",
        "routing",
        "time_step",
        "unknown_field",
        "undeclared",
        "dtype",
        "shape",
        "non_finite",
        "oversize",
    ]
    handshake_kinds = ["malformed", "version", "credentials", "unknown_simulation", "stale_attempt"]
    expected = {k: 1 for k in frame_kinds} | {f"handshake_{k}": 1 for k in handshake_kinds}
    expected["malformed"] = 2  # a one-frame message and a declaration that is not JSON
    expected["handshake_malformed"] = 2  # not JSON, and two message parts
    expected["handshake_version"] = 2  # 99, and a 50,000-character version
    expected["handshake_credentials"] = 2  # a wrong token, and a lone surrogate
    assert rejected == expected
    assert "refused (credentials)" in run.log


def test_an_mpi_simulation_that_forgot_comm_fails_at_once_and_trains_on_no_half_field(
    tmp_path: Path, output: Path
) -> None:
    config = study_config(
        output,
        [sys.executable, TOY_SIM],  # no --mpi: every rank is "rank 0 of 1"
        launcher={"scheduler": "mpirun", "client_ranks": 2, "max_retries": 3},
    )
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == EXIT_FAILED_SIMULATIONS, run.log
    assert run.report is not None
    assert run.report["simulations"]["failed"] == 4 and run.report["samples_received"] == 0
    for sim in run.report["per_simulation"]:
        assert sim["attempts"] == 1, sim  # a relaunch would meet the same refusal
        assert "launcher.client_ranks is 2 (an MPI simulation that did not pass comm= to Client?)" in sim["reason"]


@pytest.mark.parametrize(
    "pinned, odd, declared",
    [
        (True, 0, "float32[4, 9]"),  # the configuration pins the layout before any simulation
        (False, 3, "float32[4, 9]"),  # simulations 0 and 1 pinned it
        (False, 3, "float64[4, 8]"),
    ],
)
def test_a_simulation_with_another_field_layout_fails_at_once_naming_both(
    tmp_path: Path, output: Path, pinned: bool, odd: int, declared: str
) -> None:
    dtype, shape = declared[:7], declared[8:-1].split(", ")
    command = [sys.executable, TOY_SIM, "--odd-simulation", str(odd), "--odd-dtype", dtype, "--odd-shape", *shape]
    config = study_config(output, command, launcher={"max_retries": 3})
    if pinned:
        config["study"]["fields"] = {"field": {"dtype": "float32", "shape": [4, 8]}}
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == EXIT_FAILED_SIMULATIONS, run.log
    assert run.report is not None
    assert run.report["simulations"] == {"queued": 0, "running": 0, "done": 3, "failed": 1}
    assert run.report["samples_received"] == 30
    failed = run.report["per_simulation"][odd]
    assert failed["attempts"] == 1
    assert f"simulation {odd}, field 'field': declares {declared}, the study's is float32[4, 8]" in failed["reason"]
