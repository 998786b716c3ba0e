"""Adaptive sampling in whole studies: what it draws, and the same draws after a kill -9 and a restart on another K.

The module's loss per sample (``Hardness.sample_losses``) is its simulation's
first parameter squared, whatever the model: the parameters an adaptive
sampler draws then depend on nothing that timing could change, so a study
killed and resumed must draw exactly what one run in one go draws.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from support import HERE, TOY_SIM, Run, run_server, server_command, start, study_config, wait_for
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from melissa_dl.checkpoint.serialization import loads
from melissa_dl.checkpoint.versions import latest_valid

pytestmark = pytest.mark.timeout(300)

SIMULATIONS = 16
BURGERS = HERE.parent.parent / "examples" / "burgers"


def adaptive_config(output: Path) -> dict[str, Any]:
    return study_config(
        output,
        [sys.executable, TOY_SIM, "--steps", "6", "--step-delay", "0.1"],
        study={
            "simulations": SIMULATIONS,
            "time_steps": 6,
            "sampler": "adaptive",
            "seed": 5,
            "adaptive": {
                "population": 2,
                "breed_after": 4,
                "lag": 2,
                "window": 6,
                "sigma": 0.05,
                "start": 0.5,
                "end": 1.0,
                "breakpoint": 3,
            },
        },
        buffer={"kind": "reservoir", "capacity_samples": 1000},
        launcher={"job_limit": 2},
        training={
            "module": str(HERE / "tiny_module.py"),
            "class_name": "Hardness",
            "batch_size": 4,
            "nb_batches_update": 1000,
            "log_interval": 1,
            "device": "cpu",
            "seed": 3,
        },
        checkpoint={"interval": 2},
    )


def draws(report: dict[str, Any]) -> list[tuple[Any, ...]]:
    return [(s["parameters"], s["generation"], s["parent"]) for s in report["per_simulation"]]


def drawn_in_checkpoint(output: Path) -> int:
    """Simulations whose parameters the newest committed checkpoint's sampler had drawn."""
    version = latest_valid(output / "checkpoints")
    return 0 if version is None else loads(version.read(0, "study.pt"))["simulations"]["sampler"]["drawn"]


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], tuple[Run, Path]]:
    """The adaptive study run in one go on K ranks, once per K for the module's tests that read or compare with
    it (a study takes ~17 s): ``whole(K)`` gives its run and its output folder."""
    runs: dict[int, tuple[Run, Path]] = {}

    def on(ranks: int) -> tuple[Run, Path]:
        if ranks not in runs:
            folder = tmp_path_factory.mktemp(f"whole{ranks}")
            run = run_server(folder, adaptive_config(folder / "output"), ranks=ranks)
            assert run.code == 0 and run.report is not None, run.log
            runs[ranks] = run, folder / "output"
        return runs[ranks]

    return on


def test_an_adaptive_study_breeds_where_the_loss_is_high_and_reports_it(
    whole: Callable[[int], tuple[Run, Path]],
) -> None:
    run, output = whole(2)
    assert run.report is not None and run.report["simulations"]["done"] == SIMULATIONS
    sims = run.report["per_simulation"]
    mismatched = [(s["id"], s["statistic"]) for s in sims if s["statistic"] != pytest.approx(s["parameters"]["a"] ** 2)]
    assert not mismatched
    assert [s["generation"] for s in sims] == [0] * 4 + [g for g in range(1, 7) for _ in range(2)]
    bred = [s for s in sims if s["parent"] is not None]
    assert len(bred) >= 6 and all(s["generation"] >= 1 for s in bred)
    for s in bred:  # each child is a small mutation of a parent from before its generation's lag
        parent = sims[s["parent"]]
        assert parent["id"] < s["id"] - 2 and abs(parent["parameters"]["a"] - s["parameters"]["a"]) < 0.3
    base = [s["parameters"]["a"] for s in sims if s["parent"] is None]
    assert sum(s["parameters"]["a"] for s in bred) / len(bred) > sum(base) / len(base)  # toward high a**2
    events = EventAccumulator(str(output / "tensorboard" / "rank0"), size_guidance={"images": 0})
    events.Reload()
    fractions = {e.step: e.value for e in events.Scalars("sampling/bred_fraction")}
    assert fractions == {
        g: pytest.approx(
            sum(s["parent"] is not None for s in sims if s["generation"] == g) / sum(s["generation"] == g for s in sims)
        )
        for g in range(7)
    }
    assert [e.step for e in events.Images("sampling/generations")] == list(range(7))


