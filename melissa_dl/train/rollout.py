"""Rollout validation of an autoregressive surrogate (``training.window``).

A surrogate trained on windows predicts the next steps from the last ones;
what matters is how it does fed its own predictions over a whole trajectory
(PDEBench, The Well). Each held-out simulation's trajectory is rolled out
from its first ``inputs`` true steps (``TrainingModule.rollout``) and the
relative L2 error of each predicted step (over all fields) is taken at
horizons 1, 10 and the trajectory's end, then averaged over trajectories.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import numpy as np
import torch

from melissa_dl.buffers.sample import Sample

if TYPE_CHECKING:
    from melissa_dl.train.module import TrainingModule

HORIZONS = ("1", "10", "end")  # the steps after the first inputs at which the error is reported


def trajectories(steps: Iterable[Sample], inputs: int) -> list[Sample]:
    """Each simulation's steps from its first, as long as they are consecutive (a step given twice counted once),
    stacked along a leading time axis: those with a step to predict after their first ``inputs``."""
    by_simulation: dict[int, dict[int, Sample]] = {}
    for sample in steps:
        by_simulation.setdefault(sample.simulation_id, {}).setdefault(sample.time_step, sample)
    found = []
    for sim in sorted(by_simulation):
        held = by_simulation[sim]
        first = min(held)
        run = [held[first]]
        while first + len(run) in held:
            run.append(held[first + len(run)])
        if len(run) > inputs:
            fields = {name: np.stack([s.fields[name] for s in run]) for name in run[0].fields}
            found.append(Sample(sim, first, run[0].parameters, fields))
    return found


@torch.no_grad()
def rollout_errors(module: TrainingModule, trajectory: Sample, inputs: int) -> np.ndarray:
    """The relative L2 error of each step the module predicts after the trajectory's first ``inputs``."""
    first = Sample(
        trajectory.simulation_id,
        trajectory.time_step,
        trajectory.parameters,
        {name: array[:inputs] for name, array in trajectory.fields.items()},
    )
    steps = len(next(iter(trajectory.fields.values()))) - inputs
    predicted = module.rollout(first, steps)
    squared, reference = np.zeros(steps), np.zeros(steps)
    for name, truth in trajectory.fields.items():
        true = truth[inputs:].reshape(steps, -1).astype(np.float64)
        guess = np.asarray(predicted[name], dtype=np.float64).reshape(steps, -1)
        squared += ((guess - true) ** 2).sum(axis=1)
        reference += (true**2).sum(axis=1)
    return np.sqrt(squared / np.maximum(reference, np.finfo(np.float64).tiny))


def at_horizons(errors: np.ndarray) -> np.ndarray:
    """Sums and counts of ``errors`` at the ``HORIZONS`` (a horizon past the trajectory's end: not counted)."""
    tenth = [errors[9], 1.0] if len(errors) >= 10 else [0.0, 0.0]
    return np.array([[errors[0], 1.0], tenth, [errors[-1], 1.0]])
