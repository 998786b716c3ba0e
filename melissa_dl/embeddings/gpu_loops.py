"""The sparse optimizers' row update on the GPU as one persistent Triton kernel: no host wait, shapes fixed by the
batch, so that a step of a fixed batch size is replayed as a CUDA graph.

Imported only by :mod:`melissa_dl.embeddings.gpu_kernels` (Triton is optional). A step, for ``n`` ids:

1. torch sorts the ids on the device (a radix sort), with the positions they came from: the gradients of one
   id form a run of the sorted order. Cut into chunks of 32 positions (fewer for rows wider than 128), a
   run is either inside one chunk or (a hot row) a piece in each of several; ``searchsorted`` gives the run
   each chunk starts and ends in.
2. ``_step`` runs on a fixed number of programs, each taking chunk after chunk. It loads a chunk's gradients
   as one tile, sums each piece by a segmented scan in float32, and updates every row whose run the chunk
   holds whole: the rows, their state and their gradients in registers, read and written once.
3. A hot row's pieces are summed in parallel by the programs of their chunks: each leaves its sum in a
   scratch row and counts itself in at the run's counter (an atomic that releases the sum); the one that
   arrives last adds the sums up, in chunk order (the same float32 total whichever program is last), and
   updates the row. No program waits for another, so no program can wait forever.

An id outside the shard is skipped (a check that raised would need a host wait; the table checks its ids at
lookup). The step size is read from the device, so that a replayed graph takes the learning rate and
Adam's bias corrections of its own step.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)

TILE = 4096  # float32 values a program holds at a time: a tile of ``chunk`` positions of a row's width
SGD, ADAGRAD, ROW_ADAGRAD, ADAM = range(4)


@triton.jit
def _piece_sum(a_sum, a_starts, b_sum, b_starts):
    """The segmented scan's operator: a running sum that restarts where a piece starts."""
    return tl.where(b_starts != 0, b_sum, a_sum + b_sum), a_starts | b_starts


@triton.jit
def _row_of(tile, pos, at):
    """Row ``at`` of ``tile`` (positions ``pos``), as a vector."""
    return tl.sum(tl.where((pos == at)[:, None], tile, 0.0), axis=0)


