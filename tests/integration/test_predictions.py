"""Predictions while the model trains (``serving.online``, docs/how-to/use-the-model.md): the heat example's surrogate,
trained on 1 and 2 ranks, answers its simulations through ``Client.predict`` (``predicting_sim.py``): no model
before the first step, versioned answers after, no answer past a deadline, refusals here and there."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support import HERE, run_server
from test_trained_model import NX, NY, STEPS, heat_config

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("ranks", [1, 2])
def test_simulations_ask_the_model_the_study_trains_and_get_its_versioned_answers(tmp_path: Path, ranks: int) -> None:
    output, record = tmp_path / "output", tmp_path / "record"
    record.mkdir()
    config = heat_config(output)
    config["launcher"]["command"] = [
        sys.executable, str(HERE / "predicting_sim.py"), "--nx", str(NX), "--ny", str(NY), "--steps", str(STEPS),
        "--record", str(record),
    ]  # fmt: skip
    config["training"]["batch_size"] = 8
    config["launcher"]["job_limit"] = 1  # simulation 0 first, alone: nothing is trained before it asks
    config["serving"] = {"online": True, "max_wait": 0.2}  # a request waits 0.2 s for others: 1 ms is too short
    run = run_server(tmp_path, config, ranks=ranks, timeout=240)
    assert run.code == 0 and run.report is not None, run.log
    batches = run.report["training"]["batches"]

    records = {int(path.stem[3:]): json.loads(path.read_text()) for path in record.glob("sim*.json")}
    assert sorted(records) == list(range(7))  # 6 and the held-out one, which asks as the others do
    assert records[0]["first"] == ["no_model", 0]  # after the held-out simulation 6 only, which is not trained on
    assert records[5]["first"][0] == "answered"  # launched after simulation 0 got its answers
    for answers in records.values():
        assert set(answers["during"]) <= {"no_model", "answered"} and len(answers["during"]) == STEPS // 2
    first = records[0]
    status, version, shape, finite = first["answered"]
    assert status == "answered" and 1 <= version <= batches and shape == [1, NX, NY] and finite
    assert first["late"] == "no_answer"
    assert first["again"][0] == "answered" and version <= first["again"][1] <= batches  # not the late one's answer
    assert first["refused_here"] == (
        "simulation 0: predict: inputs ['parameters'], the model's are ['parameters', 'time_step']"
    )
    refused = first["refused_there"]
    assert (refused["status"], refused["kind"]) == ("refused", "shape")
    assert "input 'parameters' is [1, 4], the model's is [n, 5]" in refused["error"]
    assert run.report["rejected"] == {"predict_shape": 1}
