"""Processed samples kept as rows of preallocated tensors, so that a batch is one ``index_select`` per output.

Used when the module declares ``deterministic_process``: its ``process`` then
runs once per sample, in the receiver's thread as the sample arrives, and
every later serving of the sample (a FIRO or a Reservoir serves it several
times) copies rows instead of calling ``process`` and stacking again. Every
sample must process to the same structure of arrays, tensors or numbers with
the same shapes and dtypes; the first one fixes them. The rows are a second
copy of what the buffer holds (the samples themselves stay, for checkpoints),
and each row also keeps its sample's ``(simulation, step)``, so that a batch
knows whose samples it holds (the losses per sample, ``melissa_dl.study.learning``).
For a GPU (``pin_memory``) a batch is gathered straight into pinned memory,
which the copy to the device reads without a staging copy of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from operator import itemgetter
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from melissa_dl.buffers.sample import Sample
from melissa_dl.errors import ConfigError


class Rows:
    """Row storage of ``process``'s outputs; not thread-safe (the buffer's lock guards it)."""

    def __init__(self, process: Callable[[Sample], Any], capacity: int = 64, pin_memory: bool = False) -> None:
        self.process = process
        self.pin_memory = pin_memory
        self._capacity = capacity
        self._spec: TreeSpec | None = None
        self._columns: list[torch.Tensor] = []
        self._ids = torch.empty((capacity, 2), dtype=torch.int64)
        self._free: list[int] = []
        self._used = 0  # rows ever handed out; below it, the free ones are in _free
        self._structure: Callable[[list[torch.Tensor]], Any] = tuple
        self._index_np = np.empty(0, dtype=np.int64)
        self._index = torch.from_numpy(self._index_np)

    def prepare(self, sample: Sample) -> tuple[TreeSpec, list[torch.Tensor]]:
        """``process(sample)``'s outputs as tensors, and their structure (outside any lock)."""
        leaves, spec = tree_flatten(self.process(sample))
        return spec, [torch.as_tensor(leaf) for leaf in leaves]

    def add(self, sample: Sample, prepared: tuple[TreeSpec, list[torch.Tensor]]) -> int:
        """Store ``sample``'s prepared outputs; the row they went to."""
        spec, tensors = prepared
        if self._spec is None:
            self._spec = spec
            self._structure = _structure(spec)
            self._columns = [torch.empty((self._capacity, *t.shape), dtype=t.dtype) for t in tensors]
        elif spec != self._spec or any(
            t.shape != c.shape[1:] or t.dtype != c.dtype for t, c in zip(tensors, self._columns)
        ):
            raise ConfigError(
                f"training.class_name: deterministic_process, but process() of simulation {sample.simulation_id} "
                f"step {sample.time_step} gave {[(tuple(t.shape), t.dtype) for t in tensors]}, the first sample "
                f"{[(tuple(c.shape[1:]), c.dtype) for c in self._columns]} (set deterministic_process = False)"
            )
        if self._free:
            row = self._free.pop()
        else:
            if self._used == self._capacity:
                self._grow()
            row, self._used = self._used, self._used + 1
        for column, tensor in zip(self._columns, tensors):
            column[row] = tensor
        self._ids[row, 0], self._ids[row, 1] = sample.simulation_id, sample.time_step
        return row

    def release(self, rows: list[int]) -> None:
        self._free += rows

    def gather(self, rows: list[int]) -> tuple[Any, np.ndarray]:
        """The batch of these rows, in their order, structured as ``process`` returns one sample, and the
        ``[n, 2]`` ``(simulation, step)`` of each."""
        assert self._spec is not None
        if len(rows) != len(self._index_np):
            self._index_np = np.empty(len(rows), dtype=np.int64)
            self._index = torch.from_numpy(self._index_np)
        self._index_np[:] = rows  # refilled in place: index_select is done with it before the next batch
        if self.pin_memory:
            shapes = [(len(rows), *column.shape[1:]) for column in self._columns]
            batch = [
                torch.index_select(column, 0, self._index, out=torch.empty(shape, dtype=column.dtype, pin_memory=True))
                for column, shape in zip(self._columns, shapes)
            ]
        else:
            batch = [column.index_select(0, self._index) for column in self._columns]
        return self._structure(batch), self._ids.index_select(0, self._index).numpy()

    def _grow(self) -> None:
        self._capacity *= 2
        self._columns = [torch.cat([column, torch.empty_like(column)]) for column in self._columns]
        self._ids = torch.cat([self._ids, torch.empty_like(self._ids)])


def _structure(spec: TreeSpec) -> Callable[[list[torch.Tensor]], Any]:
    """How a batch is built from its columns: directly for one output or a plain tuple or list of them
    (on small samples ``tree_unflatten`` costs as much as an ``index_select``), else from ``spec``."""
    if spec.is_leaf():
        return itemgetter(0)
    if spec.type in (tuple, list) and spec == tree_flatten(spec.type(range(spec.num_leaves)))[1]:
        return spec.type
    return partial(tree_unflatten, treespec=spec)
