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
        from melissa_dl.embeddings import row_loops

        kernels = Kernels(row_loops)
        kernels.warm_up()
    except Exception:  # any failure of the optional compiler leaves the torch path
        logger.warning("numba's compiled loops are not available; the sparse path runs torch ops", exc_info=True)
        return None
    return kernels


def fits(*tensors: torch.Tensor) -> bool:
    """Whether every tensor is one the loops take: contiguous, on the CPU, float32 or float64."""
    return all(t.device.type == "cpu" and t.dtype in DTYPES and t.is_contiguous() for t in tensors)


def usable(*tensors: torch.Tensor) -> Kernels | None:
    """The kernels, when the tensors ``fit`` and numba is there; else None."""
    return load() if fits(*tensors) else None


class Kernels:
    """The loops of ``row_loops``: the optimizers' on numpy views of a shard, its state and the gradients,
    ``sum_rows`` and ``unique`` on CPU tensors. Every constant is cast to the table's dtype, as torch casts them,
    so that the arithmetic is the torch path's and stays in SIMD lanes of that dtype (a Python int or float in a
    loop would promote it to float64)."""

    def __init__(self, loops: ModuleType) -> None:
        self._loops = loops

    def warm_up(self) -> None:
        """Each loop once per table dtype and key width, on two rows: compiled (or read from the cache) now, not
        mid-step."""
        for dtype in DTYPES:
            grads = torch.ones(3, 2, dtype=dtype)
            g = grads.numpy()
            for width in (np.uint32, np.int64):
                keys = SortedKeys(np.array([1, 4, 6], width), 2)  # ids 1, 0, 1 at positions 0, 1, 2, sorted
                self.sum_rows(grads, keys, 2, 2)
                self.sgd(g[:2].copy(), keys, g, 0.1)
                self.adagrad(g[:2].copy(), g[:2].copy(), keys, g, 0.1, 1e-10)
                self.row_adagrad(g[:2].copy(), g[:2, 0].copy(), keys, g, 0.1, 1e-10)
                self.adam(g[:2].copy(), np.stack([g[:2], g[:2]], axis=1), keys, g, 0.9, 0.999, 0.1, 1e-8)
        for ids in ([3, 1, 3], [3, 1, 1 << 40]):  # keys of 32 bits, then of 64
            self.unique(torch.tensor(ids))

    def sorted_keys(self, ids: torch.Tensor, limit: int) -> SortedKeys | None:
        """1-D int64 CPU ``ids`` (at least one) as ``id << bits | position``, sorted by numpy's SIMD sort: ids
        in ascending order, the positions of one id next to each other in ascending order. The keys are uint32
        when they fit (twice as fast to sort as int64), else int64. None for an id outside ``[0, limit)`` or
        too large to pack (beyond about 2**50 for a batch of 4096)."""
        values = ids.numpy()
        bits = max(len(values) - 1, 1).bit_length()
        keys = np.empty_like(values)
        width = self._loops.pack_keys(values, limit, bits, keys)
        if not width:
            return None
        keys = keys.view(np.uint32)[: len(values)] if width == 32 else keys
        keys.sort()
        return SortedKeys(keys, bits)

    def sgd(self, weight: np.ndarray, keys: SortedKeys, grads: np.ndarray, lr: float) -> int:
        return self._loops.sgd(weight, grads, *keys, *_scalars(weight, lr))

    def adagrad(
        self, weight: np.ndarray, total: np.ndarray, keys: SortedKeys, grads: np.ndarray, lr: float, eps: float
    ) -> int:
        return self._loops.adagrad(weight, total, grads, *keys, *_scalars(weight, lr, eps))

    def row_adagrad(
        self, weight: np.ndarray, total: np.ndarray, keys: SortedKeys, grads: np.ndarray, lr: float, eps: float
    ) -> int:
        return self._loops.row_adagrad(weight, total, grads, *keys, *_scalars(weight, lr, eps, 1 / weight.shape[1]))

    def adam(
        self,
        weight: np.ndarray,
        moments: np.ndarray,
        keys: SortedKeys,
        grads: np.ndarray,
        beta1: float,
        beta2: float,
        step_size: float,
        eps: float,
    ) -> int:
        return self._loops.adam(
            weight, moments, grads, *keys, *_scalars(weight, 1 - beta1, beta2, 1 - beta2, step_size, eps)
        )

    def sum_rows(self, grads: torch.Tensor, keys: SortedKeys, rows: int, divisor: int) -> torch.Tensor:
        """The gradient of each of the ``rows`` distinct ids of ``keys``: the ``grads`` rows at their positions
        summed in position order (as ``index_add_`` into zeros sums them, but for the sign of a zero sum: -0.0
        here, +0.0 there), divided by ``divisor``."""
        out = grads.new_empty((rows, grads.shape[1]))
        self._loops.sum_runs(grads.numpy(), *keys, out.numpy(), *_scalars(out.numpy(), divisor))
        return out

    def unique(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, SortedKeys] | None:
        """``torch.unique(ids, sorted=True, return_inverse=True)`` of 1-D int64 CPU ids (at least one) and the
        ``sorted_keys`` it came from, or None for ids negative or too large to pack: one pass over the keys, 2x
        faster than after an argsort and 3-6x faster than ``torch.unique`` on a batch of 4096 ids."""
        keys = self.sorted_keys(ids, 1 << 62)
        if keys is None:
            return None
        unique, inverse = np.empty(len(ids), np.int64), np.empty(len(ids), np.int64)
        count = self._loops.unique_sorted_keys(*keys, unique, inverse)
        return torch.from_numpy(unique[:count]), torch.from_numpy(inverse), keys


class SortedKeys(NamedTuple):
    """A batch's ids packed with their positions and sorted (``Kernels.sorted_keys``)."""

    keys: np.ndarray  # uint32 or int64
    bits: int  # the low bits that hold the position


def _scalars(like: np.ndarray, *values: float) -> list[Any]:
    return [like.dtype.type(v) for v in values]
