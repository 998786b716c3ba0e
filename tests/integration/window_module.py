"""A TrainingModule for windows of toy_sim's steps (``training.window``).

Its parameter ``seen`` (simulation x first step) counts how many times each
window was trained: each window's loss adds exactly 1 to its cell (the
ranks' losses are averaged, so each counts ``world_size`` times), so the
final model says whether a window was trained once, twice or never, across
kills and restarts. ``process`` checks that a window is its simulation's
consecutive steps (toy_sim's step t of simulation s is ``1000 s + t``);
``advance`` predicts the next step as the last one plus ``increment``
(toy_sim's own rule for 1), for the rollouts of held-out simulations.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from melissa_dl import Sample, TrainingModule


class Windows(TrainingModule):
    def __init__(self, simulations: int, steps: int, increment: float = 1.0) -> None:
        super().__init__()
        self.seen = nn.Parameter(torch.zeros(simulations, steps))
        self.increment = increment

    def configure_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1.0)

    def process(self, sample: Sample) -> np.ndarray:
        values = sample.fields["field"][:, 0, 0]
        length = self.window.inputs + self.window.targets
        expected = 1000.0 * sample.simulation_id + sample.time_step + np.arange(length)
        if not np.array_equal(values, expected):
            raise ValueError(f"window {sample.simulation_id}:{sample.time_step} holds {values.tolist()}")
        return np.array([sample.simulation_id, sample.time_step])

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        return -self.seen[batch[:, 0], batch[:, 1]].sum() * self.world_size

    def advance(self, window: Sample) -> dict[str, np.ndarray]:
        return {"field": window.fields["field"][-1:] + self.increment}
