"""The Gray-Scott example: its solver keeps both fields in [0, 1] and is deterministic; its surrogate takes
windows as views and rolls a trajectory out."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from melissa_dl.buffers.sample import Sample

FOLDER = Path(__file__).parents[3] / "examples" / "reaction_diffusion"


def load(name: str, alias: str) -> object:
    """The example's module ``name``, under a name of its own (the heat example's tests import its solver.py as
    "solver"); the surrogate's ``from solver import`` gets this example's solver."""
    spec = importlib.util.spec_from_file_location(alias, FOLDER / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SOLVER = load("solver", "reaction_diffusion_solver")


def test_the_solver_is_deterministic_and_keeps_both_fields_between_0_and_1() -> None:
    first = SOLVER.GrayScott(0.04, 0.06, 0.3, n=32, substeps=10).solve(12)  # type: ignore[attr-defined]
    again = SOLVER.GrayScott(0.04, 0.06, 0.3, n=32, substeps=10).solve(12)  # type: ignore[attr-defined]
    assert first.shape == (12, 2, 32, 32) and first.dtype == np.float32
    np.testing.assert_array_equal(first, again)
    assert first.min() >= 0.0 and first.max() <= 1.0
    assert not np.array_equal(first[0], first[-1])  # it moves


def test_the_surrogate_takes_windows_as_views_and_rolls_a_trajectory_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "solver", SOLVER)
    surrogate = load("surrogate", "reaction_diffusion_surrogate").GrayScottSurrogate(inputs=4)  # type: ignore[attr-defined]
    surrogate.window = SimpleNamespace(inputs=4, targets=1)
    steps = SOLVER.GrayScott(0.04, 0.06, 0.3, n=16, substeps=5).solve(9)  # type: ignore[attr-defined]
    window = Sample(0, 0, np.array([0.04, 0.06, 0.3]), {"u": steps[:5, 0], "v": steps[:5, 1]})
    u, v, target_u, target_v, rates = surrogate.process(window)
    assert np.shares_memory(u, window.fields["u"]) and np.shares_memory(target_v, window.fields["v"])
    assert (u.shape, target_u.shape, rates.shape) == ((4, 16, 16), (1, 16, 16), (2,))
    loss = surrogate.training_step([torch.from_numpy(np.stack([a])) for a in (u, v, target_u, target_v, rates)])
    assert loss.ndim == 0 and torch.isfinite(loss)
    surrogate.eval()
    first = Sample(0, 0, window.parameters, {"u": steps[:4, 0], "v": steps[:4, 1]})
    with torch.no_grad():
        predicted = surrogate.rollout(first, 5)
    assert predicted["u"].shape == (5, 16, 16) and predicted["v"].shape == (5, 16, 16)
    assert 0.0 <= predicted["u"].min() and predicted["u"].max() <= 1.0
