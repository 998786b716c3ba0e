"""Online training in whole studies: TensorBoard, lockstep stop, failures."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from support import HERE, TOY_SIM, run_server, study_config
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from melissa_dl import load_model
from melissa_dl.runtime.metrics import TRAIN_LOSS, VALIDATION_LOSS
from melissa_dl.runtime.status import EXIT_FAILED_SIMULATIONS
from melissa_dl.study.plots import BUFFERS, INTAKE, LOSS, SIMULATIONS

pytestmark = pytest.mark.timeout(180)

SCALARS = {  # every rank's (the validation loss is rank 0's alone: one series)
    TRAIN_LOSS,
    "training/batches_per_s",
    "training/samples_per_s",
    "training/learning_rate",
    "stream/buffer_samples",
    "stream/put_waiting",
    "stream/get_waiting",
    "stream/received_bytes_per_s",
    "system/rss_mb",
}


def training(**options: object) -> dict:
    return {
        "module": str(HERE / "tiny_module.py"),
        "class_name": "Tiny",
        "options": options,
        "batch_size": 4,
        "nb_batches_update": 5,
        "log_interval": 1,
        "device": "cpu",
    }


def test_tensorboard_shows_the_modules_own_scalar_the_learning_rate_one_validation_series_and_a_picture(
    tmp_path: Path, output: Path
) -> None:
    """What ML users look for first (issue 57, item 1), in the event files of a 2-rank study."""
    config = study_config(
        output,
        [sys.executable, TOY_SIM, "--steps", "20"],
        study={"time_steps": 20},
        buffer={"kind": "reservoir", "capacity_samples": 40, "per_server_watermark": 8},
    )
    config["training"] = {**training(), "class_name": "Pictured"}
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None
    validated = [batches for batches, _ in run.report["training"]["validation"]]
    events = []
    for rank in (0, 1):
        events.append(EventAccumulator(str(output / "tensorboard" / f"rank{rank}"), size_guidance={"images": 0}))
        events[rank].Reload()
        scalars = set(events[rank].Tags()["scalars"])
        assert {"module/target_mean", "training/learning_rate"} <= scalars, (rank, scalars)
        assert [e.value for e in events[rank].Scalars("training/learning_rate")] == pytest.approx([1e-2] * len(
            events[rank].Scalars("training/learning_rate")))  # fmt: skip
        assert all(0 <= e.value < 4 for e in events[rank].Scalars("module/target_mean"))  # toy_sim's field / 1000
    assert [e.step for e in events[0].Scalars(VALIDATION_LOSS)] == validated  # one series: rank 0's
    assert VALIDATION_LOSS not in events[1].Tags()["scalars"]
    pictures = events[0].Images("validation/prediction")
    assert [p.step for p in pictures] == validated and pictures[-1].width > 300, pictures[-1]
    assert "validation/prediction" not in events[1].Tags()["images"]
    assert "config/text_summary" in events[0].Tags()["tensors"]  # the configuration, as text
    assert "_hparams_/session_start_info" in events[0].PluginTagToContent("hparams")  # and its hyperparameters


def stopped_at(output: Path, rank: int) -> int:
    found = re.search(r"training stopped after (\d+) batches", (output / "logs" / f"rank{rank}.log").read_text())
    assert found, f"rank {rank} did not log its stop"
    return int(found.group(1))


def test_training_logs_every_scalar_on_every_rank_and_saves_the_model(tmp_path: Path, output: Path) -> None:
    config = study_config(
        output,
        [sys.executable, TOY_SIM, "--steps", "20"],
        study={"time_steps": 20},
        buffer={"kind": "reservoir", "capacity_samples": 40, "per_server_watermark": 8},
    )
    config["training"] = training()
    config["plots"] = True
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None
    summary = run.report["training"]
    assert summary["batches"] > 0 and summary["samples_trained"] == 2 * 4 * summary["batches"]
    assert summary["validation"][0][0] == 0 and len(summary["validation"]) >= 2
    for rank in (0, 1):
        events = EventAccumulator(str(output / "tensorboard" / f"rank{rank}"))
        events.Reload()
        assert SCALARS <= set(events.Tags()["scalars"]), rank
        assert (VALIDATION_LOSS in events.Tags()["scalars"]) == (rank == 0), rank
    state = torch.load(output / "model.pt")
    assert set(state) == {"net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"}
    assert (output / "config.json").exists()
    saved = json.loads((output / "model.json").read_text())  # what rebuilds it: Tiny declares no prediction inputs
    assert saved["class_name"] == "Tiny" and saved["batches"] == summary["batches"] and saved["torchscript"] is None
    model = load_model(output)
    assert type(model).__name__ == "Tiny" and not model.training and not (output / "model.ts").exists()
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(tensor, state[name], rtol=0, atol=0, msg=name)
    log = (output / "logs" / "rank0.log").read_text()  # a library's INFO lines stay out (issue 13, item 5)
    assert "chatty_library: a WARNING it should" in log and "an INFO line" not in log
    assert "optimizer Adam sharded: each of the 2 ranks steps 1/2 of every parameter" in log
    cores, simulations = len(os.sched_getaffinity(0)), config["launcher"]["job_limit"]  # local: they share our cores
    assert (
        f"torch threads per rank (intra- and inter-op): {max(1, (cores - simulations) // 2)} on 2 ranks (the cores "
        f"each rank may use, less {simulations} simulation ranks at once on rank 0's node"
    ) in log
    pictures = [output / name for name in (INTAKE, BUFFERS, SIMULATIONS, LOSS)]
    assert all(path.stat().st_size > 0 for path in pictures) and f"plots: {', '.join(map(str, pictures))}" in run.log


def test_a_rank_that_runs_dry_stops_every_rank_at_the_same_batch(tmp_path: Path, output: Path) -> None:
    # simulations 0 and 2 go to rank 0, simulation 1 to rank 1: rank 1 runs dry first
    config = study_config(
        output,
        [sys.executable, TOY_SIM, "--steps", "40"],
        study={"simulations": 3, "time_steps": 40},
        server={"bind_simulation_to_server_rank": True},
        buffer={"kind": "fifo", "capacity_samples": 200, "per_server_watermark": 4},
    )
    config["training"] = {**training(), "threads": 1}
    run = run_server(tmp_path, config, ranks=2, timeout=120)
    assert run.code == 0, run.log
    assert run.report is not None
    assert stopped_at(output, 0) == stopped_at(output, 1) == run.report["training"]["batches"] > 0
    assert "torch threads per rank (intra- and inter-op): 1 on 2 ranks (training.threads)" in run.log
    assert run.report["samples_consumed"] < run.report["samples_received"] == 120


def test_a_user_exception_on_rank_1_ends_the_job_with_its_traceback(tmp_path: Path, output: Path) -> None:
    config = study_config(
        output,
        [sys.executable, TOY_SIM, "--steps", "40"],
        study={"time_steps": 40},
        buffer={"kind": "reservoir", "capacity_samples": 40, "per_server_watermark": 4},
    )
    config["training"] = training(fail_rank=1, fail_after=3)
    start = time.monotonic()
    run = run_server(tmp_path, config, ranks=2, timeout=60)
    assert run.code != 0
    assert time.monotonic() - start < 45
    for log in (run.log, (output / "logs" / "rank1.log").read_text()):  # the terminal and the rank's file
        assert "Traceback" in log and "ValueError: boom from the user's training_step" in log


def test_a_rank_starved_by_routing_ends_the_job_with_a_clear_error(tmp_path: Path, output: Path) -> None:
    # one simulation bound to rank 0, which fills up; rank 1 never gets a batch: lockstep cannot progress
    config = study_config(
        output,
        [sys.executable, TOY_SIM, "--steps", "200"],
        study={"simulations": 1, "time_steps": 200},
        server={"bind_simulation_to_server_rank": True},
        buffer={"kind": "fifo", "capacity_samples": 10, "per_server_watermark": 1},
    )
    config["training"] = {**training(), "stall_timeout": 3}
    run = run_server(tmp_path, config, ranks=2, timeout=60)
    assert run.code != 0
    assert "TrainingStalled: training stalled for 3 s: 1 of 2 ranks have no batch while 1 have a full buffer" in run.log


def test_a_study_whose_simulations_all_fail_stops_early_and_writes_no_model(tmp_path: Path, output: Path) -> None:
    """NaN from step 3 on: each simulation fails at once with the refusal as its reason (a relaunch would send
    the same NaN), the study stops after the first wave instead of running all six, and no untrained model.pt
    is written (issue 13, item 2)."""
    command = [sys.executable, TOY_SIM, "--nan-at", "3", "--step-delay", "0.05"]
    config = study_config(output, command, study={"simulations": 6}, launcher={"max_retries": 2, "job_limit": 1})
    config["training"] = training()
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == EXIT_FAILED_SIMULATIONS, run.log
    assert run.report is not None
    sims = run.report["per_simulation"]
    assert [s["attempts"] for s in sims[:3]] == [1, 1, 1] and run.report["simulations"]["failed"] == 6
    assert all(
        "exited with steps missing; its frames were refused: simulation" in s["reason"]
        and "NaN or infinite values" in s["reason"]
        for s in sims[:3]
    ), sims
    assert sims[0]["log"] == str(output / "simulations" / "simulation0.attempt0.log")
    assert run.report["stopped_early"] == "the first 3 simulations to end all failed"
    started = [s for s in range(3, 6) if (output / "simulations" / f"simulation{s}.attempt0.log").exists()]
    assert len(started) <= 1, started  # the rest never ran (the next one may have started)
    assert "stopping the study" in run.log and "no model written: no simulation succeeded" in run.log
    assert run.report["training"]["model"] is None and not (output / "model.pt").exists()
