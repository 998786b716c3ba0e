"""Predictions while the model trains (``serving.online``, docs/how-to/use-the-model.md): the heat example's surrogate,
trained on 1 and 2 ranks, answers its simulations through ``Client.predict`` (``predicting_sim.py``): no model
before the first step, versioned answers after, no answer past a deadline, refusals here and there."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support import BIN, HERE, MPIRUN, run_server, server_command, start, wait_for
from test_trained_model import HEAT, NX, NY, STEPS, heat_config

from melissa_dl import Predictor, load_model
from melissa_dl.checkpoint.versions import latest_valid

pytestmark = pytest.mark.timeout(300)


def predicting_config(output: Path, record: Path) -> dict:
    """The heat study of ``predicting_sim.py``, served online; its simulations in turn."""
    config = heat_config(output)
    config["launcher"]["command"] = [
        sys.executable, str(HERE / "predicting_sim.py"), "--nx", str(NX), "--ny", str(NY), "--steps", str(STEPS),
        "--record", str(record),
    ]  # fmt: skip
    config["training"]["batch_size"] = 8
    config["launcher"]["job_limit"] = 1  # simulation 0 first, alone: nothing is trained before it asks
    # a request waits 0.2 s for others, so 1 ms is too short; any other waits as long as a busy machine needs
    config["serving"] = {"online": True, "max_wait": 0.2, "deadline": 60.0}
    return config


def records_of(record: Path) -> dict[int, dict]:
    return {int(path.stem[3:]): json.loads(path.read_text()) for path in record.glob("sim*.json")}


@pytest.mark.parametrize("ranks", [1, 2])
def test_simulations_ask_the_model_the_study_trains_and_get_its_versioned_answers(tmp_path: Path, ranks: int) -> None:
    output, record = tmp_path / "output", tmp_path / "record"
    record.mkdir()
    config = predicting_config(output, record)
    run = run_server(tmp_path, config, ranks=ranks, timeout=240)
    assert run.code == 0 and run.report is not None, run.log
    batches = run.report["training"]["batches"]

    records = records_of(record)
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


def test_the_assisted_heat_example_replaces_every_other_step_once_the_model_is_trained(tmp_path: Path) -> None:
    output, reports = tmp_path / "output", tmp_path / "reports"
    reports.mkdir()
    config = heat_config(output)
    config["launcher"]["command"] = [
        sys.executable, str(HEAT / "heat_assisted.py"), "--nx", str(NX), "--ny", str(NY), "--steps", str(STEPS),
        "--threshold", "1", "--deadline", "60", "--report", str(reports),
    ]  # fmt: skip
    config["launcher"]["job_limit"] = 1  # in turn: the later simulations find a model trained on the earlier ones
    config["training"]["batch_size"] = 8
    config["serving"] = {"online": True}
    run = run_server(tmp_path, config, ranks=2, timeout=240)
    assert run.code == 0, run.log
    assisted = {int(path.stem.split("-")[1]): json.loads(path.read_text()) for path in reports.glob("*.json")}
    assert sorted(assisted) == list(range(7))
    last = assisted[5]  # after the other five: a model answers every one of its questions
    assert last["replaced"] == list(range(1, STEPS, 2))
    for report in assisted.values():
        first = report["replaced"][0] if report["replaced"] else STEPS
        assert report["drift"][:first] == [0.0] * first  # the same solver until the model's first step
        assert all(0 <= drift < 1 for drift in report["drift"])  # a field near the solver's: kelvin, not noise


def trained_checkpoint(output: Path) -> bool:
    """Whether a checkpoint of a trained model is committed (a study's first may be of batch 0)."""
    version = latest_valid(output / "checkpoints")
    return version is not None and version.manifest["batch"] > 0


def test_after_a_restart_the_restored_model_answers_at_once(tmp_path: Path) -> None:
    """Rank 1 is killed once a checkpoint is committed; the supervisor restarts the server, and every simulation
    that asks the restarted one is answered from the restored model from its first question on, never told that
    no model exists."""
    output, record = tmp_path / "output", tmp_path / "record"
    record.mkdir()
    config = predicting_config(output, record)
    config["launcher"].update(server_timeout=20.0, max_server_restarts=1)
    config["checkpoint"] = {"interval": 20}
    command = server_command(tmp_path, config, 2)
    supervisor = start([sys.executable, "-m", "melissa_dl.supervisor", command[-1], "-n", "2"])
    wait_for(lambda: trained_checkpoint(output), supervisor, timeout=180)
    pid = int(re.search(r"server rank 1 of 2, pid (\d+)", (output / "logs" / "rank1.log").read_text()).group(1))
    os.kill(pid, signal.SIGKILL)
    log, _ = supervisor.communicate(timeout=240)
    assert supervisor.returncode == 0, log
    rank0 = (output / "logs" / "rank0.log").read_text()
    restored = int(re.search(r"resuming from checkpoint \S+ \(batch (\d+)", rank0).group(1))
    restarted = re.findall(r"handshake at (\S+),", rank0)[-1]
    after = [answers for answers in records_of(record).values() if answers["server"] == restarted]
    assert after, "no simulation asked the restarted server"
    for answers in after:
        status, version = answers["first"]
        assert status == "answered" and version >= restored > 0


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_c_simulation_asks_the_model_through_melissa_dl_predict(tmp_path: Path, native: Path, ranks: int) -> None:
    output, record = tmp_path / "output", tmp_path / "record"
    record.mkdir()
    config = predicting_config(output, record)
    config["launcher"]["command"] = [str(native / "c_predictor"), str(NX), str(NY), str(STEPS), str(record)]
    run = run_server(tmp_path, config, ranks=ranks, timeout=240)
    assert run.code == 0 and run.report is not None, run.log
    lines = {int(path.stem[1:]): path.read_text().splitlines() for path in record.glob("c*.txt")}
    assert sorted(lines) == list(range(7))
    assert lines[0][0] == "first 1" and lines[5][0] == "first 0"  # MELISSA_DL_NO_MODEL, then MELISSA_DL_ANSWERED
    said = dict(line.split(" ", 1) for line in lines[0][1:])
    version, mean = said["answered"].split()
    assert 1 <= int(version) <= run.report["training"]["batches"] and 0 < float(mean) < 1000
    assert said["late"] == "2"  # MELISSA_DL_NO_ANSWER
    status, again = said["again"].split()
    assert status == "0" and int(version) <= int(again)
    assert said["wrong"] == (
        "2 simulation 0: predict: output 'temperature' is float32 of 480 bytes, its buffer 240 bytes"
    )  # MELISSA_DL_ERR_ARGUMENT


def test_a_fortran_simulation_asks_the_model_through_the_module(tmp_path: Path, native: Path) -> None:
    output, record = tmp_path / "output", tmp_path / "record"
    record.mkdir()
    config = predicting_config(output, record)
    config["launcher"]["command"] = [str(native / "f_predictor"), str(NX), str(NY), str(STEPS), str(record)]
    run = run_server(tmp_path, config, ranks=2, timeout=240)
    assert run.code == 0 and run.report is not None, run.log
    lines = {int(path.stem[1:]): path.read_text().splitlines() for path in record.glob("f*.txt")}
    assert sorted(lines) == list(range(7))
    assert lines[0][0] == "first 1" and lines[5] == ["first 0"]  # MELISSA_DL_NO_MODEL, then MELISSA_DL_ANSWERED
    _, version, mean = lines[0][1].split()
    assert 1 <= int(version) <= run.report["training"]["batches"] and 0 < float(mean) < 1000


def test_after_the_study_melissa_server_serve_answers_a_predictor_and_again_after_a_restart(
    tmp_path: Path, native: Path
) -> None:
    output = tmp_path / "output"
    config = heat_config(output)
    config["training"]["batch_size"] = 8
    run = run_server(tmp_path, config, ranks=2, timeout=240)
    assert run.code == 0 and run.report is not None, run.log
    serving = output / "serving.json"
    command = [str(MPIRUN), "-n", "2", str(BIN / "melissa-server"), "--serve", str(output)]
    server = start(command)
    wait_for(serving.exists, server)
    assert serving.stat().st_mode & 0o777 == 0o600  # it holds the credentials
    question = {"parameters": np.array([[150, 250, 350, 450, 200]], np.float32), "time_step": np.array([7], np.float32)}
    model = load_model(output)
    with torch.no_grad():
        expected = model.predict({name: torch.from_numpy(array) for name, array in question.items()})["temperature"]
    with Predictor(output) as predictor:
        for _ in range(2):  # both ranks, in turn
            answer = predictor.predict(question, deadline=60)
            assert (answer.status, answer.version) == ("answered", run.report["training"]["batches"])
            np.testing.assert_allclose(answer.outputs["temperature"], expected.numpy(), rtol=1e-6)
        asked = subprocess.run(  # from C, with no study around: MELISSA_SERVING
            [str(native / "c_served"), str(NX), str(NY)], env={**os.environ, "MELISSA_SERVING": str(serving)},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert asked.returncode == 0, asked.stderr
        status, version, mean = asked.stdout.split()
        assert (status, int(version)) == ("0", run.report["training"]["batches"])  # MELISSA_DL_ANSWERED
        assert float(mean) == pytest.approx(float(expected.mean()), rel=1e-5)
        server.send_signal(signal.SIGTERM)
        log, _ = server.communicate(timeout=60)
        assert server.returncode == 0, log
        assert predictor.predict(question, deadline=0.2).status == "no_answer"  # nobody serves
        published = serving.read_text()
        server = start(command)
        wait_for(lambda: serving.read_text() != published, server)  # the new ranks' endpoints
        stale = predictor.predict(question, deadline=1)  # to the old ranks: none, and the file is read again
        assert predictor.predict(question, deadline=60).status == "answered", stale
        server.send_signal(signal.SIGTERM)
        log, _ = server.communicate(timeout=60)
        assert server.returncode == 0, log
