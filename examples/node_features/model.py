"""A neural-field surrogate of the heat equation with a learned feature per mesh node.

``NodeFieldSurrogate`` predicts the temperature at one grid node from

- that node's learned feature vector: one row of a ``ShardedEmbedding`` with
  ``nx * ny`` rows (one per grid node, row ``i * ny + j`` for node ``(i, j)``),
  shared by every simulation: a *spatial encoding* learned from the data
  instead of hand-made coordinates or Fourier features;
- the simulation's five parameters, normalised to ``[-1, 1]``;
- the time, ``t / steps`` in ``[0, 1)``;

through an MLP applied node by node. Each training sample is a random subset
of ``nodes_per_sample`` nodes of one time step (``process``), so a batch
touches a few thousand rows of the table; the server looks them up on the
ranks that own them and applies the sparse optimizer (``embedding_optimizer``,
``embedding_lr``) to those rows only after every backward. The MLP is a dense
module like any other: ``configure_optimizer`` returns Adam over
``self.parameters()``, which do not include the embedding's shard (a buffer).

Normalisation is the one of ``examples/heat_pde/surrogate.py``: parameters in
``[low, high]`` -> ``[-1, 1]``, temperatures ``T -> (T - mid) / (range / 4)``.

Validation: held-out simulations (parameter sets drawn uniformly with
``validation_seed``), solved in-process with the study's solver
(``examples/heat_pde/solver.py``), every ``validation_stride``-th time step,
evaluated on *all* nodes. Their simulation ids are negative, which is how
``process`` tells them from study samples. The embedding lookup is a
collective, so every rank must run the same number of validation batches:
the held-out list is made a multiple of the number of ranks, and with the
default ``validation_batch_size`` (256) each rank's share is one batch.

Tuning (one process, the real ``ShardedEmbedding`` on one rank, batches of
64 = the 2 ranks x 32 of the config, 32 Sobol simulations x 100 steps, 128
nodes per sample; validation loss 0.65 before training): dim 16, 3 x 128
GELU, Adam lr 4e-3 and RowAdagrad lr 0.3 reach 0.040 after 50 batches, 0.0076
after 300 and 0.002 after 1000. RowAdagrad lr 0.1 or Adam lr 0.03 on the rows
are about twice as slow over the first 300 batches; lr 1.0 is no better than
0.3. Width 64 costs 2.5x less per batch but needs twice the batches to get
under 0.05. The learned rows are what carries the space: with the rows frozen
at their random initial values (lr 0) the loss stalls at 0.42 after 300
batches, as an MLP that sees no node at all does (0.43: the spatial variance
of the field).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from melissa_dl import Sample, ShardedEmbedding, TrainingModule, make_sparse_optimizer

FIELD = "temperature"
N_PARAMETERS = 5


def _load_solver() -> Any:
    """The heat_pde example's solver module (the simulations run the same file)."""
    name = "melissa_example_heat_solver"
    if name not in sys.modules:
        path = Path(__file__).resolve().parent.parent / "heat_pde" / "solver.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


solver = _load_solver()


