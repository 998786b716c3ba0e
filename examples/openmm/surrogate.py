"""A surrogate of the Lennard-Jones fluid: ``(temperature, density, report) -> g(r), energy, pressure``.

An MLP whose outputs are the ``fluid.BINS`` values of ``g(r) - 1`` and the two
scalars, each shifted and scaled by ``SCALARS`` to order one over the study's
range. Inputs: the parameters normalised to ``[-1, 1]`` by the study's
bounds (options ``temperature`` and ``density``), the report's index to
``[0, 1)``. ``training_step`` returns each sample's loss: the mean squared
error of g(r) plus that of the two scalars, so that the scalars weigh as
much as the curve.

Validation: ``validation_simulations`` held-out simulations, drawn uniformly
with ``validation_seed`` and run here with fluid.py, on every server rank
(the only way the server offers today; about half a second each with 108
particles). ``steps``, ``interval`` and ``particles`` must be those of
simulate.py's command line.
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
HELD_OUT_SEED = 1_000_000  # their MD seeds: the study's simulations take their id + 1


class FluidSurrogate(TrainingModule):
    """MLP ``(temperature, density, report) -> [g(r) - 1, energy, pressure]``, Adam on the mean squared error."""

    deterministic_process = True

    def __init__(
        self,
        hidden: int = 128,
        depth: int = 3,
        lr: float = 2e-3,
        steps: int = 100,
        interval: int = 50,
        particles: int = 108,
        temperature: Sequence[float] = (100.0, 160.0),
        density: Sequence[float] = (0.5, 0.8),
        validation_simulations: int = 2,
        validation_seed: int = 1,
    ) -> None:
        super().__init__()
        self.lr, self.steps, self.interval, self.particles = lr, steps, interval, particles
        self.bounds = np.array([temperature, density], dtype=np.float64)
        self.mid, self.radius = self.bounds.mean(axis=1), (self.bounds[:, 1] - self.bounds[:, 0]) / 2
        self.validation_simulations, self.validation_seed = validation_simulations, validation_seed
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

    def validation_samples(self) -> list[Sample]:
        """Every report of the held-out simulations (ids negative: never a simulation of the study)."""
        rng = np.random.default_rng(self.validation_seed)
        parameters = rng.uniform(self.bounds[:, 0], self.bounds[:, 1], size=(self.validation_simulations, 2))
        samples: list[Sample] = []
        for i, p in enumerate(parameters):
            fluid.run(
                p[0],
                p[1],
                lambda t, observables: samples.append(Sample(-1 - i, t, p, observables)),
                self.steps,
                self.interval,
                self.particles,
                seed=HELD_OUT_SEED + i,
            )
        return samples