@triton.jit
def _combine(
    partial,
    hot,
    held_at,
    run_first,
    run_stop,
    scratch,
    arrivals,
    CHUNK: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """A piece's sum, and True, if it is not ``hot`` (its run lies in its chunk alone); else the run's total
    and True if this piece arrived last, False if others have still to come. A hot piece leaves its sum in
    scratch row ``held_at``: ``2 * chunk`` for a piece at its chunk's first position, ``2 * chunk + 1`` for
    one that starts later (the first of its run)."""
    cols = tl.arange(0, BLOCK_D)
    total = partial
    whole = hot == 0
    if hot:
        tl.store(scratch + tl.cast(held_at, tl.int64) * BLOCK_D + cols, partial)
        tl.debug_barrier()  # every lane's store before the release
        first_chunk = run_first // CHUNK
        last_chunk = (run_stop - 1) // CHUNK
        arrived = tl.atomic_add(arrivals + first_chunk, 1, sem="acq_rel")
        tl.debug_barrier()
        whole = arrived == last_chunk - first_chunk
        if whole:
            first_slot = (run_first % CHUNK != 0).to(tl.int64)
            total = tl.zeros([BLOCK_D], dtype=tl.float32)
            for start in range(first_chunk, last_chunk + 1, SPAN):
                held = start + tl.arange(0, SPAN)
                rows = held * 2 + tl.where(held == first_chunk, first_slot, 0)
                sums = tl.load(
                    scratch + rows[:, None] * BLOCK_D + cols[None, :],
                    mask=(held <= last_chunk)[:, None],
                    other=0.0,
                    cache_modifier=".cg",  # from L2, where another program's store is, not a stale L1 line
                )
                total += tl.sum(sums, axis=0)
    return total, whole


@triton.jit
def _apply(weight, state, keys, acc, apply, dim, lr, eps, beta1, beta2, OPTIMIZER: tl.constexpr, BLOCK_D: tl.constexpr):
    """The optimizer's update of the rows ``keys`` where ``apply``, and of their state, from their summed
    gradients ``acc`` (one per row), in float32."""
    cols = tl.arange(0, BLOCK_D)
    lanes = apply[:, None] & (cols < dim)[None, :]
    row = tl.where(apply, keys, 0).to(tl.int64)
    at = weight + row[:, None] * dim + cols[None, :]
    w = tl.load(at, mask=lanes, other=0.0).to(tl.float32)
    if OPTIMIZER == 0:  # SGD
        w -= lr * acc
    elif OPTIMIZER == 1:  # Adagrad: state[rows, dim]
        state_at = state + row[:, None] * dim + cols[None, :]
        total = tl.load(state_at, mask=lanes, other=0.0) + acc * acc
        tl.store(state_at, total, mask=lanes)
        w -= lr * acc / (tl.sqrt(total) + eps)
    elif OPTIMIZER == 2:  # RowAdagrad: state[rows]
        total = tl.load(state + row, mask=apply, other=0.0) + tl.sum(acc * acc, axis=1) / dim
        tl.store(state + row, total, mask=apply)
        w -= lr * acc / (tl.sqrt(total)[:, None] + eps)
    else:  # Adam: state[rows, 2, dim], m then v; lr is the step size with both bias corrections
        m_at = state + row[:, None] * 2 * dim + cols[None, :]
        m = tl.load(m_at, mask=lanes, other=0.0)
        v = tl.load(m_at + dim, mask=lanes, other=0.0)
        m += (1 - beta1) * (acc - m)
        v = beta2 * v + (1 - beta2) * acc * acc
        tl.store(m_at, m, mask=lanes)
        tl.store(m_at + dim, v, mask=lanes)
        w -= lr * m / (tl.sqrt(v) + eps)
    tl.store(at, w.to(weight.dtype.element_ty), mask=lanes)


@triton.jit
def _scan_chunk(keys, order, grads, first, last, dim, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr):
    """The keys of the sorted positions ``first`` to ``last``, where their pieces of runs start and end, and
    each piece's running sum of gradients (its total at its end), in float32."""
    pos = first + tl.arange(0, CHUNK)
    inside = pos <= last
    key = tl.load(keys + pos, mask=inside, other=0)
    starts = (pos == first) | (key != tl.load(keys + pos - 1, mask=inside & (pos > first), other=0))
    ends = inside & ((pos == last) | (key != tl.load(keys + pos + 1, mask=pos < last, other=0)))
    source = tl.load(order + pos, mask=inside, other=0)
    cols = tl.arange(0, BLOCK_D)
    lanes = inside[:, None] & (cols < dim)[None, :]
    tile = tl.load(grads + source[:, None] * dim + cols[None, :], mask=lanes, other=0.0).to(tl.float32)
    flags = tl.broadcast_to(starts.to(tl.int32)[:, None], (CHUNK, BLOCK_D))
    sums, _ = tl.associative_scan((tile, flags), 0, _piece_sum)
    return key, starts, ends, sums


@triton.jit
def _sum_chunk(
    keys,
    order,
    grads,
    run_first,
    run_stop,
    scratch,
    arrivals,
    chunk,
    n,
    dim,
    CHUNK: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The keys of ``chunk``'s sorted positions, each run's summed gradients at its last position, and where a
    row is to be updated: at a run's last position, if the chunk holds the run whole or completes it."""
    first = chunk * CHUNK
    last = tl.minimum(first + CHUNK, n) - 1
    pos = first + tl.arange(0, CHUNK)
    key, starts, ends, sums = _scan_chunk(keys, order, grads, first, last, dim, CHUNK, BLOCK_D)
    # the chunk's first piece (its head) and last (its tail): the only ones whose run may go on beyond it
    head_end = tl.min(tl.where(ends, pos, last), axis=0)
    tail_start = tl.max(tl.where(starts, pos, first), axis=0)
    head_first = tl.load(run_first + chunk)  # where the run of the chunk's first position starts
    tail_stop = tl.load(run_stop + chunk)  # where the run of its last position stops
    one_piece = head_end == last
    head_hot = (head_first < first) & ~one_piece
    tail_hot = (tail_stop > last + 1) | (one_piece & (head_first < first))
    tail_first = tl.where(one_piece, head_first, tail_start)
    head, tail = _row_of(sums, pos, head_end), _row_of(sums, pos, last)
    head, head_whole = _combine(
        head, head_hot, 2 * chunk, head_first, head_end + 1, scratch, arrivals, CHUNK, SPAN, BLOCK_D
    )
    tail_at = 2 * chunk + (~one_piece).to(tl.int32)
    tail, tail_whole = _combine(tail, tail_hot, tail_at, tail_first, tail_stop, scratch, arrivals, CHUNK, SPAN, BLOCK_D)
    sums = tl.where((pos == head_end)[:, None], head[None, :], sums)
    sums = tl.where((pos == last)[:, None], tail[None, :], sums)  # the tail's, where the two are one piece
    whole = tl.where(pos == last, tail_whole, tl.where(pos == head_end, head_whole, True))
    return key, sums, ends & whole


@triton.jit
def _step(
    keys,
    order,
    grads,
    weight,
    state,
    run_first,
    run_stop,
    scratch,
    arrivals,
    step_size,
    n,
    rows,
    dim,
    eps,
    beta1,
    beta2,
    OPTIMIZER: tl.constexpr,
    CHUNK: tl.constexpr,
    SPAN: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    lr = tl.load(step_size).to(tl.float32)
    updated = tl.zeros([], dtype=tl.int32)
    for chunk in range(tl.program_id(0), tl.cdiv(n, CHUNK), tl.num_programs(0)):
        key, sums, apply = _sum_chunk(
            keys, order, grads, run_first, run_stop, scratch, arrivals, chunk, n, dim, CHUNK, SPAN, BLOCK_D
        )
        apply &= (key >= 0) & (key < rows)
        _apply(weight, state, key, sums, apply, dim, lr, eps, beta1, beta2, OPTIMIZER, BLOCK_D)
        updated += tl.sum(apply.to(tl.int32), axis=0)
    tl.atomic_add(arrivals + tl.cdiv(n, CHUNK), updated)


@functools.cache
def _programs(device: torch.device) -> int:
    """How many programs the step runs on at most: a few per multiprocessor, so that each takes several chunks.
    Not a constant of the kernel: a batch of another size compiles nothing."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 3  # Triton's interpreter on CPU tensors (the tests): programs that take more than one chunk


def shape(dim: int) -> dict[str, int]:
    """The kernel's constants for rows of ``dim``: a tile of ``CHUNK`` positions x ``BLOCK_D`` lanes within
    ``TILE`` values, eight a thread, so that registers do not spill (none up to rows of 512 for sm_90, and 126
    a thread at 64, with Triton 3.9)."""
    block = triton.next_power_of_2(dim)
    chunk = max(4, min(32, TILE // block))
    warps = min(16, max(4, chunk * block // 256))
    return {"CHUNK": chunk, "SPAN": max(2, min(64, TILE // block)), "BLOCK_D": block, "num_warps": warps}


def step(
    optimizer: int,
    weight: torch.Tensor,
    state: torch.Tensor | None,
    ids: torch.Tensor,
    grads: torch.Tensor,
    step_size: torch.Tensor,
    eps: float = 0.0,
    beta1: float = 0.0,
    beta2: float = 0.0,
) -> torch.Tensor:
    """One update of ``weight`` (and ``state``) at the rows ``ids`` (at least one) from their gradients, summed
    per row, with the learning rate (Adam: the step size) in the 0-d float64 tensor ``step_size`` on the
    device; the number of distinct rows updated, on the device (reading it would wait for the step)."""
    n, dim = grads.shape
    constants = shape(dim)
    chunk = constants["CHUNK"]
    keys, order = torch.sort(ids)
    chunks = triton.cdiv(n, chunk)
    lasts = keys[chunk - 1 :: chunk]
    if n % chunk:
        lasts = torch.cat([lasts, keys[-1:]])
    run_first = torch.searchsorted(keys, keys[::chunk].contiguous())
    run_stop = torch.searchsorted(keys, lasts.contiguous(), right=True)
    scratch = torch.empty((chunks, 2, constants["BLOCK_D"]), dtype=torch.float32, device=grads.device)
    arrivals = torch.zeros(chunks + 1, dtype=torch.int32, device=grads.device)  # per chunk, then rows updated
    on_its_gpu = torch.cuda.device(grads.device) if grads.is_cuda else contextlib.nullcontext()
    with on_its_gpu:  # Triton launches on the current device, not the tensors'
        _step[(min(chunks, _programs(grads.device)),)](
            keys,
            order,
            grads,
            weight,
            weight if state is None else state,
            run_first,
            run_stop,
            scratch,
            arrivals,
            step_size,
            n,
            len(weight),
            dim,
            eps,
            beta1,
            beta2,
            OPTIMIZER=optimizer,
            **constants,
        )
    return arrivals[chunks]


class Graphs:
    """A step's kernels replayed as a CUDA graph once its batch size came ``REPEATS`` times in a row: one launch
    instead of a dozen. Steps of a size that changes (ids routed from other ranks) run as they are, and do not
    pay for a capture they would never replay. Only the ids and gradients change between replays: they are
    copied into the graph's own tensors; the step size is read from the device (``eps`` and the betas, fixed
    when the optimizer is made, are the graph's own)."""

    REPEATS = 3
    KEPT = 4  # batch sizes kept captured

    def __init__(self) -> None:
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._size, self._streak = 0, 0
        self._capturing = True  # until a capture fails

    def run(
        self, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], ids: torch.Tensor, grads: torch.Tensor
    ) -> torch.Tensor:
        """``fn(ids, grads)``, replayed from a graph on a GPU where it can be."""
        n = len(ids)
        self._streak = self._streak + 1 if n == self._size else 1
        self._size = n
        if not ids.is_cuda:
            return fn(ids, grads)
        if (found := self._graphs.get(n)) is not None:
            graph, static_ids, static_grads, count = found
            static_ids.copy_(ids)
            static_grads.copy_(grads)
            graph.replay()
            return count.clone()  # the graph's own is overwritten by the next replay
        if not self._capturing or self._streak < self.REPEATS:
            return fn(ids, grads)
        static_ids, static_grads = ids.clone(), grads.clone()
        count = fn(static_ids, static_grads)  # this step, on the tensors the graph will read: nothing left to compile
        graph = torch.cuda.CUDAGraph()
        try:  # thread-local: a thread that copies the next batch meanwhile is not capturing
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                captured = fn(static_ids, static_grads)  # recorded, not run
        except RuntimeError as e:  # the step is done: the next ones go on as they are
            logger.warning("the sparse optimizer's step could not be captured as a CUDA graph, none will be: %s", e)
            self._capturing = False
            return count
        if len(self._graphs) == self.KEPT:
            del self._graphs[next(iter(self._graphs))]
        self._graphs[n] = (graph, static_ids, static_grads, captured)
        return count
