"""Parameter tables for the simulations of a study.

Every server rank calls :func:`draw_parameters` with the same arguments and
must get the same table, so every sampler is a pure function of its seed.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from melissa_dl.errors import ConfigError

if TYPE_CHECKING:  # the config reads SAMPLERS from here
    from melissa_dl.config import StudyConfig

SAMPLERS = ("uniform", "sobol", "list")


def draw_parameters(
    sampler: str,
    count: int,
    low: Sequence[float],
    high: Sequence[float],
    seed: int,
    values: Sequence[Sequence[float]] | None = None,
) -> np.ndarray:
    """Return the float64 ``[count, d]`` parameters of ``count`` simulations.

    ``d = len(low)``. "uniform" draws i.i.d. in ``[low, high)``; "sobol" draws
    a scrambled Sobol' sequence, which covers the box far more evenly than
    random points for small ``count``; "list" returns ``values`` as given.
    """
    if sampler not in SAMPLERS:
        raise ConfigError(f"unknown sampler {sampler!r}; expected one of {SAMPLERS}")
    if count < 1:
        raise ConfigError(f"the number of simulations must be positive, got {count}")
    lo = np.asarray(low, dtype=np.float64)
    hi = np.asarray(high, dtype=np.float64)
    if lo.ndim != 1 or lo.size == 0 or lo.shape != hi.shape:
        raise ConfigError(
            f"low and high must be non-empty lists of equal length, got {len(low)} and {len(high)}"
        )
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)) and np.all(lo <= hi)):
        raise ConfigError(f"parameter bounds must be finite with low <= high, got {low} and {high}")
    d = lo.size
    if sampler == "list":
        if values is None:
            raise ConfigError("sampler 'list' needs explicit parameter values")
        return _explicit_values(values, count, d)
    if values is not None:
        raise ConfigError(f"explicit parameter values are only used by sampler 'list', not {sampler!r}")
    if sampler == "uniform":
        return np.random.default_rng(seed).uniform(lo, hi, size=(count, d))
    import torch  # here: the supervisor imports this package and should not pay for torch

    engine = torch.quasirandom.SobolEngine(d, scramble=True, seed=seed)
    unit = engine.draw(count, dtype=torch.float64).numpy()
    return lo + (hi - lo) * unit


def _explicit_values(values: Sequence[Sequence[float]], count: int, d: int) -> np.ndarray:
    """Check the "list" sampler's table: a wrong shape is a config mistake, not a crash later."""
    try:
        table = np.array(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"parameter values must be a table of numbers: {exc}") from exc
    if table.shape != (count, d):
        raise ConfigError(
            f"parameter values must have {count} rows of {d} values, got shape {table.shape}"
        )
    if not np.all(np.isfinite(table)):
        raise ConfigError("parameter values must be finite")
    return table


def study_parameters(study: StudyConfig) -> np.ndarray:
    """The study's parameter table; every server rank (and the offline mode) draws the same."""
    return draw_parameters(
        study.sampler,
        study.simulations,
        [p.low for p in study.parameters],
        [p.high for p in study.parameters],
        study.seed,
        study.parameter_values,
    )
