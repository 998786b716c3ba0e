"""The Burgers example's solver: what the equation guarantees, so the active-sampling study learns a true field."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

# Under a name of its own: the heat example's tests import that example's solver.py as "solver".
SOLVER = Path(__file__).parents[3] / "examples" / "burgers" / "solver.py"
_spec = importlib.util.spec_from_file_location("burgers_solver", SOLVER)
assert _spec is not None and _spec.loader is not None
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
BurgersSolver = _module.BurgersSolver


def run(*parameters: float, **options: int) -> np.ndarray:
    solver = BurgersSolver(*parameters, **options)
    return np.stack([solver.step() for _ in range(solver.steps)])


@pytest.mark.parametrize(("a", "c", "nu"), [(1.0, 0.3, 0.001), (1.0, -0.5, 0.2), (0.5, 0.0, 0.01)])
def test_the_mean_is_conserved_and_the_maximum_principle_holds(a: float, c: float, nu: float) -> None:
    fields = run(a, c, nu, nx=128, steps=16)
    assert fields.shape == (16, 128) and fields.dtype == np.float32
    np.testing.assert_allclose(fields.mean(axis=1), c, atol=1e-5)
    assert np.abs(fields).max() <= abs(c) + a + 1e-5


def test_a_small_viscosity_makes_a_shock_and_a_large_one_a_smooth_field() -> None:
    sharp, smooth = run(1.0, 0.0, 0.001, nx=256)[-1], run(1.0, 0.0, 0.2, nx=256)[-1]
    assert np.abs(np.diff(sharp)).max() > 20 * np.abs(np.diff(smooth)).max()


def test_a_refined_solve_sends_the_same_field_closer_to_the_truth() -> None:
    coarse, fine, finest = (run(1.0, 0.2, 0.05, nx=64, steps=8, refine=r)[-1] for r in (1, 2, 8))
    assert np.abs(fine - finest).max() < np.abs(coarse - finest).max() < 0.05


def test_it_refuses_a_step_past_its_end() -> None:
    solver = BurgersSolver(1.0, 0.0, 0.1, nx=16, steps=1)
    solver.step()
    with pytest.raises(RuntimeError, match="only 1 steps"):
        solver.step()