class NodeFieldSurrogate(TrainingModule):
    """MLP ``(node feature, 5 parameters, t) -> temperature at that node``."""

    def __init__(
        self,
        dim: int = 16,
        hidden: int = 128,
        depth: int = 3,
        lr: float = 2e-3,
        embedding_optimizer: str = "rowadagrad",
        embedding_lr: float = 0.1,
        nodes_per_sample: int = 128,
        nx: int = 32,
        ny: int = 32,
        steps: int = 100,
        dt: float = solver.DEFAULT_DT,
        low: float = 100.0,
        high: float = 500.0,
        validation_simulations: int = 4,
        validation_stride: int = 5,
        validation_seed: int = 1,
        seed: int = 0,
    ) -> None:
        """``nx``, ``ny``, ``steps`` and ``dt`` must match the simulation's command
        line; ``low``/``high`` are the bounds of the parameter sweep; ``seed``
        seeds the embedding's initial rows and (plus the rank) the node subsets."""
        super().__init__()
        if depth < 1 or hidden < 1 or dim < 1:
            raise ValueError(f"need depth, hidden and dim >= 1, got {depth}, {hidden}, {dim}")
        if not 0 < nodes_per_sample <= nx * ny:
            raise ValueError(f"nodes_per_sample must be in [1, {nx * ny}], got {nodes_per_sample}")
        if not low < high:
            raise ValueError(f"need low < high, got low={low}, high={high}")
        self.lr = lr
        self.nx, self.ny, self.steps, self.dt = nx, ny, steps, dt
        self.low, self.high = low, high
        self.nodes = nx * ny
        self.nodes_per_sample = nodes_per_sample
        self.validation_simulations = validation_simulations
        self.validation_stride = validation_stride
        self.validation_seed = validation_seed
        self.seed = seed
        self.param_mid, self.param_half = (low + high) / 2, (high - low) / 2
        self.temp_mid, self.temp_scale = (low + high) / 2, (high - low) / 4
        self._rng: np.random.Generator | None = None  # made on first use: the rank is known by then
        self._all_nodes = np.arange(self.nodes, dtype=np.int64)
        self.prediction_inputs = {"parameters": ("float32", (N_PARAMETERS,)), "time_step": ("float32", ())}

        optimizer = make_sparse_optimizer(embedding_optimizer, embedding_lr)  # sgd, adagrad, rowadagrad, adam
        self.embedding = ShardedEmbedding(self.nodes, dim, optimizer=optimizer, seed=seed, name="nodes")
        layers: list[nn.Module] = []
        width = dim + N_PARAMETERS + 1
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, node_ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Node ids ``[B, n]`` and normalised inputs ``[B, 6]`` -> normalised temperatures ``[B, n]``.

        A collective: every rank must call it the same number of times.
        """
        features = self.embedding(node_ids)  # [B, n, dim], rows fetched from their owners
        conditions = x[:, None, :].expand(-1, node_ids.shape[1], -1)
        return self.net(torch.cat([features, conditions], dim=-1)).squeeze(-1)

    def configure_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)  # the MLP; the embedding has its own

    def inputs(self, parameters: np.ndarray, time_step: int) -> np.ndarray:
        """The normalised parameters and time of one step (float32, 6 values)."""
        x = np.empty(N_PARAMETERS + 1, dtype=np.float32)
        x[:N_PARAMETERS] = (parameters - self.param_mid) / self.param_half
        x[N_PARAMETERS] = time_step / self.steps
        return x

    def process(self, sample: Sample) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One step -> ``(node ids int64 [n], inputs float32 [6], targets float32 [n])``.

        A random subset of ``nodes_per_sample`` nodes for a study sample, all
        nodes in a fixed order for a held-out one (negative simulation id).
        Numpy arrays: the dataset stacks them once per batch.
        """
        if sample.simulation_id < 0:
            ids = self._all_nodes
        else:
            if self._rng is None:
                self._rng = np.random.default_rng([self.seed, self.rank])
            ids = self._rng.choice(self.nodes, size=self.nodes_per_sample, replace=False)
        field = sample.fields[FIELD].reshape(-1)
        y = (field[ids] - np.float32(self.temp_mid)) / np.float32(self.temp_scale)
        return ids, self.inputs(sample.parameters, sample.time_step), y.astype(np.float32, copy=False)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        node_ids, x, y = batch
        return nn.functional.mse_loss(self(node_ids, x), y)

    def predict(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``parameters [n, 5]`` and ``time_step [n]`` (``prediction_inputs``) -> ``temperature [n, nx, ny]`` in
        physical units, every node's (on more than one rank, a collective)."""
        parameters = inputs["parameters"]
        x = torch.cat([(parameters - self.param_mid) / self.param_half, (inputs["time_step"] / self.steps)[:, None]], 1)
        nodes = torch.arange(self.nodes, device=parameters.device).expand(parameters.shape[0], -1)  # traced: no len()
        y = self(nodes, x) * self.temp_scale + self.temp_mid
        return {FIELD: y.reshape(-1, self.nx, self.ny)}

    def validation_parameters(self) -> np.ndarray:
        """The held-out parameter sets, ``[validation_simulations, 5]``."""
        rng = np.random.default_rng(self.validation_seed)
        return rng.uniform(self.low, self.high, size=(self.validation_simulations, N_PARAMETERS))

    def validation_samples(self) -> list[Sample]:
        """Every ``validation_stride``-th step of the held-out simulations, solved here.

        Trimmed to a multiple of the number of ranks, so that every rank runs
        as many validation lookups (collectives) as the others.
        """
        samples = []
        for i, parameters in enumerate(self.validation_parameters()):
            heat = solver.HeatSolver(parameters, self.nx, self.ny, self.dt)
            for t in range(self.steps):
                field = heat.step()
                if t % self.validation_stride == 0:
                    samples.append(Sample(-1 - i, t, parameters, {FIELD: field}))
        return samples[: len(samples) - len(samples) % self.world_size]
