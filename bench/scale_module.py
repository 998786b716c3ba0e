"""The model of bench/scale.py: a small MLP that predicts a simulation's field (``s + t`` everywhere, scaled) from
its parameter and the time step, cheap enough that training keeps up with ten thousand simulations."""

from __future__ import annotations

import torch
from torch import nn

from melissa_dl import Sample, TrainingModule


class ScaleModel(TrainingModule):
    def __init__(self, hidden: int = 32, cells: int = 64) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, cells))

    def configure_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def process(self, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor([sample.parameters[0], sample.time_step / 5], dtype=torch.float32)
        return x, torch.from_numpy(sample.fields["field"]) / 10_000

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)
