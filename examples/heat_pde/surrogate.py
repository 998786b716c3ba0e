"""A surrogate of the heat equation, trained online by melissa_dl.

``HeatSurrogate`` maps the five parameters of a simulation (initial, left,
right, bottom and top temperatures; a sixth, the diffusivity, when the study
varies it: option ``diffusivity = [low, high]``) and a time step to the whole
temperature field: an MLP with ``nx * ny`` outputs. The server imports this file (the
config's ``training.module``), builds the class with ``training.options`` as
keyword arguments, and calls the hooks below; nothing here knows about MPI.

Normalisation, so that the network sees numbers of order one:

- parameters in ``[low, high]`` (the diffusivity in its own bounds) ->
  ``[-1, 1]`` (centred inputs train faster than ``[0, 1]`` ones with the same
  width);
- time step ``t`` -> ``t / steps`` in ``[0, 1)``;
- temperature ``T`` -> ``(T - mid) / (range / 4)``, i.e. ``(T - 300) / 100``
  for the default bounds: the maximum principle keeps every temperature in
  ``[low, high]``, so targets lie in ``[-2, 2]``.

Validation uses whole simulations held out from training. In the example's
studies they are the study's own (``study.validation`` in config.json: run
by the launcher like the others, never trained on), and
``validation_simulations`` is 0. ``offline.py`` and the benches, which have
no study to run them, set it: parameter sets drawn uniformly with
``validation_seed`` (the study draws a scrambled Sobol sequence with its own
seed, so they are different parameter sets), solved in-process with the
study's own solver (its ``refine`` too). With
``validation_cache`` (a folder) they are solved once and read back by every
later run of the same problem: a refined solver makes them seconds of work.

Tuning (``examples/heat_pde/offline.py``, 32 Sobol simulations x 100 steps,
batch 32, validation loss 0.64 before training): 3 hidden layers of 256 with
GELU and Adam at lr 1e-3 reach 0.020 after 100 steps (30x lower), 0.0037
after 500 (170x) and 0.0014 after 2000. lr 2e-3 is twice as good over the
first few hundred steps (what a short online demo gets) but noisier after a
thousand; 3e-3 is noisier still. ReLU plateaus 3x higher than GELU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from solver import DEFAULT_DT, HeatSolver  # solver.py sits next to this file
from torch import nn

from melissa_dl import Sample, TrainingModule
from melissa_dl.runtime.files import solved_once

FIELD = "temperature"
TEMPERATURES = 5  # initial, left, right, bottom, top


class HeatSurrogate(TrainingModule):
    """MLP ``(5 or 6 parameters, t) -> temperature field``, trained with Adam on the MSE."""

    deterministic_process = True  # process() is plain arithmetic on the sample: the server runs it once per sample

    def __init__(
        self,
        hidden: int = 256,
        depth: int = 3,
        lr: float = 1e-3,
        nx: int = 32,
        ny: int = 32,
        steps: int = 100,
        dt: float = DEFAULT_DT,
        low: float = 100.0,
        high: float = 500.0,
        validation_simulations: int = 4,
        validation_seed: int = 1,
        diffusivity: Sequence[float] | None = None,
        refine: int = 1,
        validation_cache: str | None = None,
    ) -> None:
        """``nx``, ``ny``, ``steps``, ``dt`` and ``refine`` must match the simulation's command
        line; ``low``/``high`` are the bounds of the temperatures' sweep, ``diffusivity`` those of
        the sixth parameter if the study has one; ``validation_cache``, a folder where the held-out
        simulations are kept once solved."""
        super().__init__()
        if depth < 1 or hidden < 1:
            raise ValueError(f"need depth >= 1 and hidden >= 1, got depth={depth}, hidden={hidden}")
        self.lr = lr
        self.nx, self.ny, self.steps, self.dt = nx, ny, steps, dt
        self.validation_simulations = validation_simulations
        self.validation_seed = validation_seed
        self.refine = refine
        self.validation_cache = None if validation_cache is None else Path(validation_cache)
        # Each parameter's bounds, and normalisation constants kept in numpy: process() runs in numpy.
        bounds = [(low, high)] * TEMPERATURES + ([tuple(diffusivity)] if diffusivity is not None else [])
        self.bounds = np.array(bounds, dtype=np.float64)
        if not np.all(self.bounds[:, 0] < self.bounds[:, 1]):
            raise ValueError(f"need low < high for the temperatures and the diffusivity, got {bounds}")
        self.param_mid, self.param_half = self.bounds.mean(axis=1), (self.bounds[:, 1] - self.bounds[:, 0]) / 2
        self.prediction_inputs = {"parameters": ("float32", (len(bounds),)), "time_step": ("float32", ())}
        # the same constants for predict, as buffers: they follow .to(device), also in model.ts (not in model.pt)
        self.register_buffer("parameter_mid", torch.tensor(self.param_mid, dtype=torch.float32), persistent=False)
        self.register_buffer("parameter_half", torch.tensor(self.param_half, dtype=torch.float32), persistent=False)
        self.temp_mid, self.temp_scale = (low + high) / 2, (high - low) / 4

        layers: list[nn.Module] = []
        width = len(bounds) + 1
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        layers.append(nn.Linear(width, nx * ny))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalised inputs ``[batch, 6]`` -> normalised fields ``[batch, nx * ny]``."""
        return self.net(x)

    def configure_optimizer(self) -> torch.optim.Optimizer:
        """Adam, fused: one pass over each parameter instead of torch's default of about ten elementwise ops
        per tensor on the CPU (0.85 ms against 2.8 ms a step for the 64x64 model, the same losses)."""
        return torch.optim.Adam(self.parameters(), lr=self.lr, fused=True)

    def inputs(self, parameters: np.ndarray, time_step: int) -> np.ndarray:
        """The network's normalised input for one parameter set and step (float32, parameters then t)."""
        n = len(self.bounds)
        x = np.empty(n + 1, dtype=np.float32)
        x[:n] = (parameters - self.param_mid) / self.param_half
        x[n] = time_step / self.steps
        return x

    def process(self, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        """One sample -> ``(x [6], y [nx * ny])``, both normalised float32.

        Done in numpy on purpose: the arithmetic creates fresh writable arrays
        (the received field may be a read-only view of a network frame), and
        ``torch.from_numpy`` then wraps them without a copy.
        """
        field = sample.fields[FIELD].reshape(-1)
        y = (field - np.float32(self.temp_mid)) / np.float32(self.temp_scale)
        return torch.from_numpy(self.inputs(sample.parameters, sample.time_step)), torch.from_numpy(y)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def predict(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``parameters [n, 5 or 6]`` and ``time_step [n]`` (``prediction_inputs``) -> ``temperature [n, nx, ny]``
        in physical units; in torch, so that it traces (``model.ts``)."""
        x = torch.cat(
            [
                (inputs["parameters"] - self.parameter_mid) / self.parameter_half,
                (inputs["time_step"] / self.steps)[:, None],
            ],
            1,
        )
        y = self(x) * self.temp_scale + self.temp_mid
        return {FIELD: y.reshape(-1, self.nx, self.ny)}

    def validation_parameters(self) -> np.ndarray:
        """The held-out parameter sets, ``[validation_simulations, 5 or 6]``."""
        rng = np.random.default_rng(self.validation_seed)
        return rng.uniform(self.bounds[:, 0], self.bounds[:, 1], size=(self.validation_simulations, len(self.bounds)))

    def validation_samples(self) -> list[Sample]:
        """Every step of the held-out simulations, solved here (a few ms at 32x32, unrefined) or read from
        ``validation_cache``.

        Their ids are negative so that they can never be mistaken for a
        simulation of the study.
        """
        parameters = self.validation_parameters()
        if not len(parameters):
            return []  # the study runs the held-out simulations (study.validation)
        problem = [self.nx, self.ny, self.steps, self.dt, self.refine, parameters.tolist()]
        fields = solved_once(
            self.validation_cache,
            problem,
            lambda: np.stack(
                [
                    np.stack([solver.step() for _ in range(self.steps)])
                    for solver in (HeatSolver(p, self.nx, self.ny, self.dt, refine=self.refine) for p in parameters)
                ]
            ),
        )
        return [
            Sample(-1 - i, t, p, {FIELD: fields[i, t]}) for i, p in enumerate(parameters) for t in range(self.steps)
        ]
