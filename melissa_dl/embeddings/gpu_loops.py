"""The sparse optimizers' row update on the GPU as two Triton kernels: no host wait, shapes fixed by the batch.

Imported only by :mod:`melissa_dl.embeddings.gpu_kernels` (Triton is optional). A step, for ``n`` ids:

1. torch sorts the ids on the device (a radix sort), with the positions they came from: the gradients of one
   id form a run of the sorted order;
2. ``_partial_sums``: each chunk of ``CHUNK`` sorted positions whose first position continues a run of the
   chunk before (a hot row, repeated across chunks) sums that run's gradients within the chunk into a scratch
   row, in float32: a run of any length is summed ``CHUNK`` positions per program, in parallel;
3. ``_update_rows``: the first position of each run sums the run's gradients up to its chunk's end, adds the
   scratch rows of the chunks the run goes on into, and applies the optimizer to the row and its state in
   registers: the row read and written once in its own dtype, the state (float32) once.

Both grids depend on ``n`` alone, so a step of a fixed batch size can be captured in a CUDA graph. An id
outside the shard is skipped (a check that raised would need a host wait; the table checks its ids at lookup).
A gradient row is loaded under the mask ``cols < width``, its width 0 past the run, not under a row's mask
``&`` a scalar one: Triton's interpreter, which runs these kernels on CPU tensors in the tests, refuses those.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 32  # sorted positions a program sums: a longer run is split into chunks summed in parallel
SGD, ADAGRAD, ROW_ADAGRAD, ADAM = range(4)


@triton.jit
def _sum_run(keys, order, grads, first, stop, key, dim, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    """The float32 sum of the gradients of ``key``'s run from sorted position ``first`` up to ``stop`` (excluded;
    at most ``CHUNK`` positions on)."""
    cols = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for i in range(CHUNK):
        pos = first + i
        same = (pos < stop) & (tl.load(keys + pos, mask=pos < stop, other=0) == key)
        source = tl.load(order + pos, mask=same, other=0)
        width = tl.where(same, dim, 0)  # the row's lanes, or none past the run (see the module's docstring)
        acc += tl.load(grads + source * dim + cols, mask=cols < width, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _partial_sums(keys, order, grads, scratch, n, dim, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    chunk = tl.program_id(0)
    first = chunk * CHUNK
    key = tl.load(keys + first)
    previous = tl.load(keys + tl.maximum(first - 1, 0))
    if (chunk > 0) & (previous == key):  # the chunk starts inside a run
        acc = _sum_run(keys, order, grads, first, tl.minimum(first + CHUNK, n), key, dim, CHUNK, BLOCK_D)
        cols = tl.arange(0, BLOCK_D)
        tl.store(scratch + chunk * BLOCK_D + cols, acc, mask=cols < dim)


@triton.jit
def _update_rows(
    keys,
    order,
    grads,
    scratch,
    weight,
    state,
    n,
    rows,
    dim,
    chunks,
    lr,
    eps,
    beta1,
    beta2,
    OPTIMIZER: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    start = tl.program_id(0)
    key = tl.load(keys + start)
    previous = tl.load(keys + tl.maximum(start - 1, 0))
    if ((start == 0) | (previous != key)) & (key >= 0) & (key < rows):  # the first of its run, in the shard
        chunk = start // CHUNK + 1  # the next chunk: those from it on summed their part of the run
        acc = _sum_run(keys, order, grads, start, tl.minimum(chunk * CHUNK, n), key, dim, CHUNK, BLOCK_D)
        cols = tl.arange(0, BLOCK_D)
        while (chunk < chunks) & (tl.load(keys + chunk * CHUNK, mask=chunk < chunks, other=0) == key):
            acc += tl.load(scratch + chunk * BLOCK_D + cols, mask=cols < dim, other=0.0)
            chunk += 1
        _apply(weight, state, key.to(tl.int64), acc, dim, lr, eps, beta1, beta2, OPTIMIZER, BLOCK_D)


@triton.jit
def _apply(weight, state, row, acc, dim, lr, eps, beta1, beta2, OPTIMIZER: tl.constexpr, BLOCK_D: tl.constexpr):
    """The optimizer's update of ``row`` and its state from its summed gradient ``acc``, in float32."""
    cols = tl.arange(0, BLOCK_D)
    inside = cols < dim
    at = weight + row * dim + cols
    w = tl.load(at, mask=inside, other=0.0).to(tl.float32)
    if OPTIMIZER == 0:  # SGD
        w -= lr * acc
    elif OPTIMIZER == 1:  # Adagrad: state[rows, dim]
        total = tl.load(state + row * dim + cols, mask=inside, other=0.0) + acc * acc
        tl.store(state + row * dim + cols, total, mask=inside)
        w -= lr * acc / (tl.sqrt(total) + eps)
    elif OPTIMIZER == 2:  # RowAdagrad: state[rows]
        total = tl.load(state + row) + tl.sum(acc * acc, axis=0) / dim
        tl.store(state + row, total)
        w -= lr * acc / (tl.sqrt(total) + eps)
    else:  # Adam: state[rows, 2, dim], m then v; lr is the step size with both bias corrections
        m_at = state + row * 2 * dim + cols
        m = tl.load(m_at, mask=inside, other=0.0)
        v = tl.load(m_at + dim, mask=inside, other=0.0)
        m += (1 - beta1) * (acc - m)
        v = beta2 * v + (1 - beta2) * acc * acc
        tl.store(m_at, m, mask=inside)
        tl.store(m_at + dim, v, mask=inside)
        w -= lr * m / (tl.sqrt(v) + eps)
    tl.store(at, w.to(weight.dtype.element_ty), mask=inside)


def step(
    optimizer: int,
    weight: torch.Tensor,
    state: torch.Tensor | None,
    ids: torch.Tensor,
    grads: torch.Tensor,
    lr: float,
    eps: float = 0.0,
    beta1: float = 0.0,
    beta2: float = 0.0,
) -> torch.Tensor:
    """One update of ``weight`` (and ``state``) at the rows ``ids`` (at least one) from their gradients, summed
    per row; the number of distinct rows, on the device (reading it would wait for the step)."""
    n, dim = grads.shape
    keys, order = torch.sort(ids)
    chunks = triton.cdiv(n, CHUNK)
    block = triton.next_power_of_2(dim)
    scratch = torch.empty((chunks, block), dtype=torch.float32, device=grads.device)
    _partial_sums[(chunks,)](keys, order, grads, scratch, n, dim, CHUNK=CHUNK, BLOCK_D=block)
    _update_rows[(n,)](
        keys,
        order,
        grads,
        scratch,
        weight,
        weight if state is None else state,
        n,
        len(weight),
        dim,
        chunks,
        lr,
        eps,
        beta1,
        beta2,
        OPTIMIZER=optimizer,
        CHUNK=CHUNK,
        BLOCK_D=block,
    )
    firsts = torch.ones_like(keys, dtype=torch.bool)
    torch.ne(keys[1:], keys[:-1], out=firsts[1:])
    return (firsts & (keys >= 0) & (keys < len(weight))).sum()
