"""The offline baseline (examples/heat_pde/offline.py) that bench/online_vs_offline.py measures against.

It must generate what the study would (refined solver, diffusivity), train the
same module on every stored sample, and report a curve with wall times and a
model that loads back, or the comparison measures something else.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support import clean_environment

from melissa_dl.train.module import load_module_class

pytestmark = pytest.mark.timeout(120)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "heat_pde"


def test_offline_trains_on_the_refined_six_parameter_study_and_saves_its_model(tmp_path: Path) -> None:
    config = json.loads((EXAMPLE / "config.json").read_text())
    config["study"].update(simulations=3, time_steps=4)
    config["study"]["parameters"].append({"name": "diffusivity", "low": 0.5, "high": 2.0})
    config["launcher"]["command"] = ["python", "heat.py", "--nx", "9", "--ny", "7", "--steps", "4", "--refine", "2"]
    config["training"].update(module=str(EXAMPLE / "surrogate.py"), batch_size=4, nb_batches_update=5)
    options = {
        "hidden": 8,
        "depth": 1,
        "nx": 9,
        "ny": 7,
        "steps": 4,
        "diffusivity": [0.5, 2.0],
        "refine": 2,
        "validation_simulations": 2,
    }
    config["training"]["options"] = options
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    done = subprocess.run(
        [
            sys.executable,
            str(EXAMPLE / "offline.py"),
            "--config",
            str(path),
            "--batches",
            "12",
            "--threads",
            "1",
            "--output",
            str(tmp_path / "out"),
            "--save-model",
            str(tmp_path / "model.pt"),
            "--quiet",
        ],
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["simulations"] == 3 and report["samples"] == 12
    stored = np.load(tmp_path / "out" / "simulations" / "simulation1.npy")
    surrogate = load_module_class(EXAMPLE / "surrogate.py", "HeatSurrogate")  # puts solver.py on the path
    from solver import HeatSolver

    reference = HeatSolver(np.load(tmp_path / "out" / "parameters.npy")[1], 9, 7, refine=2)
    np.testing.assert_array_equal(stored, [reference.step() for _ in range(4)])
    training = report["training"]
    assert training["batches"] == 12 and training["samples_trained"] == 48  # 4 epochs of 3 full batches
    assert [point[0] for point in training["validation"]] == [0, 5, 10, 12]
    times = [point[2] for point in training["validation"]]
    assert times == sorted(times) and 0 < times[0] < report["total_s"]
    module = surrogate(**options)
    module.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))