@pytest.mark.parametrize(("before", "after"), [(1, 2), (2, 1)])
def test_an_adaptive_study_killed_and_resumed_on_another_k_draws_what_one_run_in_one_go_draws(
    tmp_path: Path, whole: Callable[[int], tuple[Run, Path]], before: int, after: int
) -> None:
    output = tmp_path / "output"
    config = adaptive_config(output)
    server = start(server_command(tmp_path, config, before))
    wait_for(lambda: 8 <= drawn_in_checkpoint(output) < SIMULATIONS, server)  # a bred generation drawn, not all
    last = before - 1
    pid = int(
        re.search(
            rf"server rank {last} of {before}, pid (\d+)", (output / "logs" / f"rank{last}.log").read_text()
        ).group(1)
    )
    os.kill(pid, signal.SIGKILL)
    log, _ = server.communicate(timeout=60)
    assert server.returncode != 0, log
    assert not (output / "report.json").exists()

    resumed = run_server(tmp_path, config, ranks=after)
    assert resumed.code == 0, resumed.log
    assert "resuming from checkpoint" in resumed.log
    assert resumed.report is not None and resumed.report["simulations"]["done"] == SIMULATIONS
    assert draws(resumed.report) == draws(whole(before)[0].report)


def test_the_burgers_example_breeds_toward_small_viscosities(tmp_path: Path) -> None:
    """The example's own program and surrogate, shrunk (24 cheap simulations, 2 ranks): its per-sample
    losses steer the study into the slab of small viscosities, where the shocks are."""
    config = json.loads((BURGERS / "config.json").read_text())
    config.pop("$schema")
    config["output_dir"] = str(tmp_path / "output")
    config["study"].update(simulations=24, time_steps=8)
    config["study"]["adaptive"].update(population=4, breed_after=8, lag=2, window=8, breakpoint=2)
    config["launcher"]["command"] = [sys.executable, str(BURGERS / "burgers.py"), "--nx", "64", "--steps", "8"]
    config["buffer"]["per_server_watermark"] = 8  # each rank trains on the first generation's 32 samples
    training = config["training"]
    training.update(module=str(BURGERS / "surrogate.py"), batch_size=16, nb_batches_update=100, device="cpu")
    training["options"].update(hidden=32, nx=64, steps=8, refine=1, validation_simulations=4)
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None and run.report["simulations"]["done"] == 24
    sims = run.report["per_simulation"]
    assert all(s["statistic"] is not None and s["statistic"] > 0 for s in sims), [s["statistic"] for s in sims]
    low, high = config["study"]["parameters"][1]["low"], config["study"]["parameters"][1]["high"]
    hard = low + 0.1 * (high - low)
    base = [s["parameters"]["nu"] < hard for s in sims if s["parent"] is None]
    bred = [s["parameters"]["nu"] < hard for s in sims if s["parent"] is not None]
    assert len(bred) >= 8 and sum(bred) / len(bred) > 2 * sum(base) / len(base)


def test_an_adaptive_study_on_persistent_workers_draws_what_one_process_per_simulation_draws(
    tmp_path: Path, whole: Callable[[int], tuple[Run, Path]]
) -> None:
    """The sampler learns as with a process per simulation: workers change when simulations start, not what
    training makes of them."""
    (tmp_path / "workers").mkdir()
    each = whole(2)[0]
    config = adaptive_config(tmp_path / "workers" / "output")
    config["launcher"].update(
        persistent=True, command=[sys.executable, str(HERE / "toy_worker.py"), "--steps", "6", "--solve", "0.6"]
    )
    workers = run_server(tmp_path / "workers", config, ranks=2)
    assert workers.code == 0, workers.log
    assert each.report is not None and workers.report is not None
    assert workers.report["simulations"]["done"] == SIMULATIONS
    assert draws(workers.report) == draws(each.report)
    logs = (tmp_path / "workers" / "output" / "simulations").glob("worker*.start*.log")
    assert len(list(logs)) == 2  # job_limit 2 workers ran all 16 simulations
