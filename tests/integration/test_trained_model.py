"""The model a study trained, given back (docs/how-to/use-the-model.md): the heat example's surrogate, trained on 2
ranks, answers the same in this Python session (``load_model``) and from C++ through its TorchScript file
(``examples/heat_pde/predict.cpp``, built against the LibTorch inside the venv's torch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from support import ROOT, require_system_packages, run_server

from melissa_dl import load_model

pytestmark = pytest.mark.timeout(300)

HEAT = ROOT / "examples" / "heat_pde"
NX, NY, STEPS = 12, 10, 20
QUESTION = (7, [150.0, 250.0, 350.0, 450.0, 200.0])  # a step, the five temperatures


def heat_config(output: Path) -> dict:
    """The heat example's study, smaller: 6 simulations of 20 steps on a 12 x 10 grid, from any folder."""
    config = json.loads((HEAT / "config.json").read_text())
    config["output_dir"] = str(output)
    config["study"].update(simulations=6, time_steps=STEPS, validation={"simulations": 1, "seed": 1})
    config["launcher"]["command"] = [
        sys.executable, str(HEAT / "heat.py"), "--nx", str(NX), "--ny", str(NY), "--steps", str(STEPS)
    ]  # fmt: skip
    config["buffer"].update(per_server_watermark=8)
    config["training"].update(module=str(HEAT / "surrogate.py"), device="cpu", nb_batches_update=20)
    config["training"]["options"].update(nx=NX, ny=NY, steps=STEPS, hidden=32, depth=2)
    return config


def test_the_heat_surrogate_a_study_trained_answers_the_same_in_python_and_in_cpp(tmp_path: Path) -> None:
    require_system_packages("native")
    output = tmp_path / "output"
    run = run_server(tmp_path, heat_config(output), ranks=2, timeout=240)
    assert run.code == 0 and run.report is not None, run.log
    saved = json.loads((output / "model.json").read_text())
    assert saved["batches"] == run.report["training"]["batches"] > 0
    assert saved["inputs"] == {"parameters": ["float32", [5]], "time_step": ["float32", []]}
    assert saved["outputs"] == ["temperature"] and saved["torchscript"] == "model.ts"

    model = load_model(output)
    step, temperatures = QUESTION
    with torch.no_grad():
        answer = model.predict({"parameters": torch.tensor([temperatures]), "time_step": torch.tensor([float(step)])})
    field = answer["temperature"][0].numpy()
    assert field.shape == (NX, NY) and 100 < field.mean() < 500  # trained: the range of the boundary temperatures

    torch_folder = Path(torch.__file__).parent
    build = subprocess.run(
        ["make", "-C", str(HEAT), "predict", f"BIN={tmp_path}", f"TORCH={torch_folder}"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert build.returncode == 0, build.stdout + build.stderr
    asked = subprocess.run(
        [str(tmp_path / "heat_predict"), str(output / "model.ts"), str(step), *map(str, temperatures)],
        capture_output=True, text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert asked.returncode == 0, asked.stderr
    from_cpp = np.array([[float(value) for value in line.split()] for line in asked.stdout.splitlines()])
    np.testing.assert_allclose(from_cpp, field, rtol=1e-5, atol=1e-3)  # printed with 4 decimals
