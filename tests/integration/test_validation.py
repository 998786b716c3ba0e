"""Held-out simulations run by the study (``study.validation``): never trained on, validated on once whole."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from support import STEPS, committed, paced_config, run_server, server_command, start, wait_for
from test_fault_tolerance import final_ledgers

from melissa_dl.runtime.status import EXIT_STOPPED

pytestmark = pytest.mark.timeout(240)

HELD_OUT = [[0.125, 0.875], [0.625, 0.375]]
TRAINED = 6  # paced_config's simulations


def validated_config(output: Path) -> dict:
    config = paced_config(output)
    config["study"]["validation"] = {"parameters": HELD_OUT}
    config["training"].update(class_name="StudyValidated", options={"held_out": HELD_OUT}, nb_batches_update=4)
    return config


def assert_held_out_whole(output: Path, report: dict, log: str) -> None:
    simulations = TRAINED + len(HELD_OUT)
    assert report["simulations"]["done"] == simulations
    assert report["held_out"] == {"simulations": len(HELD_OUT), "samples": len(HELD_OUT) * STEPS}
    assert report["samples_received"] == simulations * STEPS == report["samples_expected"]
    assert report["samples_consumed"] <= TRAINED * STEPS  # held-out samples never reach a buffer
    held = [{(s, t) for s in ledger.simulations() for t in ledger.steps(s)} for ledger in final_ledgers(output)]
    assert sum(map(len, held)) == simulations * STEPS and len(set().union(*held)) == simulations * STEPS
    assert [p["parameters"] for p in report["per_simulation"][TRAINED:]] == [{"a": a, "b": b} for a, b in HELD_OUT]
    assert f"held-out set: {len(HELD_OUT) * STEPS} samples" in log
    batches = report["training"]["batches"]
    expected = sorted({*range(4, batches + 1, 4), batches})  # every nb_batches_update, and the last
    assert [b for b, _ in report["training"]["validation"]][-len(expected) :] == expected
    assert len(report["training"]["validation"]) == len(expected) + 1  # and one when the held-out set was whole


def test_held_out_simulations_are_run_first_never_trained_on_and_validate_the_model(
    tmp_path: Path, output: Path
) -> None:
    config = validated_config(output)
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None
    assert_held_out_whole(output, run.report, run.log)
    simulations = TRAINED + len(HELD_OUT)  # the first line, the status lines and the report count them alike
    assert f"study of {simulations} simulations ({len(HELD_OUT)} held out), handshake at" in run.log
    assert f" failed of {simulations} | " in run.log
    assert f"{simulations}/{simulations} simulations done ({len(HELD_OUT)} held out)" in run.log


@pytest.mark.parametrize("after", [2, 1])
def test_the_held_out_set_survives_a_stop_and_a_restart_on_other_ranks(
    tmp_path: Path, output: Path, after: int
) -> None:
    config = validated_config(output)
    config["checkpoint"] = {"interval": 0}  # checkpoints when simulations end: the held-out ones are first
    process = start(server_command(tmp_path, config, 2))
    wait_for(lambda: committed(output) and "held-out set" in (output / "logs" / "rank0.log").read_text(), process)
    process.send_signal(signal.SIGTERM)
    log, _ = process.communicate(timeout=60)
    assert process.returncode == EXIT_STOPPED, log
    run = run_server(tmp_path, config, ranks=after)
    assert run.code == 0, run.log
    assert run.report is not None
    assert "resuming from checkpoint" in run.log
    assert_held_out_whole(output, run.report, run.log)
