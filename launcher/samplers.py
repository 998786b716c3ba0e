"""The parameters of a study's simulations, asked as the study goes (ask/tell).

The study asks its sampler for the parameters of its next simulations, in id
order, shortly before it launches them, and tells it what training learnt of
each finished one (its loss statistic, :mod:`melissa_dl.study.learning`). Every
sampler's answers depend only on its seed and on what it was told, never on
timing, and its state (``state_dict``) is part of every checkpoint, so a
resumed study asks on exactly where it stopped. Kinds (``melissa_dl/config/registry.py``'s ``SAMPLERS``):

- ``uniform``: i.i.d. in ``[low, high]``;
- ``sobol``, ``halton``: scrambled low-discrepancy sequences
  (``scipy.stats.qmc``), far more even than random points for small counts
  (Sobol's balance holds for the first ``2**m`` simulations of the study,
  however they are asked for);
- ``lhs``: one Latin hypercube of the whole study (``scipy.stats.qmc``);
- ``list``: ``study.parameter_values`` as given;
- ``adaptive``: :class:`AdaptiveSampler`, which breeds new parameter sets
  from the simulations training found hardest.

A user's class (``study.custom_sampler``) subclasses :class:`Sampler`.
"""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np


class Sampler(ABC):
    """Ask for parameter sets in simulation-id order; tell what was learnt.

    Subclasses implement ``_draw``; one that learns sets ``learns`` (the server then records each sample's
    loss), overrides ``tell`` and returns fewer rows from ``_draw`` while it waits for something it must be
    told first.
    """

    kind: ClassVar[str] = ""
    learns: ClassVar[bool] = False

    def __init__(self, low: Sequence[float], high: Sequence[float], seed: int, simulations: int) -> None:
        self.low = np.asarray(low, dtype=np.float64)
        self.high = np.asarray(high, dtype=np.float64)
        self.seed = seed
        self.simulations = simulations
        self.drawn = 0  # simulations whose parameters were asked for: ids 0 .. drawn - 1

    def ask(self, count: int) -> np.ndarray:
        """The ``[k, d]`` parameters of simulations ``drawn .. drawn + k - 1``, ``k <= count`` (none past the
        study's end; fewer while the sampler waits to be told about earlier simulations)."""
        count = max(0, min(count, self.simulations - self.drawn))
        rows = self._draw(count) if count else np.empty((0, self.low.size))
        self.drawn += len(rows)
        return rows

    @abstractmethod
    def _draw(self, count: int) -> np.ndarray:
        """Up to ``count`` rows for the simulations from ``drawn`` on."""

    def tell(self, simulation: int, statistic: float | None) -> None:
        """Training's loss statistic of a finished simulation (None: it failed, nothing was learnt)."""

    def describe(self, simulation: int) -> dict[str, Any]:
        """What the report says of how ``simulation``'s parameters were chosen."""
        return {}

    def generations(self) -> dict[int, tuple[range, float]]:
        """A sampler that breeds: each generation drawn so far, its simulations and its bred fraction."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drawn = state["drawn"]

    def _scaled(self, unit: np.ndarray) -> np.ndarray:
        return self.low + (self.high - self.low) * unit


class UniformSampler(Sampler):
    kind = "uniform"

    def __init__(self, low: Sequence[float], high: Sequence[float], seed: int, simulations: int) -> None:
        super().__init__(low, high, seed, simulations)
        self._rng = np.random.default_rng(seed)

    def _draw(self, count: int) -> np.ndarray:
        return self._rng.uniform(self.low, self.high, size=(count, self.low.size))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "rng": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._rng.bit_generator.state = state["rng"]


class _SequenceSampler(Sampler):
    """A ``scipy.stats.qmc`` sequence, restored by replaying it to where it was."""

    def __init__(self, low: Sequence[float], high: Sequence[float], seed: int, simulations: int) -> None:
        super().__init__(low, high, seed, simulations)
        self._engine = self._make_engine()

    @abstractmethod
    def _make_engine(self) -> Any:
        """The kind's ``qmc`` engine, from the start of its sequence."""

    def _draw(self, count: int) -> np.ndarray:
        with warnings.catch_warnings():  # Sobol's balance is the whole sequence's, whatever the chunks asked
            warnings.filterwarnings("ignore", "The balance properties of Sobol", UserWarning)
            return self._scaled(self._engine.random(count))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._engine.reset()
        if self.drawn:  # scipy's Sobol fast-forwards a fresh engine by n - 1: 0 would overflow
            self._engine.fast_forward(self.drawn)


