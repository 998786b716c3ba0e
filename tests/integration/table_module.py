"""A TrainingModule with a ShardedEmbedding, for restarts on another number of ranks.

Row ``s * steps + t`` of the table belongs to step t of simulation s; the
model predicts toy_sim's field from that row and the parameters. Sparse Adam
keeps per-row state and a step count, so re-sharding must move both.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from melissa_dl.buffers.sample import Sample
from melissa_dl.embeddings.sparse_optim import make_sparse_optimizer
from melissa_dl.embeddings.table import ShardedEmbedding
from melissa_dl.train.module import TrainingModule


class Table(TrainingModule):
    def __init__(self, simulations: int, steps: int, dim: int = 4, optimizer: str = "adam") -> None:
        super().__init__()
        self.steps = steps
        self.table = ShardedEmbedding(simulations * steps, dim, make_sparse_optimizer(optimizer, 0.05), name="table")
        self.head = nn.Linear(dim + 2, 32)

    def configure_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.head.parameters(), lr=1e-2)

    def process(self, sample: Sample) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        row = np.array(sample.simulation_id * self.steps + sample.time_step, dtype=np.int64)
        target = sample.fields["field"].reshape(-1) / 1000
        return row, sample.parameters.astype(np.float32), target.astype(np.float32)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        rows, parameters, target = batch
        return nn.functional.mse_loss(self.head(torch.cat([self.table(rows), parameters], dim=1)), target)

    def validation_samples(self) -> list[Sample]:
        return []
