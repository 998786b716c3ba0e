"""Parameter tables: shape, bounds, determinism across ranks, spread, explicit lists."""
from __future__ import annotations

import numpy as np
import pytest

from launcher.samplers import draw_parameters

pytestmark = pytest.mark.timeout(60)

LOW = [-1.0, 0.0, 10.0]
HIGH = [1.0, 0.5, 20.0]


@pytest.mark.parametrize("sampler", ["uniform", "sobol"])
def test_random_samplers_have_shape_dtype_and_bounds(sampler: str) -> None:
    table = draw_parameters(sampler, 50, LOW, HIGH, seed=3)
    assert table.shape == (50, 3)
    assert table.dtype == np.float64
    assert np.all(table >= LOW) and np.all(table <= HIGH)
    assert len(np.unique(table[:, 0])) == 50


@pytest.mark.parametrize("sampler", ["uniform", "sobol"])
def test_same_seed_same_table_other_seed_other_table(sampler: str) -> None:
    first = draw_parameters(sampler, 16, LOW, HIGH, seed=7)
    np.testing.assert_array_equal(first, draw_parameters(sampler, 16, LOW, HIGH, seed=7))
    assert not np.array_equal(first, draw_parameters(sampler, 16, LOW, HIGH, seed=8))


def test_uniform_is_numpy_default_rng() -> None:
    expected = np.random.default_rng(5).uniform(LOW, HIGH, size=(4, 3))
    np.testing.assert_array_equal(draw_parameters("uniform", 4, LOW, HIGH, seed=5), expected)


def test_equal_bounds_fix_a_parameter() -> None:
    table = draw_parameters("sobol", 8, [2.0, 0.0], [2.0, 1.0], seed=0)
    assert np.all(table[:, 0] == 2.0)


@pytest.mark.parametrize("seed", range(5))
def test_sobol_puts_one_point_per_interval(seed: int) -> None:
    points = np.sort(draw_parameters("sobol", 8, [0.0], [1.0], seed)[:, 0])
    np.testing.assert_array_equal(np.floor(points * 8), np.arange(8))


@pytest.mark.parametrize("seed", range(5))
def test_sobol_puts_one_point_per_grid_cell_in_2d(seed: int) -> None:
    points = draw_parameters("sobol", 16, [0.0, -2.0], [1.0, 2.0], seed)
    cells = {(int(x * 4), int(y + 2.0)) for x, y in points}
    assert len(cells) == 16


def test_list_passes_values_through() -> None:
    values = [[1.0, 2.0], [3.0, 4.0], [5, 6]]
    table = draw_parameters("list", 3, [0.0, 0.0], [9.0, 9.0], seed=0, values=values)
    assert table.dtype == np.float64
    np.testing.assert_array_equal(table, np.array(values, dtype=np.float64))
