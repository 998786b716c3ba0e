"""The sparse path's per-row loops, compiled by numba: imported only by ``row_kernels.load()``, which falls back
to torch's ops when this module cannot be imported or its loops cannot be compiled.

Each function takes numpy views of CPU tensors (no copy), is compiled on its
first call and cached on disk by numba. An optimizer step is one pass over
the batch's ids sorted with their positions (``keys``, uint32 or int64):
``_runs`` finds where each distinct id's run of keys starts, then each row
gets its gradient (the gradients of a repeated id summed in position order)
and is updated with its state where it lies, with no gradient block built.
The rows are random rows of a table far larger than the caches: the pass
asks for the row ``AHEAD`` distinct ids in advance (``_prefetch_row``), so
that their memory latencies overlap instead of adding up. Counting ahead in
distinct ids, not in keys, is what keeps that distance on skewed batches,
where a hot id's run is hundreds of keys long (RowAdagrad over a Zipf batch
of 4096 ids, 1357 distinct: 48 us against 80 counting keys, on a 2-core VM).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

AHEAD = 16  # distinct rows prefetched in advance: 16 and 32 ran 1.3x faster than 8 on uniform ids, 4 slower

# reassoc: a row's sum of squares may be summed in SIMD lanes (2x faster RowAdagrad; the order, not the
# operations, differs from torch's); contract: fused multiply-adds
_jit = numba.njit(cache=True, nogil=True, error_model="numpy", fastmath={"reassoc", "contract"})
_jit_in_order = numba.njit(cache=True, nogil=True, error_model="numpy")  # sums exactly in the order written


@intrinsic
def _prefetch_row_intrinsic(typingctx: Any, array: Any, row: Any) -> Any:
    """Start loading every cache line of ``array[row]`` for writing (LLVM's prefetch; no effect on values)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        view = context.make_array(signature.args[0])(context, builder, args[0])
        intp = context.get_value_type(types.intp)
        stride = builder.extract_value(view.strides, 0)
        index = context.cast(builder, args[1], signature.args[1], types.intp)
        start = builder.add(builder.ptrtoint(view.data, intp), builder.mul(index, stride))
        byte_pointer, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
        prefetch = builder.module.declare_intrinsic(  # named for typed or opaque pointers, as the LLVM has them
            "llvm.prefetch", [byte_pointer], ir.FunctionType(ir.VoidType(), [byte_pointer, i32, i32, i32])
        )
        first = builder.and_(start, ir.Constant(intp, ~63))  # the cache line holding the row's first byte
        end = builder.add(start, stride)
        lines = builder.udiv(builder.add(builder.sub(end, first), ir.Constant(intp, 63)), ir.Constant(intp, 64))
        with cgutils.for_range(builder, lines) as loop:
            line = builder.add(first, builder.mul(loop.index, ir.Constant(intp, 64)))
            # write intent, keep in all cache levels, data cache
            builder.call(prefetch, [builder.inttoptr(line, byte_pointer), i32(1), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(array, row), codegen


_prefetch_row: Any = _prefetch_row_intrinsic  # called from the loops as (array, row); numba adds the typing context


@_jit_in_order
def _runs(keys: np.ndarray, bits: int, starts: np.ndarray) -> int:
    """How many distinct ids ``keys`` hold; ``starts[u]`` the index of the first key of the ``u``-th, and
    ``starts[count]`` the number of keys."""
    count = 0
    for k in range(keys.shape[0]):
        if k == 0 or keys[k] >> bits != keys[k - 1] >> bits:
            starts[count] = k
            count += 1
    starts[count] = keys.shape[0]
    return count


@_jit_in_order
def _sum_gradients(keys: np.ndarray, lo: int, hi: int, mask: int, grads: np.ndarray, scratch: np.ndarray) -> None:
    """Into ``scratch``: the gradients at the positions of ``keys[lo:hi]`` (two or more, ascending), summed in
    that order, as ``index_add_`` sums them."""
    g = grads[keys[lo] & mask]
    for j in range(scratch.shape[0]):
        scratch[j] = g[j]
    k = lo + 1
    while k + 3 < hi:  # four at a time, added in the same order: 1.6x faster
        g0, g1 = grads[keys[k] & mask], grads[keys[k + 1] & mask]
        g2, g3 = grads[keys[k + 2] & mask], grads[keys[k + 3] & mask]
        for j in range(scratch.shape[0]):
            scratch[j] = scratch[j] + g0[j] + g1[j] + g2[j] + g3[j]
        k += 4
    while k < hi:
        g = grads[keys[k] & mask]
        for j in range(scratch.shape[0]):
            scratch[j] += g[j]
        k += 1


# Each step below walks the runs itself, prefetching and taking a row's gradient in its own loop: the same lines
# in a helper that returns the gradient row (or its position) made RowAdagrad 1.1-1.9x slower.


@_jit
def sgd(weight: np.ndarray, grads: np.ndarray, keys: np.ndarray, bits: int, lr: Any) -> int:
    starts, scratch, mask = np.empty(keys.shape[0] + 1, np.int64), np.empty_like(weight[0]), (1 << bits) - 1
    count = _runs(keys, bits, starts)
    for u in range(count):
        if u + AHEAD < count:
            _prefetch_row(weight, keys[starts[u + AHEAD]] >> bits)
        lo, hi = starts[u], starts[u + 1]
        g = grads[keys[lo] & mask] if hi - lo == 1 else scratch
        if hi - lo > 1:
            _sum_gradients(keys, lo, hi, mask, grads, scratch)
        w = weight[keys[lo] >> bits]
        for j in range(w.shape[0]):
            w[j] -= lr * g[j]
    return count


@_jit
def adagrad(
    weight: np.ndarray, total: np.ndarray, grads: np.ndarray, keys: np.ndarray, bits: int, lr: Any, eps: Any
) -> int:
    starts, scratch, mask = np.empty(keys.shape[0] + 1, np.int64), np.empty_like(weight[0]), (1 << bits) - 1
    count = _runs(keys, bits, starts)
    for u in range(count):
        if u + AHEAD < count:
            ahead = keys[starts[u + AHEAD]] >> bits
            _prefetch_row(weight, ahead)
            _prefetch_row(total, ahead)
        lo, hi = starts[u], starts[u + 1]
        g = grads[keys[lo] & mask] if hi - lo == 1 else scratch
        if hi - lo > 1:
            _sum_gradients(keys, lo, hi, mask, grads, scratch)
        r = keys[lo] >> bits
        w, acc = weight[r], total[r]
        for j in range(w.shape[0]):
            acc[j] += g[j] * g[j]
            w[j] -= lr * (g[j] / (np.sqrt(acc[j]) + eps))
    return count


@_jit
def row_adagrad(
    weight: np.ndarray,
    total: np.ndarray,
    grads: np.ndarray,
    keys: np.ndarray,
    bits: int,
    lr: Any,
    eps: Any,
    inv_dim: Any,
) -> int:
    starts, scratch, mask = np.empty(keys.shape[0] + 1, np.int64), np.empty_like(weight[0]), (1 << bits) - 1
    count = _runs(keys, bits, starts)
    for u in range(count):
        if u + AHEAD < count:
            ahead = keys[starts[u + AHEAD]] >> bits
            _prefetch_row(weight, ahead)
            _prefetch_row(total, ahead)
        lo, hi = starts[u], starts[u + 1]
        g = grads[keys[lo] & mask] if hi - lo == 1 else scratch
        if hi - lo > 1:
            _sum_gradients(keys, lo, hi, mask, grads, scratch)
        r = keys[lo] >> bits
        w = weight[r]
        square = inv_dim - inv_dim  # 0 of the table's dtype
        for j in range(w.shape[0]):
            square += g[j] * g[j]
        total[r] += square * inv_dim
        scale = -lr / (np.sqrt(total[r]) + eps)
        for j in range(w.shape[0]):
            w[j] += g[j] * scale
    return count


@_jit
def adam(
    weight: np.ndarray,
    moments: np.ndarray,
    grads: np.ndarray,
    keys: np.ndarray,
    bits: int,
    one_minus_beta1: Any,
    beta2: Any,
    one_minus_beta2: Any,
    step_size: Any,
    eps: Any,
) -> int:
    starts, scratch, mask = np.empty(keys.shape[0] + 1, np.int64), np.empty_like(weight[0]), (1 << bits) - 1
    count = _runs(keys, bits, starts)
    for u in range(count):
        if u + AHEAD < count:
            ahead = keys[starts[u + AHEAD]] >> bits
            _prefetch_row(weight, ahead)
            _prefetch_row(moments, ahead)
        lo, hi = starts[u], starts[u + 1]
        g = grads[keys[lo] & mask] if hi - lo == 1 else scratch
        if hi - lo > 1:
            _sum_gradients(keys, lo, hi, mask, grads, scratch)
        r = keys[lo] >> bits
        w, m, v = weight[r], moments[r, 0], moments[r, 1]
        for j in range(w.shape[0]):
            m[j] += one_minus_beta1 * (g[j] - m[j])
            v[j] = v[j] * beta2 + one_minus_beta2 * (g[j] * g[j])
            w[j] -= step_size * (m[j] / (np.sqrt(v[j]) + eps))
    return count


@_jit_in_order
def sum_runs(grads: np.ndarray, keys: np.ndarray, bits: int, out: np.ndarray, divisor: Any) -> None:
    """``out[u]``: the gradients at the positions of the ``u``-th distinct id of ``keys``, summed in position
    order (as ``index_add_`` into zeros sums them, up to the sign of a zero), divided by ``divisor``. ``out`` is
    written once, in order, each row divided while in cache: no zero-filling pass, no scattered writes. (Written
    as copy, add, divide: a first row divided as it is copied, or ``_sum_gradients`` for the runs, made this
    loop 1.6-2.7x slower.)"""
    starts, mask = np.empty(keys.shape[0] + 1, np.int64), (1 << bits) - 1
    for u in range(_runs(keys, bits, starts)):
        lo, hi = starts[u], starts[u + 1]
        o, g = out[u], grads[keys[lo] & mask]
        for j in range(o.shape[0]):
            o[j] = g[j]
        for k in range(lo + 1, hi):
            g = grads[keys[k] & mask]
            for j in range(o.shape[0]):
                o[j] += g[j]
        for j in range(o.shape[0]):
            o[j] = o[j] / divisor


@_jit
def pack_keys(ids: np.ndarray, limit: int, bits: int, keys: np.ndarray) -> int:
    """``keys[i] = ids[i] << bits | i``, in the first ``len(ids)`` uint32 of ``keys`` (an int64 buffer) when
    every key fits 32 bits (returns 32), else in ``keys`` itself (returns 64); 0, keys unwritten, when an id is
    outside ``[0, limit)`` or too large to pack into an int64."""
    low, high = 0, 0
    for i in range(ids.shape[0]):  # min and max first: a branch-free loop, unlike one that stops at a bad id
        low, high = min(low, ids[i]), max(high, ids[i])
    if low < 0 or high >= limit or high >= 1 << (63 - bits):
        return 0
    if high < 1 << (32 - bits):
        narrow = keys.view(np.uint32)
        for i in range(ids.shape[0]):
            narrow[i] = ids[i] << bits | i
        return 32
    for i in range(ids.shape[0]):
        keys[i] = ids[i] << bits | i
    return 64


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
