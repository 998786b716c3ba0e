"""A TrainingModule that saves every sample it is given, for tests of what the server assembled.

Each sample becomes ``<directory>/<simulation>_<step>.npz`` holding its
parameters and fields. Training itself is a no-op (learning rate 0): with a
FIFO buffer every received sample is processed exactly once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from melissa_dl.buffers.sample import Sample
from melissa_dl.train.module import TrainingModule


class Recorder(TrainingModule):
    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = Path(directory)
        self.weight = nn.Parameter(torch.zeros(1))

    def configure_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.0)

    def process(self, sample: Sample) -> torch.Tensor:
        np.savez(
            self.directory / f"{sample.simulation_id}_{sample.time_step}.npz",
            parameters=sample.parameters,
            **sample.fields,
        )
        return torch.zeros(1)

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        return (self.weight * batch).sum()