class SobolSampler(_SequenceSampler):
    kind = "sobol"

    def _make_engine(self) -> Any:
        from scipy.stats import qmc

        return qmc.Sobol(self.low.size, scramble=True, rng=self.seed)


class HaltonSampler(_SequenceSampler):
    kind = "halton"

    def _make_engine(self) -> Any:
        from scipy.stats import qmc

        return qmc.Halton(self.low.size, scramble=True, rng=self.seed)


class TableSampler(Sampler):
    """The rows of a table made once for the whole study."""

    def __init__(
        self, low: Sequence[float], high: Sequence[float], seed: int, simulations: int, table: np.ndarray
    ) -> None:
        super().__init__(low, high, seed, simulations)
        self._table = table

    def _draw(self, count: int) -> np.ndarray:
        return self._table[self.drawn : self.drawn + count].copy()


class LhsSampler(TableSampler):
    """One Latin hypercube of all the study's simulations: each parameter's range cut in ``simulations``
    equal slices, one simulation in each."""

    kind = "lhs"

    def __init__(self, low: Sequence[float], high: Sequence[float], seed: int, simulations: int) -> None:
        from scipy.stats import qmc

        unit = qmc.LatinHypercube(len(low), rng=seed).random(simulations)
        super().__init__(low, high, seed, simulations, np.asarray(low) + (np.asarray(high) - np.asarray(low)) * unit)


class ListSampler(TableSampler):
    kind = "list"

    def __init__(
        self,
        low: Sequence[float],
        high: Sequence[float],
        seed: int,
        simulations: int,
        values: Sequence[Sequence[float]],
    ) -> None:
        super().__init__(low, high, seed, simulations, np.array(values, dtype=np.float64))


@dataclass(frozen=True)
class Breeding:
    """The adaptive sampler's settings (``study.adaptive``; see docs/tutorials/active-sampling.md)."""

    population: int  # simulations per generation
    breed_after: int  # simulations drawn from the base before the first bred generation
    lag: int  # simulations that may still be running, or their samples untrained, when a generation is bred
    window: int  # candidate parents: the last ``window`` simulations before the lag
    sigma: Sequence[float]  # mutation's standard deviation per parameter, as a fraction of its range
    start: float  # bred fraction of the first bred generation
    end: float  # bred fraction from generation ``breakpoint`` on
    breakpoint: int


MUTATION_TRIES = 8  # halvings of sigma before an out-of-bounds child is clipped


