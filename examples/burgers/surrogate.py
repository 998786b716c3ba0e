"""A surrogate of the Burgers example, whose per-sample losses steer an adaptive study.

``BurgersSurrogate`` maps ``(c, nu, t)`` to the whole field ``u`` (an MLP with
``nx`` outputs). Inputs are normalised to ``[-1, 1]`` (``t`` to ``[0, 1)``),
``u`` is divided by ``scale`` (``|u| <= |c| + a <= 1.5``). ``training_step``
returns each sample's mean squared error: the server trains on their mean and,
with ``study.sampler: "adaptive"``, records them per (simulation, step).

Validation uses whole simulations drawn uniformly over the parameter box with
``validation_seed``, solved here (or read from ``validation_cache``, a folder,
once solved): what the model is judged on is the whole space, not where a
sampler put its simulations.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from solver import BurgersSolver  # solver.py sits next to this file
from torch import nn

from melissa_dl import Sample, TrainingModule
from melissa_dl.runtime.files import solved_once

HELD_OUT_STREAM = 0x48454C44  # "HELD"


class BurgersSurrogate(TrainingModule):
    """MLP ``(c, nu, t) -> u [nx]``, Adam on the mean squared error."""

    deterministic_process = True

    def __init__(
        self,
        hidden: int = 256,
        depth: int = 3,
        lr: float = 1e-3,
        nx: int = 256,
        steps: int = 32,
        refine: int = 1,
        amplitude: float = 1.0,
        c: Sequence[float] = (-0.5, 0.5),
        nu: Sequence[float] = (1e-3, 0.2),
        scale: float = 0.5,
        validation_simulations: int = 64,
        validation_seed: int = 1,
        validation_cache: str | None = None,
    ) -> None:
        """``nx``, ``steps``, ``refine`` and ``amplitude`` must match the simulation's command line,
        ``c`` and ``nu`` the study's bounds."""
        super().__init__()
        self.lr, self.nx, self.steps, self.refine, self.amplitude, self.scale = lr, nx, steps, refine, amplitude, scale
        self.bounds = np.array([c, nu], dtype=np.float64)
        self.mid, self.half = self.bounds.mean(axis=1), (self.bounds[:, 1] - self.bounds[:, 0]) / 2
        self.validation_simulations, self.validation_seed = validation_simulations, validation_seed
        self.validation_cache = None if validation_cache is None else Path(validation_cache)
        layers: list[nn.Module] = []
        width = 3
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        layers.append(nn.Linear(width, nx))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def configure_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr, fused=True)

    def inputs(self, parameters: np.ndarray, time_step: int) -> np.ndarray:
        x = np.empty(3, dtype=np.float32)
        x[:2] = (parameters - self.mid) / self.half
        x[2] = time_step / self.steps
        return x

    def process(self, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        y = sample.fields["u"] / np.float32(self.scale)  # a fresh writable array: from_numpy shares it
        return torch.from_numpy(self.inputs(sample.parameters, sample.time_step)), torch.from_numpy(y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """One loss per sample: the server trains on their mean and records each for the sampler."""
        x, y = batch
        return ((self(x) - y) ** 2).mean(dim=1)

    def validation_parameters(self) -> np.ndarray:
        # A stream of its own: a uniform sampler seeded with validation_seed must not draw the same sets.
        rng = np.random.default_rng([HELD_OUT_STREAM, self.validation_seed])
        return rng.uniform(self.bounds[:, 0], self.bounds[:, 1], size=(self.validation_simulations, 2))

    def validation_samples(self) -> list[Sample]:
        """Every step of the held-out simulations (ids negative: never a simulation of the study)."""
        parameters = self.validation_parameters()
        problem = ["burgers", self.nx, self.steps, self.refine, self.amplitude, parameters.tolist()]
        fields = solved_once(self.validation_cache, problem, lambda: np.stack([self.solve(p) for p in parameters]))
        return [Sample(-1 - i, t, p, {"u": fields[i, t]}) for i, p in enumerate(parameters) for t in range(self.steps)]

    def solve(self, parameters: np.ndarray) -> np.ndarray:
        """One simulation's steps ``[steps, nx]``, as the simulation program computes them."""
        solver = BurgersSolver(self.amplitude, *parameters, nx=self.nx, steps=self.steps, refine=self.refine)
        return np.stack([solver.step() for _ in range(self.steps)])
