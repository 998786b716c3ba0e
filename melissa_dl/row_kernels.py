"""The sparse path's per-row loops on CPU, compiled by numba: one pass where torch needs several.

torch's ops each make a pass over the touched rows: an optimizer step
gathers the rows of the table and of its state, does its arithmetic on the
gathered blocks op by op and writes them back (4 to 8 passes and as many
temporaries); summing the gradients of repeated ids zero-fills a block and
adds into it. These loops read each gradient row once and update the table
row and its state where they lie. ``bench/sparse_optim.py`` measures both:
on a 2-core VM, one thread, 4096 uniform ids of a 1M x 64 float32 table, a
step took (us per batch, compiled / torch) SGD 269 / 667, Adagrad 574 / 1440,
RowAdagrad 439 / 842, Adam 911 / 2365; the gradient sum 105 / 136, the dedup
59 / 185.

Every function here takes numpy views of CPU tensors (no copy) and is
compiled on its first call (cached on disk by numba); ``load()`` is None where
numba cannot be imported, and callers then keep the torch path, as they do
on GPUs and for float16 or bfloat16 tables.
"""
from __future__ import annotations

import functools
import logging
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

DTYPES = (torch.float32, torch.float64)


@functools.cache
def load() -> Kernels | None:
    """The compiled kernels, each compiled (or read from numba's cache) and run once here, or None when numba
    is missing or fails (a damaged cache file, an unwritable cache folder): the torch path runs instead."""
    try:
        import numba

        # reassoc: a row's sum of squares may be summed in SIMD lanes (2x faster RowAdagrad; the order, not the
        # operations, differs from torch's); contract: fused multiply-adds
        kernels = Kernels(numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"}))
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


def _sgd(weight: np.ndarray, rows: np.ndarray, grads: np.ndarray, lr: Any) -> None:
    for i in range(rows.shape[0]):
        w = weight[rows[i]]
        for j in range(w.shape[0]):
            w[j] -= lr * grads[i, j]


def _adagrad(weight: np.ndarray, total: np.ndarray, rows: np.ndarray, grads: np.ndarray, lr: Any,
             eps: Any) -> None:
    for i in range(rows.shape[0]):
        w, acc = weight[rows[i]], total[rows[i]]
        for j in range(w.shape[0]):
            g = grads[i, j]
            acc[j] += g * g
            w[j] -= lr * (g / (np.sqrt(acc[j]) + eps))


def _row_adagrad(weight: np.ndarray, total: np.ndarray, rows: np.ndarray, grads: np.ndarray, lr: Any,
                 eps: Any, inv_dim: Any) -> None:
    dim = weight.shape[1]
    for i in range(rows.shape[0]):
        r = rows[i]
        square = inv_dim - inv_dim  # 0 of the table's dtype
        for j in range(dim):
            square += grads[i, j] * grads[i, j]
        total[r] += square * inv_dim
        scale = -lr / (np.sqrt(total[r]) + eps)
        w = weight[r]
        for j in range(dim):
            w[j] += grads[i, j] * scale


def _adam(weight: np.ndarray, moments: np.ndarray, rows: np.ndarray, grads: np.ndarray, one_minus_beta1: Any,
          beta2: Any, one_minus_beta2: Any, step_size: Any, eps: Any) -> None:
    for i in range(rows.shape[0]):
        r = rows[i]
        w, m, v = weight[r], moments[r, 0], moments[r, 1]
        for j in range(w.shape[0]):
            g = grads[i, j]
            m[j] += one_minus_beta1 * (g - m[j])
            v[j] = v[j] * beta2 + one_minus_beta2 * (g * g)
            w[j] -= step_size * (m[j] / (np.sqrt(v[j]) + eps))


def _sum_rows(grads: np.ndarray, inverse: np.ndarray, out: np.ndarray, seen: np.ndarray) -> None:
    """``out[inverse[i]] += grads[i]`` into an uninitialised ``out``: a row's first gradient is copied, the
    next ones added, and rows no gradient reaches zeroed at the end (no zero-filling pass first)."""
    seen[:] = False
    for i in range(inverse.shape[0]):
        k = inverse[i]
        o = out[k]
        if seen[k]:
            for j in range(o.shape[0]):
                o[j] += grads[i, j]
        else:
            seen[k] = True
            for j in range(o.shape[0]):
                o[j] = grads[i, j]
    for k in range(out.shape[0]):
        if not seen[k]:
            out[k] = 0


def _unique(ids: np.ndarray, order: np.ndarray, unique: np.ndarray, inverse: np.ndarray) -> int:
    """The distinct ``ids`` in ascending order (``order`` sorts them), and where each id went; how many."""
    count = 0
    for k in range(order.shape[0]):
        i = order[k]
        if count == 0 or ids[i] != unique[count - 1]:
            unique[count] = ids[i]
            count += 1
        inverse[i] = count - 1
    return count


class Kernels:
    """The loops above, compiled, on tensors: every constant in the table's dtype, as torch casts them, so that
    the arithmetic is the torch path's and stays in SIMD lanes of that dtype (a Python int or float in a loop
    would promote it to float64)."""

    def __init__(self, compile_: Any) -> None:
        self._sgd, self._adagrad, self._row_adagrad, self._adam, self._sum_rows, self._unique = (
            compile_(f) for f in (_sgd, _adagrad, _row_adagrad, _adam, _sum_rows, _unique))

    def warm_up(self) -> None:
        """Each loop once per table dtype, on two rows: compiled (or read from the cache) now, not mid-step."""
        for dtype in DTYPES:
            table, state, grads = (torch.ones(2, 2, dtype=dtype) for _ in range(3))
            rows = torch.arange(2)
            self.sgd(table, rows, grads, 0.1)
            self.adagrad(table, state, rows, grads, 0.1, 1e-10)
            self.row_adagrad(table, state[:, 0].contiguous(), rows, grads, 0.1, 1e-10)
            self.adam(table, torch.zeros(2, 2, 2, dtype=dtype), rows, grads, 0.9, 0.999, 0.1, 1e-8)
            self.sum_rows(grads, rows, 2)
        self.unique(torch.tensor([3, 1, 3]))

    def sgd(self, weight: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, lr: float) -> None:
        self._sgd(*_arrays(weight, rows, grads), *_scalars(weight, lr))

    def adagrad(self, weight: torch.Tensor, total: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor,
                lr: float, eps: float) -> None:
        self._adagrad(*_arrays(weight, total, rows, grads), *_scalars(weight, lr, eps))

    def row_adagrad(self, weight: torch.Tensor, total: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor,
                    lr: float, eps: float) -> None:
        self._row_adagrad(*_arrays(weight, total, rows, grads), *_scalars(weight, lr, eps, 1 / weight.shape[1]))

    def adam(self, weight: torch.Tensor, moments: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor,
             beta1: float, beta2: float, step_size: float, eps: float) -> None:
        self._adam(*_arrays(weight, moments, rows, grads),
                   *_scalars(weight, 1 - beta1, beta2, 1 - beta2, step_size, eps))

    def sum_rows(self, grads: torch.Tensor, inverse: torch.Tensor, rows: int) -> torch.Tensor:
        """The gradient of each of ``rows`` rows: ``grads`` summed by ``inverse`` (``index_add_`` into zeros)."""
        out = grads.new_empty((rows, grads.shape[1]))
        self._sum_rows(*_arrays(grads, inverse, out), np.empty(rows, dtype=np.bool_))
        return out

    def unique(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``torch.unique(ids, sorted=True, return_inverse=True)`` of 1-D int64 CPU ids, after numpy's
        (SIMD) argsort: one pass instead of ``np.unique``'s several."""
        values = ids.numpy()
        unique, inverse = np.empty_like(values), np.empty_like(values)
        count = self._unique(values, np.argsort(values), unique, inverse)
        return torch.from_numpy(unique[:count]), torch.from_numpy(inverse)


def _arrays(*tensors: torch.Tensor) -> list[np.ndarray]:
    return [t.detach().numpy() for t in tensors]


def _scalars(like: torch.Tensor, *values: float) -> list[Any]:
    kind = np.float32 if like.dtype == torch.float32 else np.float64
    return [kind(v) for v in values]
