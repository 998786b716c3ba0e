"""A surrogate of the Lennard-Jones fluid: ``(temperature, density, report) -> g(r), energy, pressure``.

An MLP whose outputs are the ``fluid.BINS`` values of ``g(r) - 1`` and the two
scalars, each shifted and scaled by ``SCALARS`` to order one over the study's
range. Inputs: the parameters normalised to ``[-1, 1]`` by the study's
bounds (options ``temperature`` and ``density``), the report's index to
``[0, 1)``. ``training_step`` returns each sample's loss: the mean squared
error of g(r) plus that of the two scalars, so that the scalars weigh as
much as the curve.

Validation is on held-out simulations that the study runs like the others
(``study.validation`` in config.json): nothing to do here. ``steps`` must be
simulate.py's ``--reports``.
"""

from __future__ import annotations

from collections.abc import Sequence

import fluid  # fluid.py sits next to this file
import numpy as np
import torch
from torch import nn

from melissa_dl import Sample, TrainingModule

# (centre, scale) of each scalar: over the study's box the energy ran from -5.6 to -2.9, the pressure from -1 to 3.5
SCALARS = {"energy": (-4.0, 1.0), "pressure": (1.0, 2.0)}


class FluidSurrogate(TrainingModule):
    """MLP ``(temperature, density, report) -> [g(r) - 1, energy, pressure]``, Adam on the mean squared error."""

    deterministic_process = True

    def __init__(
        self,
        hidden: int = 128,
        depth: int = 3,
        lr: float = 2e-3,
        steps: int = 100,
        temperature: Sequence[float] = (100.0, 160.0),
        density: Sequence[float] = (0.5, 0.8),
    ) -> None:
        super().__init__()
        self.lr, self.steps = lr, steps
        self.bounds = np.array([temperature, density], dtype=np.float64)
        self.mid, self.radius = self.bounds.mean(axis=1), (self.bounds[:, 1] - self.bounds[:, 0]) / 2
        layers: list[nn.Module] = []
        width = 3
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        layers.append(nn.Linear(width, fluid.BINS + len(SCALARS)))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)

    def process(self, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        x = np.empty(3, dtype=np.float32)
        x[:2] = (sample.parameters - self.mid) / self.radius
        x[2] = sample.time_step / self.steps
        y = np.empty(fluid.BINS + len(SCALARS), dtype=np.float32)
        y[: fluid.BINS] = sample.fields["rdf"] - 1
        y[fluid.BINS :] = [(sample.fields[name] - centre) / scale for name, (centre, scale) in SCALARS.items()]
        return torch.from_numpy(x), torch.from_numpy(y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One loss per sample: the server trains on their mean."""
        x, y = batch
        error = (self(x) - y) ** 2
        return error[:, : fluid.BINS].mean(dim=1) + error[:, fluid.BINS :].mean(dim=1)
