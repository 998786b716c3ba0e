"""The study's sampler and its held-out simulations' parameters, from the ``study`` section: the samplers are the
``launcher`` package's, which imports nothing of ``melissa_dl``, and the adaptive sampler's defaults follow the
study's pace (``Study._draw``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from launcher.samplers import Breeding, Sampler, UniformSampler
from melissa_dl.config.registry import SAMPLERS, SPACE_FILLING, load
from melissa_dl.config.sections import AdaptiveConfig, StudyConfig
from melissa_dl.errors import ConfigError
from melissa_dl.runtime.plugins import load_class

DRAWN_AHEAD = 2
"""Waves of ``launcher.job_limit`` simulations the study keeps drawn or running."""


def bounds(study: StudyConfig) -> tuple[list[float], list[float]]:
    """Each parameter's low and high bounds, as a sampler takes them."""
    return [p.low for p in study.parameters], [p.high for p in study.parameters]


def breeding(adaptive: AdaptiveConfig, job_limit: int, dimensions: int) -> Breeding:
    """The adaptive sampler's settings, defaults resolved; a ``ConfigError`` for a lag that leaves no parent."""
    population = adaptive.population or job_limit
    # a lag below the simulations the study keeps drawn or running would wait at every generation
    lag = max(population, DRAWN_AHEAD * job_limit) if adaptive.lag is None else adaptive.lag
    breed_after = adaptive.breed_after or max(2 * population, lag + population)
    if lag >= breed_after:
        raise ConfigError(
            f"study.adaptive.lag: {lag} leaves no parent before the first bred generation (breed_after={breed_after})"
        )
    return Breeding(
        population=population,
        breed_after=breed_after,
        lag=lag,
        window=adaptive.window or 4 * population,
        sigma=adaptive.sigma if isinstance(adaptive.sigma, list) else [adaptive.sigma] * dimensions,
        start=adaptive.start,
        end=adaptive.end,
        breakpoint=adaptive.breakpoint,
    )


def sampler_from_config(study: StudyConfig, job_limit: int, base_dir: Path) -> Sampler:
    """The study's sampler, from its start (``study.sampler``, its module loaded now; ``custom``: the user's class
    from ``study.custom_sampler``, relative to ``base_dir``)."""
    low, high = bounds(study)
    if study.sampler == "custom":
        assert study.custom_sampler is not None
        custom = load_class(
            base_dir / study.custom_sampler.module, study.custom_sampler.class_name, Sampler, "study.custom_sampler"
        )
        return custom(low, high, study.seed, study.simulations, **study.custom_sampler.options)
    kind = load(SAMPLERS, study.sampler, "study.sampler")
    if study.sampler == "list":
        return kind(low, high, study.seed, study.simulations, study.parameter_values)
    if study.sampler == "adaptive":
        base = load(SPACE_FILLING, study.adaptive.base, "study.adaptive.base")
        settings = breeding(study.adaptive, job_limit, len(low))
        return kind(low, high, study.seed, study.simulations, settings, base)
    return kind(low, high, study.seed, study.simulations)


def parameter_table(study: StudyConfig, base_dir: Path = Path(".")) -> np.ndarray:
    """Every simulation's parameters, drawn at once, for the samplers that need no training (``offline.py``,
    ``--try-simulation``); a ``ConfigError`` for one that does."""
    table = sampler_from_config(study, 1, base_dir).ask(study.simulations)
    if len(table) < study.simulations:
        raise ConfigError(f"study.sampler: '{study.sampler}' draws as training goes, not all at once")
    return table


def held_out_table(study: StudyConfig) -> np.ndarray:
    """The held-out simulations' parameters (``study.validation``), one row each."""
    validation = study.validation
    if validation.parameters is not None:
        return np.array(validation.parameters, dtype=np.float64).reshape(validation.count, len(study.parameters))
    low, high = bounds(study)
    return UniformSampler(low, high, validation.seed, validation.simulations).ask(validation.simulations)
