"""Samplers: bounds, determinism, space filling, restore mid-study, and the adaptive sampler's breeding."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import qmc

from launcher.samplers import AdaptiveSampler, Breeding, HaltonSampler, ListSampler, Sampler, SobolSampler
from melissa_dl.checkpoint import serialization
from melissa_dl.config.registry import SAMPLERS, SPACE_FILLING, load

pytestmark = pytest.mark.timeout(60)

LOW = [-1.0, 0.0, 10.0]
HIGH = [1.0, 0.5, 20.0]
KINDS = sorted(SPACE_FILLING)


def space_filling(kind: str, low: list[float], high: list[float], seed: int, simulations: int) -> Sampler:
    """The space-filling sampler ``kind`` (a name of the registry's ``SPACE_FILLING``)."""
    found: type[Sampler] = load(SPACE_FILLING, kind, "study.sampler")
    return found(low, high, seed, simulations)


def draw(kind: str, count: int, low: list[float] = LOW, high: list[float] = HIGH, seed: int = 0) -> np.ndarray:
    return space_filling(kind, low, high, seed, count).ask(count)


@pytest.mark.parametrize("kind", KINDS)
def test_space_filling_samplers_have_shape_dtype_and_bounds(kind: str) -> None:
    table = draw(kind, 50, seed=3)
    assert table.shape == (50, 3) and table.dtype == np.float64
    assert np.all(table >= LOW) and np.all(table <= HIGH)
    assert len(np.unique(table[:, 0])) == 50


@pytest.mark.parametrize("kind", KINDS)
def test_same_seed_same_table_other_seed_other_table(kind: str) -> None:
    first = draw(kind, 16, seed=7)
    np.testing.assert_array_equal(first, draw(kind, 16, seed=7))
    assert not np.array_equal(first, draw(kind, 16, seed=8))


@pytest.mark.parametrize("kind", KINDS)
def test_asking_in_chunks_draws_the_same(kind: str) -> None:
    whole = draw(kind, 20, seed=4)
    sampler = space_filling(kind, LOW, HIGH, 4, 20)
    np.testing.assert_array_equal(np.vstack([sampler.ask(3), sampler.ask(5), sampler.ask(12)]), whole)
    assert sampler.ask(1).shape == (0, 3)  # the study's end


def test_uniform_is_numpy_default_rng() -> None:
    np.testing.assert_array_equal(draw("uniform", 4, seed=5), np.random.default_rng(5).uniform(LOW, HIGH, size=(4, 3)))


@pytest.mark.parametrize("kind", KINDS)
def test_equal_bounds_fix_a_parameter(kind: str) -> None:
    assert np.all(draw(kind, 8, [2.0, 0.0], [2.0, 1.0])[:, 0] == 2.0)


@pytest.mark.parametrize("seed", range(5))
def test_sobol_puts_one_point_per_interval_and_per_grid_cell(seed: int) -> None:
    points = np.sort(draw("sobol", 8, [0.0], [1.0], seed)[:, 0])
    np.testing.assert_array_equal(np.floor(points * 8), np.arange(8))
    cells = {(int(x * 4), int(y + 2.0)) for x, y in draw("sobol", 16, [0.0, -2.0], [1.0, 2.0], seed)}
    assert len(cells) == 16


@pytest.mark.parametrize("seed", range(5))
def test_lhs_puts_one_simulation_in_each_slice_of_every_parameter(seed: int) -> None:
    unit = (draw("lhs", 24, seed=seed) - LOW) / (np.array(HIGH) - LOW)
    for column in unit.T:
        np.testing.assert_array_equal(np.sort(np.floor(column * 24)), np.arange(24))


@pytest.mark.parametrize("kind", ["sobol", "halton", "lhs"])
def test_low_discrepancy_kinds_fill_the_box_more_evenly_than_random_points(kind: str) -> None:
    def discrepancy(table: np.ndarray) -> float:
        return float(qmc.discrepancy((table - LOW) / (np.array(HIGH) - LOW)))

    random = np.median([discrepancy(draw("uniform", 64, seed=s)) for s in range(5)])
    assert np.median([discrepancy(draw(kind, 64, seed=s)) for s in range(5)]) < random / 2


def test_list_passes_values_through() -> None:
    values = [[1.0, 2.0], [3.0, 4.0], [5, 6]]
    table = ListSampler([0.0, 0.0], [9.0, 9.0], 0, 3, values).ask(3)
    assert table.dtype == np.float64
    np.testing.assert_array_equal(table, np.array(values, dtype=np.float64))


class Corners(Sampler):
    """A user's sampler: the low corner, then the high one, and so on."""

    def __init__(self, low: list[float], high: list[float], seed: int, simulations: int, flip: bool = False) -> None:
        super().__init__(low, high, seed, simulations)
        self.flip = flip

    def _draw(self, count: int) -> np.ndarray:
        return np.array(
            [self.high if (i % 2 == 1) != self.flip else self.low for i in range(self.drawn, self.drawn + count)]
        )


def test_a_custom_sampler_is_built_with_its_options() -> None:
    table = Corners([0.0], [1.0], 0, 4, flip=True).ask(4)
    np.testing.assert_array_equal(table[:, 0], [1.0, 0.0, 1.0, 0.0])


# -- adaptive -------------------------------------------------------------------


def breeding(**changes: object) -> Breeding:
    settings = dict(
        population=4,
        breed_after=8,
        lag=2,
        window=6,
        sigma=[0.05, 0.05],
        start=0.5,
        end=1.0,
        breakpoint=3,
    )
    return Breeding(**{**settings, **changes})  # type: ignore[arg-type]


def test_generations_follow_the_ids_and_wait_for_their_candidates() -> None:
    sampler = AdaptiveSampler([0.0, 0.0], [1.0, 1.0], 1, 30, breeding(), HaltonSampler)
    assert [sampler.generation(s) for s in (0, 7, 8, 11, 12, 16)] == [0, 0, 1, 1, 2, 3]
    assert list(sampler.candidates(1)) == [0, 1, 2, 3, 4, 5] and list(sampler.candidates(3)) == [8, 9, 10, 11, 12, 13]
    assert sampler.ask(20).shape == (8, 2)  # generation 0, from the base; generation 1 waits
    for s in range(5):
        sampler.tell(s, 1.0)
    assert sampler.ask(20).shape == (0, 2)  # simulation 5 not told yet
    sampler.tell(5, None)  # failed: told, never a parent
    assert sampler.ask(6).shape == (4, 2)  # generation 1; generation 2 waits for its candidates 6 and 7
    assert sampler.drawn == 12
    assert [sampler.bred_fraction(g) for g in (0, 1, 2, 3, 9)] == [0.0, 0.5, 0.75, 1.0, 1.0]
    at_once = AdaptiveSampler([0.0], [1.0], 1, 30, breeding(sigma=[0.05], breakpoint=1), HaltonSampler)
    assert [at_once.bred_fraction(g) for g in (0, 1, 2)] == [0.0, 1.0, 1.0]  # end from generation breakpoint on
    assert sampler.generations() == {0: (range(0, 8), 0.0), 1: (range(8, 12), 0.5)}


def test_parents_are_chosen_in_proportion_to_their_statistic_and_children_stay_near_them() -> None:
    b = breeding(population=4000, breed_after=4, lag=0, window=4, sigma=[0.01, 0.01], start=1.0, end=1.0)
    sampler = AdaptiveSampler([0.0, 0.0], [1.0, 1.0], 2, 4004, b, HaltonSampler)
    parents = sampler.ask(4)
    for s, statistic in enumerate([0.0, 1.0, 3.0, None]):  # a known loss map: 0 never, 1 a quarter, 2 the rest
        sampler.tell(s, statistic)
    children = sampler.ask(4000)
    chosen = np.array([sampler.describe(s)["parent"] for s in range(4, 4004)])
    counts = np.bincount(chosen, minlength=4)
    assert counts[0] == 0 and counts[3] == 0
    assert abs(counts[2] / counts[1] - 3.0) < 0.35
    offsets = children - parents[chosen]
    assert np.all(np.abs(offsets) < 0.06)  # 6 sigma
    inner = np.all((parents[chosen] > 0.05) & (parents[chosen] < 0.95), axis=1)  # no clipping near the walls
    np.testing.assert_allclose(offsets[inner].std(axis=0), [0.01, 0.01], rtol=0.1)
    assert {sampler.describe(s)["generation"] for s in range(4, 4004)} == {1}


def test_a_child_out_of_bounds_is_drawn_again_closer_then_clipped_never_outside() -> None:
    b = breeding(population=500, breed_after=1, lag=0, window=1, sigma=[0.5, 0.5], start=1.0, end=1.0)
    sampler = AdaptiveSampler([0.0, 0.0], [1.0, 1.0], 3, 501, b, HaltonSampler)
    sampler._base = ListSampler([0.0, 0.0], [1.0, 1.0], 0, 1, [[0.0, 1.0]])  # a corner parent
    sampler.ask(1)
    sampler.tell(0, 1.0)
    children = sampler.ask(500)
    assert np.all((children >= 0.0) & (children <= 1.0))
    assert len(np.unique(children[:, 0])) > 400  # shrunk mutations, mostly not clipped to the corner


def test_with_every_candidate_failed_a_generation_comes_from_the_base() -> None:
    sampler = AdaptiveSampler([0.0], [1.0], 4, 12, breeding(), HaltonSampler)
    sampler.ask(8)
    for s in range(6):
        sampler.tell(s, None)
    sampler.ask(4)
    assert all(sampler.describe(s)["parent"] is None for s in range(8, 12))
    assert sampler.generations()[1] == (range(8, 12), 0.0)


# -- restore ----------------------------------------------------------------------


def any_kind(kind: str, simulations: int) -> Sampler:
    """A sampler of ``kind`` on the 3 parameters of LOW and HIGH, as the study makes it."""
    if kind == "custom":
        return Corners(LOW, HIGH, 6, simulations)
    values = np.linspace(LOW, HIGH, simulations).tolist()
    extra = {"list": [values], "adaptive": [breeding(sigma=[0.05] * 3), SobolSampler]}.get(kind, [])
    found: type[Sampler] = load(SAMPLERS, kind, "study.sampler")
    return found(LOW, HIGH, 6, simulations, *extra)  # type: ignore[call-arg]


def drawn_with_a_restore(kind: str, simulations: int, stop: int | None) -> np.ndarray:
    """Every row a study draws, in small asks told a little behind (the adaptive kind waits for them); with
    ``stop``, the sampler is replaced by a new one loaded with its state once ``stop`` rows were drawn."""
    sampler, rows = any_kind(kind, simulations), []
    while sampler.drawn < simulations:
        if sampler.drawn == stop:
            state, stop = serialization.loads(b"".join(serialization.dumps(sampler.state_dict()))), None
            sampler = any_kind(kind, simulations)
            sampler.load_state_dict(state)
        first = sampler.drawn
        rows.append(sampler.ask(3 if stop is None else min(3, stop - first)))
        for s in range(max(0, first - 4), sampler.drawn):
            sampler.tell(s, float(np.sin(7 * s) ** 2))
    return np.vstack(rows)


@pytest.mark.parametrize("kind", [*SAMPLERS, "custom"])
def test_every_kind_resumed_at_any_point_of_its_sequence_the_first_included_draws_the_same(kind: str) -> None:
    """A checkpoint may come before the study's first own simulation was drawn (held-out ones run first):
    Sobol once failed to restore at 0."""
    uninterrupted = drawn_with_a_restore(kind, 24, None)
    assert uninterrupted.shape == (24, 3) and len(np.unique(uninterrupted, axis=0)) > 1
    for stop in (0, 1, 8, 13, 23):
        np.testing.assert_array_equal(drawn_with_a_restore(kind, 24, stop), uninterrupted, err_msg=f"stop {stop}")
