"""The sparse path's per-row loops, compiled by numba: imported only by ``row_kernels.load()``, which falls back
to torch's ops when this module cannot be imported or its loops cannot be compiled.

Each function takes numpy views of CPU tensors (no copy), is compiled on its
first call and cached on disk by numba. An optimizer step is one pass over
the batch's ids sorted with their positions (``keys``): the gradients of a
repeated id are summed as the pass reaches it, and each row and its state
are updated where they lie, with no gradient block built. The rows are
random rows of a table far larger than the caches: the pass asks for the
rows ``AHEAD`` keys in advance (``_prefetch_row``), so that their memory
latencies overlap instead of adding up (a RowAdagrad step over 4096 uniform
rows of a 1M x 64 float32 table: 250 us instead of 345 on a 2-core VM).
"""
from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

AHEAD = 8  # rows prefetched in advance; 4 to 32 measured the same

# reassoc: a row's sum of squares may be summed in SIMD lanes (2x faster RowAdagrad; the order, not the
# operations, differs from torch's); contract: fused multiply-adds
_jit = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})
_jit_in_order = numba.njit(cache=True, nogil=True, error_model="numpy")  # sums exactly in the order written


@intrinsic
def _prefetch_row(typingctx: Any, array: Any, row: Any) -> Any:
    """Start loading every cache line of ``array[row]`` for writing (LLVM's prefetch; no effect on values)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        view = context.make_array(signature.args[0])(context, builder, args[0])
        intp = context.get_value_type(types.intp)
        stride = builder.extract_value(view.strides, 0)
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        start = builder.add(builder.ptrtoint(view.data, intp), builder.mul(index, stride))
        byte_pointer, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        prefetch = builder.module.declare_intrinsic(  # named for typed or opaque pointers, as the LLVM has them
            "llvm.prefetch", [byte_pointer], ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32]))
        first = builder.and_(start, ir.Constant(intp, ~63))  # the cache line holding the row's first byte
        end = builder.add(start, stride)
        lines = builder.udiv(builder.add(builder.sub(end, first), ir.Constant(intp, 63)), ir.Constant(intp, 64))
        with cgutils.for_range(builder, lines) as loop:
            line = builder.add(first, builder.mul(loop.index, ir.Constant(intp, 64)))
            # write intent, keep in all cache levels, data cache
            builder.call(prefetch, [builder.inttoptr(line, byte_pointer), i32(1), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(array, row), codegen


@_jit_in_order
def _next_row(keys: np.ndarray, k: int, bits: int, grads: np.ndarray, scratch: np.ndarray) -> tuple[int, int, int]:
    """The row of ``keys[k]`` with its gradient, and the index of the next row's first key.

    ``keys`` are ``id << bits | position`` sorted, so the positions of one id
    follow each other in ascending order. The gradient is ``grads[position]``
    when the id appears once (returned position >= 0); else the gradients of
    all its positions summed into ``scratch``, in position order as
    ``index_add_`` sums them (returned position -1).
    """
    n, mask = keys.shape[0], (1 << bits) - 1
    row, first = keys[k] >> bits, keys[k] & mask
    k += 1
    if k == n or keys[k] >> bits != row:
        return row, first, k
    g = grads[first]
    for j in range(scratch.shape[0]):
        scratch[j] = g[j]
    while k + 3 < n and keys[k + 3] >> bits == row:  # four at a time, added in the same order: 1.6x faster
        g0, g1 = grads[keys[k] & mask], grads[keys[k + 1] & mask]
        g2, g3 = grads[keys[k + 2] & mask], grads[keys[k + 3] & mask]
        for j in range(scratch.shape[0]):
            scratch[j] = scratch[j] + g0[j] + g1[j] + g2[j] + g3[j]
        k += 4
    while k < n and keys[k] >> bits == row:
        g = grads[keys[k] & mask]
        for j in range(scratch.shape[0]):
            scratch[j] += g[j]
        k += 1
    return row, -1, k


# Each step below prefetches the rows AHEAD keys on itself: the same lines in a helper function, inlined or not,
# made RowAdagrad 1.2-1.6x slower.


@_jit
def sgd(weight: np.ndarray, grads: np.ndarray, keys: np.ndarray, bits: int, lr: Any) -> int:
    scratch, k, rows = np.empty_like(weight[0]), 0, 0
    while k < keys.shape[0]:
        if k + AHEAD < keys.shape[0]:
            _prefetch_row(weight, keys[k + AHEAD] >> bits)
        r, p, k = _next_row(keys, k, bits, grads, scratch)
        g, w = grads[p] if p >= 0 else scratch, weight[r]
        for j in range(w.shape[0]):
            w[j] -= lr * g[j]
        rows += 1
    return rows


@_jit
def adagrad(weight: np.ndarray, total: np.ndarray, grads: np.ndarray, keys: np.ndarray, bits: int, lr: Any,
            eps: Any) -> int:
    scratch, k, rows = np.empty_like(weight[0]), 0, 0
    while k < keys.shape[0]:
        if k + AHEAD < keys.shape[0]:
            ahead = keys[k + AHEAD] >> bits
            _prefetch_row(weight, ahead)
            _prefetch_row(total, ahead)
        r, p, k = _next_row(keys, k, bits, grads, scratch)
        g, w, acc = grads[p] if p >= 0 else scratch, weight[r], total[r]
        for j in range(w.shape[0]):
            acc[j] += g[j] * g[j]
            w[j] -= lr * (g[j] / (np.sqrt(acc[j]) + eps))
        rows += 1
    return rows


@_jit
def row_adagrad(weight: np.ndarray, total: np.ndarray, grads: np.ndarray, keys: np.ndarray, bits: int, lr: Any,
                eps: Any, inv_dim: Any) -> int:
    scratch, k, rows = np.empty_like(weight[0]), 0, 0
    while k < keys.shape[0]:
        if k + AHEAD < keys.shape[0]:
            ahead = keys[k + AHEAD] >> bits
            _prefetch_row(weight, ahead)
            _prefetch_row(total, ahead)
        r, p, k = _next_row(keys, k, bits, grads, scratch)
        g, w = grads[p] if p >= 0 else scratch, weight[r]
        square = inv_dim - inv_dim  # 0 of the table's dtype
        for j in range(w.shape[0]):
            square += g[j] * g[j]
        total[r] += square * inv_dim
        scale = -lr / (np.sqrt(total[r]) + eps)
        for j in range(w.shape[0]):
            w[j] += g[j] * scale
        rows += 1
    return rows


@_jit
def adam(weight: np.ndarray, moments: np.ndarray, grads: np.ndarray, keys: np.ndarray, bits: int,
         one_minus_beta1: Any, beta2: Any, one_minus_beta2: Any, step_size: Any, eps: Any) -> int:
    scratch, k, rows = np.empty_like(weight[0]), 0, 0
    while k < keys.shape[0]:
        if k + AHEAD < keys.shape[0]:
            ahead = keys[k + AHEAD] >> bits
            _prefetch_row(weight, ahead)
            _prefetch_row(moments, ahead)
        r, p, k = _next_row(keys, k, bits, grads, scratch)
        g, w, m, v = grads[p] if p >= 0 else scratch, weight[r], moments[r, 0], moments[r, 1]
        for j in range(w.shape[0]):
            m[j] += one_minus_beta1 * (g[j] - m[j])
            v[j] = v[j] * beta2 + one_minus_beta2 * (g[j] * g[j])
            w[j] -= step_size * (m[j] / (np.sqrt(v[j]) + eps))
        rows += 1
    return rows


@_jit
def sum_rows(grads: np.ndarray, inverse: np.ndarray, out: np.ndarray, seen: np.ndarray) -> None:
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


@_jit
def pack_keys(ids: np.ndarray, bits: int, keys: np.ndarray) -> bool:
    """``keys[i] = ids[i] << bits | i``; False (keys unfinished) at an id too large for that to fit an int64."""
    limit = 1 << (62 - bits)
    for i in range(ids.shape[0]):
        if not -limit <= ids[i] <= limit:
            return False
        keys[i] = ids[i] << bits | i
    return True


@_jit
def unique_sorted_keys(keys: np.ndarray, bits: int, unique: np.ndarray, inverse: np.ndarray) -> int:
    """From ``keys`` = ``id << bits | position``, sorted: the distinct ids in ascending order, and where the id
    at each position went; how many."""
    mask = (1 << bits) - 1
    count = 0
    for k in range(keys.shape[0]):
        value = keys[k] >> bits
        if count == 0 or value != unique[count - 1]:
            unique[count] = value
            count += 1
        inverse[keys[k] & mask] = count - 1
    return count
