"""StreamDataset: a rank's buffer seen as a torch ``IterableDataset`` of batches.

Batches are formed here rather than by a ``DataLoader``: the buffer already
guarantees distinct samples, the user's ``process`` runs once per serving
(once per sample if the module declares ``deterministic_process``), and
``collate`` stacks the results with one copy per output of the batch (no
Python call per element). ``process`` may return numpy arrays instead of
tensors: they are stacked by numpy and handed to torch once per batch, which
on small samples is several times cheaper than a ``torch.from_numpy`` per
sample (bench/pipeline.py). ``next_batch`` lets the training loop wait with a
timeout, so that it can keep the ranks' bookkeeping going while data is late.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate

from melissa_dl.buffers.kinds import Buffer
from melissa_dl.buffers.sample import Sample
from melissa_dl.buffers.windows import Window, stacked

END = object()  # what next_batch returns once reception is over and the buffer drained


def collate(items: list[Any], views_of: Sequence[np.ndarray] = ()) -> Any:
    """Stack per-sample outputs (tensors, numpy arrays, numbers, or tuples/dicts of them). Numpy arrays that are
    evenly spaced views of one of the arrays ``views_of`` (a batch of windows, ``buffers.windows.stacked``) are
    taken as one strided view of it, without a copy, unless an earlier output of the batch views the same bytes
    (inputs ``u[:-1]`` and targets ``u[1:]``: an in-place change of one would change the other)."""
    return _collate(items, views_of, [])


def _collate(items: list[Any], views_of: Sequence[np.ndarray], taken: list[tuple[Any, int, int, int]]) -> Any:
    first = items[0]
    if isinstance(first, np.ndarray):  # np.array stacks in C: np.stack makes a view of each item first
        view = _strided(items, views_of, taken) if views_of else None
        return torch.from_numpy(view if view is not None else np.array(items))
    if isinstance(first, torch.Tensor):
        return torch.stack(items)
    if isinstance(first, (tuple, list)):
        return type(first)(_collate(list(column), views_of, taken) for column in zip(*items))
    if isinstance(first, dict):
        return {key: _collate([item[key] for item in items], views_of, taken) for key in first}
    return default_collate(items)


def _strided(
    items: list[np.ndarray], views_of: Sequence[np.ndarray], taken: list[tuple[Any, int, int, int]]
) -> np.ndarray | None:
    """``items`` stacked as a view, when they are views of one of ``views_of`` laid out at one distance from each
    other, none overlapping the next nor the bytes an earlier view of the batch (``taken``: base, first address,
    extent, distance) took (the arrays are the batch's own: a view shares no sample's memory); else None."""
    first = items[0]
    base, shape, strides, dtype = first.base, first.shape, first.strides, first.dtype
    if len(items) < 2 or not any(base is array for array in views_of) or not all(s > 0 for s in strides):
        return None
    alike = [i.base is base and i.strides == strides and i.shape == shape and i.dtype == dtype for i in items]
    if not all(alike):
        return None
    starts = [_address(item) for item in items]
    gap = starts[1] - starts[0]
    extent = first.itemsize + sum((n - 1) * stride for n, stride in zip(shape, strides))
    if gap < extent or any(b - a != gap for a, b in zip(starts, starts[1:])):
        return None
    for other, start, length, distance in taken:
        shift = (starts[0] - start) % gap
        if other is base and distance == gap and (shift < length or shift + extent > gap):
            return None
    taken.append((base, starts[0], extent, gap))
    return np.lib.stride_tricks.as_strided(first, (len(items), *shape), (gap, *strides))


def _address(array: np.ndarray) -> int:
    """Where the array's first value is (through ctypes for a contiguous, writable one: four times faster than
    ``__array_interface__``, which a batch of windows would ask per output and per window)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(array))  # type: ignore[arg-type]
    except (TypeError, ValueError, BufferError):  # read-only, not contiguous, empty
        return int(array.__array_interface__["data"][0])


@dataclass(frozen=True)
class Batch:
    """A training batch: what the module's ``process`` made of its samples, stacked, and whose they are."""

    data: Any
    ids: np.ndarray  # [n, 2]: (simulation, step) of each sample, in batch order

    def __len__(self) -> int:
        return len(self.ids)


class StreamDataset(IterableDataset):
    """``deterministic``: ``process`` runs once per sample as the buffer takes it, and batches are formed
    from its kept outputs (``Buffer.keep_processed``), in pinned memory if ``pin_memory`` (for a GPU)."""

    def __init__(
        self,
        buffer: Buffer,
        process: Callable[[Sample], Any],
        batch_size: int,
        deterministic: bool = False,
        pin_memory: bool = False,
    ) -> None:
        super().__init__()
        self.buffer = buffer
        self.process = process
        self.batch_size = batch_size
        self.deterministic = deterministic and not buffer.windowed  # rows per window would hold each step again
        if self.deterministic:
            buffer.keep_processed(process, pin_memory)

    def next_batch(self, timeout: float | None = None) -> Batch | object | None:
        """A batch, None if none could be formed within ``timeout``, or END."""
        if self.deterministic:
            formed = self.buffer.get_processed(self.batch_size, timeout=timeout)
            if isinstance(formed, tuple):
                return Batch(*formed)
            return END if formed == [] else None
        samples = self.buffer.get_batch(self.batch_size, timeout=timeout)
        if samples is None:
            return None
        if not samples:
            return END
        ids = np.array([(s.simulation_id, s.time_step) for s in samples], dtype=np.int64)
        if not self.buffer.windowed:
            return Batch(collate([self.process(s) for s in cast(list[Sample], samples)]), ids)
        windows, arrays = stacked(cast(list[Window], samples))
        return Batch(collate([self.process(w) for w in windows], arrays), ids)

    def __iter__(self) -> Iterator[Batch]:
        while isinstance(batch := self.next_batch(), Batch):
            yield batch
