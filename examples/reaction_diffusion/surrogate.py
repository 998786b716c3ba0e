"""An autoregressive surrogate of the Gray–Scott example, trained online on windows of steps.

``GrayScottSurrogate`` maps the last ``inputs`` steps of both fields (``u``
and ``v``) and the simulation's feed and kill rates to the next step: a
small convolutional network on the periodic grid that predicts the change
``x[t+1] - x[t]``, which is small and local (a step is 20 time units, over
which diffusion reaches about 3 cells), rather than the next field itself. The
config's ``training.window`` gives the windows: ``{"inputs": 4, "targets":
1}``; ``process`` returns numpy views of the window (its ``inputs`` steps and
its target step, per field), so that the server forms a batch with no second
copy, and the feed and kill rates, mapped to ``[-1, 1]``, which the network
sees as two constant channels. The third parameter (``seed``) only places the
initial spots: the network does not see it.

Normalisation, so that the network sees numbers of order one: ``u`` and ``v``
shifted and divided by their spread over the study (``MEAN``, ``SPREAD``),
the change divided by its spread (``CHANGE`` per substep, times the
substeps of a step).

``advance`` steps a window of ``inputs`` steps (true or predicted) forward by
one, the change added to the last step and the result clipped to ``[0, 1]``,
where the equations keep both fields: the server's rollout validation, and
the benches, feed its predictions back ``steps`` times. Held-out simulations
come from the study (``study.validation``): ``validation_samples`` keeps its
default (none).

The network pads its input periodically once, by its depth, and then runs
unpadded 3x3 convolutions: the same result as padding before each of them,
at about half the cost on a CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from solver import FIELDS  # solver.py sits next to this file
from torch import nn

from melissa_dl import Sample, TrainingModule

MEAN = (0.7, 0.13)  # of u and v over the study's box
SPREAD = (0.28, 0.14)
CHANGE = (1.5e-3, 1e-3)  # spread of a step's change, per substep


class GrayScottSurrogate(TrainingModule):
    """A CNN ``(last inputs steps of u and v, feed, kill) -> next step``, Adam on the mean squared change."""

    mean: torch.Tensor  # buffers, registered in __init__
    spread: torch.Tensor
    change: torch.Tensor

    def __init__(
        self,
        width: int = 16,
        depth: int = 3,
        lr: float = 1e-3,
        inputs: int = 4,
        substeps: int = 20,
        feed: Sequence[float] = (0.025, 0.055),
        kill: Sequence[float] = (0.055, 0.064),
    ) -> None:
        """``inputs`` must be ``training.window.inputs``, ``substeps`` the simulation's, ``feed`` and ``kill``
        the study's bounds (its parameters in the order feed, kill, seed)."""
        super().__init__()
        if depth < 2 or width < 1 or inputs < 1:
            raise ValueError(f"need depth >= 2, width >= 1, inputs >= 1; got {depth}, {width}, {inputs}")
        self.lr, self.inputs, self.depth = lr, inputs, depth
        self.bounds = np.array([feed, kill], dtype=np.float64)
        # not ``self.half``: that is nn.Module's method
        self.rate_mid, self.rate_radius = self.bounds.mean(axis=1), (self.bounds[:, 1] - self.bounds[:, 0]) / 2
        shape = (1, len(FIELDS), 1, 1)
        self.register_buffer("mean", torch.tensor(MEAN).reshape(shape))
        self.register_buffer("spread", torch.tensor(SPREAD).reshape(shape))
        self.register_buffer("change", torch.tensor(CHANGE).reshape(shape) * substeps)
        channels = [len(FIELDS) * inputs + 2, *[width] * (depth - 1), len(FIELDS)]
        self.convs = nn.ModuleList(nn.Conv2d(a, b, 3) for a, b in zip(channels[:-1], channels[1:]))

    def forward(self, steps: torch.Tensor, rates: torch.Tensor) -> torch.Tensor:
        """``steps`` ``[batch, inputs, 2, n, n]`` (physical), ``rates`` ``[batch, 2]`` (normalised) -> the
        normalised change of the next step, ``[batch, 2, n, n]``."""
        batch, _, _, n, m = steps.shape
        z = ((steps - self.mean[:, None]) / self.spread[:, None]).reshape(batch, -1, n, m)
        z = torch.cat([z, rates[:, :, None, None].expand(batch, 2, n, m)], dim=1)
        z = F.pad(z, (self.depth,) * 4, mode="circular")
        for conv in self.convs[:-1]:
            z = F.gelu(conv(z))
        return self.convs[-1](z)

    def configure_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr, fused=True)

    def rates(self, parameters: np.ndarray) -> np.ndarray:
        """Feed and kill rates mapped to ``[-1, 1]`` (float32 ``[2]``)."""
        return ((np.asarray(parameters[:2]) - self.rate_mid) / self.rate_radius).astype(np.float32)

    def process(self, sample: Sample) -> tuple[np.ndarray, ...]:
        """A window -> ``(u inputs, v inputs, u target, v target, rates)``: views of the window but the rates."""
        k = self.window.inputs
        if k != self.inputs or self.window.targets != 1:
            raise ValueError(
                f"training.window is {k} inputs and {self.window.targets} targets: the surrogate takes "
                f"{self.inputs} inputs (training.options.inputs) and 1 target"
            )
        u, v = (sample.fields[name] for name in FIELDS)
        return u[:k], v[:k], u[k:], v[k:], self.rates(sample.parameters)

    def training_step(self, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        u, v, target_u, target_v, rates = batch
        steps = torch.stack([u, v], dim=2)
        target = (torch.cat([target_u, target_v], dim=1) - steps[:, -1]) / self.change
        return F.mse_loss(self(steps, rates), target)

    def advance(self, window: Sample) -> dict[str, torch.Tensor]:
        """The step after the window's ``inputs`` steps (``[1, n, n]`` per field), clipped to ``[0, 1]``."""
        device = self.mean.device
        steps = torch.stack([torch.as_tensor(window.fields[name]) for name in FIELDS], dim=1)
        steps = steps[None].to(device=device, dtype=torch.float32)
        rates = torch.from_numpy(self.rates(window.parameters))[None].to(device)
        following = (steps[:, -1] + self(steps, rates) * self.change).clamp_(0.0, 1.0)[0]
        return {name: following[i : i + 1] for i, name in enumerate(FIELDS)}

    def extra_repr(self) -> str:
        return f"inputs={self.inputs}, feed/kill bounds={self.bounds.tolist()}"
