"""The sparse path's per-row operations on CPU tensors, by the compiled loops of ``row_loops`` where they load.

torch's ops each make a pass over the touched rows: an optimizer step
gathers the rows of the table and of its state, does its arithmetic on the
gathered blocks op by op and writes them back (4 to 8 passes and as many
temporaries); summing the gradients of repeated ids zero-fills a block and
adds into it. The loops read each gradient row once and update the table
row and its state where they lie. ``bench/sparse_optim.py`` measures both.

``load()`` is None where numba cannot be imported or compile, and callers
then keep the torch path, as they do on GPUs and for float16 or bfloat16
tables.
"""
from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

if TYPE_CHECKING:
    from types import ModuleType

logger = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.float64)


@functools.cache
def load() -> Kernels | None:
    """The compiled kernels, each compiled (or read from numba's cache) and run once here, or None when numba
    is missing or fails (a damaged cache file, an unwritable cache folder): the torch path runs instead."""
    try:
        from melissa_dl import row_loops

        kernels = Kernels(row_loops)
        kernels.warm_up()
    except Exception:  # any failure of the optional compiler leaves the torch path
        logger.warning("numba's compiled loops are not available; the sparse path runs torch ops", exc_info=True)
        return None
    return kernels


def usable(*tensors: torch.Tensor) -> Kernels | None:
    """The kernels, when every tensor is a contiguous CPU float32/float64 one and numba is there; else None."""
    if all(t.device.type == "cpu" and t.dtype in DTYPES and t.is_contiguous() for t in tensors):
        return load()
    return None


class Kernels:
    """The loops of ``row_loops`` on tensors: every constant in the table's dtype, as torch casts them, so that
    the arithmetic is the torch path's and stays in SIMD lanes of that dtype (a Python int or float in a loop
    would promote it to float64)."""

    def __init__(self, loops: ModuleType) -> None:
        self._loops = loops

    def warm_up(self) -> None:
        """Each loop once per table dtype, on two rows: compiled (or read from the cache) now, not mid-step."""
        keys = self.sorted_keys(torch.tensor([1, 0, 1]))
        assert keys is not None
        for dtype in DTYPES:
            table, state, grads = (torch.ones(rows, 2, dtype=dtype) for rows in (2, 2, 3))
            self.sgd(table, keys, grads, 0.1)
            self.adagrad(table, state, keys, grads, 0.1, 1e-10)
            self.row_adagrad(table, state[:, 0].contiguous(), keys, grads, 0.1, 1e-10)
            self.adam(table, torch.zeros(2, 2, 2, dtype=dtype), keys, grads, 0.9, 0.999, 0.1, 1e-8)
            self.sum_rows(grads, torch.tensor([1, 0, 1]), 2)
        self.unique(torch.tensor([3, 1, 3]))

    def sorted_keys(self, ids: torch.Tensor) -> SortedKeys | None:
        """1-D int64 CPU ``ids`` (at least one) as ``id << bits | position``, sorted by numpy's SIMD sort: ids
        in ascending order, the positions of one id next to each other in ascending order. None for ids too
        large to pack that way (beyond about 2**50 for a batch of 4096)."""
        values = ids.numpy()
        bits = max(len(values) - 1, 1).bit_length()
        keys = np.empty_like(values)
        if not self._loops.pack_keys(values, bits, keys):
            return None
        keys.sort()
        return SortedKeys(keys, bits)

    def sgd(self, weight: torch.Tensor, keys: SortedKeys, grads: torch.Tensor, lr: float) -> int:
        return self._loops.sgd(*_arrays(weight, grads), *keys, *_scalars(weight, lr))

    def adagrad(self, weight: torch.Tensor, total: torch.Tensor, keys: SortedKeys, grads: torch.Tensor,
                lr: float, eps: float) -> int:
        return self._loops.adagrad(*_arrays(weight, total, grads), *keys, *_scalars(weight, lr, eps))

    def row_adagrad(self, weight: torch.Tensor, total: torch.Tensor, keys: SortedKeys, grads: torch.Tensor,
                    lr: float, eps: float) -> int:
        return self._loops.row_adagrad(*_arrays(weight, total, grads), *keys,
                                       *_scalars(weight, lr, eps, 1 / weight.shape[1]))

    def adam(self, weight: torch.Tensor, moments: torch.Tensor, keys: SortedKeys, grads: torch.Tensor,
             beta1: float, beta2: float, step_size: float, eps: float) -> int:
        return self._loops.adam(*_arrays(weight, moments, grads), *keys,
                                *_scalars(weight, 1 - beta1, beta2, 1 - beta2, step_size, eps))

    def sum_rows(self, grads: torch.Tensor, inverse: torch.Tensor, rows: int) -> torch.Tensor:
        """The gradient of each of ``rows`` rows: ``grads`` summed by ``inverse`` (``index_add_`` into zeros)."""
        out = grads.new_empty((rows, grads.shape[1]))
        self._loops.sum_rows(*_arrays(grads, inverse, out), np.empty(rows, dtype=np.bool_))
        return out

    def unique(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``torch.unique(ids, sorted=True, return_inverse=True)`` of 1-D int64 CPU ids (at least one), or None
        for ids too large to pack: one pass over their ``sorted_keys``, 2x faster than after an argsort and
        3-6x faster than ``torch.unique`` on a batch of 4096 ids."""
        keys = self.sorted_keys(ids)
        if keys is None:
            return None
        unique, inverse = np.empty_like(keys.keys), np.empty_like(keys.keys)
        count = self._loops.unique_sorted_keys(*keys, unique, inverse)
        return torch.from_numpy(unique[:count]), torch.from_numpy(inverse)


class SortedKeys(NamedTuple):
    """A batch's ids packed with their positions and sorted (``Kernels.sorted_keys``)."""

    keys: np.ndarray
    bits: int  # the low bits that hold the position

    @property
    def bounds(self) -> tuple[int, int]:
        """The smallest and the largest id."""
        return int(self.keys[0]) >> self.bits, int(self.keys[-1]) >> self.bits


def _arrays(*tensors: torch.Tensor) -> list[np.ndarray]:
    return [t.detach().numpy() for t in tensors]


def _scalars(like: torch.Tensor, *values: float) -> list[Any]:
    kind = np.float32 if like.dtype == torch.float32 else np.float64
    return [kind(v) for v in values]