class AdaptiveSampler(Sampler):
    """Breed-style sampling: parents chosen with probability proportional to their loss statistic.

    Generation 0 is the first ``breed_after`` simulations, from the base
    sampler. Generation ``g >= 1`` is the next ``population`` simulations: a
    fraction growing linearly from ``start`` (``g = 1``) to ``end`` (``g =
    breakpoint`` and after) is bred, each child a Gaussian mutation of a parent
    (``sigma`` of each parameter's range; a child out of bounds is drawn again
    with half the sigma, up to ``MUTATION_TRIES`` times, then clipped), the
    rest comes from the base sampler. Its parents are chosen among the
    ``window`` simulations just before ``first(g) - lag``, each with
    probability proportional to its statistic (failed ones never): the
    generation is drawn only once every one of them has been told, so that
    which simulations are candidates, and hence every draw, never depends on
    which finished first. Simulations keep their ids; only parameters not yet
    asked for are chosen this way.
    """

    kind = "adaptive"
    learns = True

    def __init__(
        self,
        low: Sequence[float],
        high: Sequence[float],
        seed: int,
        simulations: int,
        breeding: Breeding,
        base: type[Sampler],
    ) -> None:
        super().__init__(low, high, seed, simulations)
        self.breeding = breeding
        self._base = base(low, high, seed, simulations)  # a space-filling kind: the simulations not bred
        self._rng = np.random.default_rng([seed, 1])  # its own stream, apart from the base's
        self._rows = np.full((simulations, self.low.size), np.nan)
        self._statistics: dict[int, float | None] = {}
        self._parents: dict[int, int] = {}  # bred simulation -> its parent
        self._fractions: dict[int, float] = {}  # generation -> bred fraction, as drawn

    def generation(self, simulation: int) -> int:
        b = self.breeding
        return 0 if simulation < b.breed_after else 1 + (simulation - b.breed_after) // b.population

    def _bounds(self, generation: int) -> tuple[int, int]:
        b = self.breeding
        if generation == 0:
            return 0, min(b.breed_after, self.simulations)
        first = b.breed_after + (generation - 1) * b.population
        return first, min(first + b.population, self.simulations)

    def candidates(self, generation: int) -> range:
        """The simulations among which ``generation``'s parents are chosen."""
        end = max(0, self._bounds(generation)[0] - self.breeding.lag)
        return range(max(0, end - self.breeding.window), end)

    def bred_fraction(self, generation: int) -> float:
        b = self.breeding
        if generation == 0:
            return 0.0
        if generation >= b.breakpoint:
            return b.end
        return b.start + (b.end - b.start) * (generation - 1) / (b.breakpoint - 1)

    def _draw(self, count: int) -> np.ndarray:
        end = self.drawn + count
        done = self.drawn
        while done < end:
            generation = self.generation(done)
            first, last = self._bounds(generation)
            if np.isnan(self._rows[first]).any():
                if not self._breed(generation, first, last):
                    break  # its candidates are not all told yet
            done = min(end, last)
        return self._rows[self.drawn : done].copy()

    def _breed(self, generation: int, first: int, last: int) -> bool:
        """Draw a whole generation once its candidates are all told."""
        size = last - first
        fraction = self.bred_fraction(generation)
        scored = [s for s in self.candidates(generation) if s in self._statistics]
        if len(scored) < len(self.candidates(generation)):
            return False
        parents = [s for s in scored if self._statistics[s] is not None]
        bred = round(fraction * size) if parents else 0
        rows = np.empty((size, self.low.size))
        order = self._rng.permutation(size)  # which places of the generation are bred
        if bred:
            weights = np.nan_to_num([max(self._statistics[s], 0.0) for s in parents])  # type: ignore[type-var]
            p = weights / weights.sum() if weights.sum() > 0 else None
            chosen = self._rng.choice(len(parents), size=bred, p=p)
            for place, parent in zip(order[:bred], (parents[i] for i in chosen)):
                rows[place] = self._mutate(self._rows[parent])
                self._parents[first + place] = parent
        rows[order[bred:]] = self._base.ask(size - bred)  # the base's sequence, in the order it is used
        self._rows[first:last] = rows
        self._fractions[generation] = bred / size
        return True

    def _mutate(self, parent: np.ndarray) -> np.ndarray:
        span = self.high - self.low
        sigma = np.asarray(self.breeding.sigma, dtype=np.float64) * span
        for _ in range(MUTATION_TRIES):
            child = parent + self._rng.normal(0.0, 1.0, parent.size) * sigma
            if np.all((child >= self.low) & (child <= self.high)):
                return child
            sigma = sigma / 2
        return np.clip(child, self.low, self.high)

    def tell(self, simulation: int, statistic: float | None) -> None:
        self._statistics[simulation] = statistic

    def describe(self, simulation: int) -> dict[str, Any]:
        return {"generation": self.generation(simulation), "parent": self._parents.get(simulation)}

    def generations(self) -> dict[int, tuple[range, float]]:
        return {g: (range(*self._bounds(g)), fraction) for g, fraction in self._fractions.items()}

    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "rng": self._rng.bit_generator.state,
            "rows": self._rows.copy(),
            "statistics": dict(self._statistics),
            "parents": dict(self._parents),
            "fractions": dict(self._fractions),
            "base": self._base.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._rng.bit_generator.state = state["rng"]
        self._rows = np.array(state["rows"], dtype=np.float64)
        self._statistics, self._parents = dict(state["statistics"]), dict(state["parents"])
        self._fractions = dict(state["fractions"])
        self._base.load_state_dict(state["base"])
