"""Embedding tables whose rows are partitioned across the ranks (DESIGN §6).

Rank ``r`` owns the contiguous rows ``shard_range(num_rows, K, r)``; no rank
holds the whole table. A lookup deduplicates the batch's ids (sorted, so
already grouped by owner), sends each id to its owner with one all-to-all,
and gets the rows back with a second one. The returned block of unique rows
is an autograd leaf, and the output indexes it (``gather_rows``), so its
backward sums the gradient of each unique id (never averaged, as torch, PBG
and FBGEMM do).
``apply_gradients`` sends those per-id gradients back to the owners (a third
all-to-all), which sum them over ranks, divide by K (the global loss is the
mean of the K per-rank losses, DESIGN §5) and let the shard's sparse
optimizer update only the touched rows.

The shard is a registered buffer, not a parameter: the dense gradient
averager and the user's dense optimizer never see it, and it is saved in the
module's ``state_dict`` together with its row range and optimizer state.

Every rank must run the same sequence of lookups (each one is a collective,
even with no ids) and call ``apply_gradients`` together.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from melissa_dl import row_kernels

if TYPE_CHECKING:
    from melissa_dl.collectives import Collectives
    from melissa_dl.sparse_optim import SparseOptimizer

INIT_BLOCK_ROWS = 1 << 14  # initial rows are drawn per block of this many rows, whatever K

_default_collectives: Collectives | None = None


def shard_range(num_rows: int, size: int, rank: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of ``rank``: contiguous in rank order, the remainder to the first ranks."""
    if num_rows < 0 or size < 1 or not 0 <= rank < size:
        raise ValueError(f"shard_range: invalid num_rows={num_rows}, size={size}, rank={rank}")
    base, extra = divmod(num_rows, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def _stops(num_rows: int, size: int, device: torch.device | None = None) -> torch.Tensor:
    return torch.tensor([shard_range(num_rows, size, r)[1] for r in range(size)], dtype=torch.int64, device=device)


def row_owners(rows: torch.Tensor, num_rows: int, size: int) -> torch.Tensor:
    """The rank owning each global row (rows must be in ``[0, num_rows)``): the one row -> rank map."""
    return torch.searchsorted(_stops(num_rows, size, rows.device), rows.to(torch.int64), right=True)


def unique_ids(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.unique(ids, sorted=True, return_inverse=True)`` of 1-D int64 ids; on CPU by a compiled pass after
    numpy's argsort where it can (``row_kernels.Kernels.unique``), 2-3x faster on a batch of 4096 ids
    (``bench/sparse_optim.py``)."""
    kernels = row_kernels.load() if ids.device.type == "cpu" and ids.is_contiguous() else None
    if kernels is None or not ids.numel():
        return torch.unique(ids, sorted=True, return_inverse=True)
    return kernels.unique(ids)


class _GatherRows(torch.autograd.Function):
    """``rows.index_select(0, inverse)``, whose backward sums the gradients of repeated ids in one compiled pass
    where it can (``row_kernels.Kernels.sum_rows``) instead of zero-filling a block and adding into it."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        ctx.count = rows.shape[0]
        return rows.index_select(0, inverse)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (inverse,) = ctx.saved_tensors
        return sum_rows(grad, inverse, ctx.count), None


def gather_rows(rows: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``rows[inverse]``; its gradient is ``sum_rows`` of the output's."""
    return _GatherRows.apply(rows, inverse)


def sum_rows(grads: torch.Tensor, inverse: torch.Tensor, count: int) -> torch.Tensor:
    """``count`` rows, row ``k`` the sum of the ``grads`` rows ``i`` with ``inverse[i] == k``."""
    grads, inverse = grads.contiguous(), inverse.contiguous()
    kernels = row_kernels.usable(grads)
    if kernels is None:
        return grads.new_zeros((count, grads.shape[1])).index_add_(0, inverse, grads)
    return kernels.sum_rows(grads, inverse, count)


def set_default_collectives(collectives: Collectives | None) -> None:
    """The collectives of tables built without explicit ones (the server sets its own before the user's module)."""
    global _default_collectives
    _default_collectives = collectives


@dataclass
class _Lookup:
    """What ``apply_gradients`` needs of one forward: the leaf, and how its ids travelled."""

    rows: torch.Tensor  # the leaf [unique ids of this rank, dim], in id order
    send_counts: list[int] | None  # unique ids sent to each owner (None: single process)
    local_rows: torch.Tensor  # the unique local rows this owner served
    inverse: torch.Tensor | None  # received id -> its index in local_rows (None: they are the received ids)


class ShardedEmbedding(nn.Module):
    """A ``num_rows x dim`` table sharded by rows over the ranks, updated by a sparse optimizer.

    ``init_std`` defaults to ``dim ** -0.5``: initial rows are N(0, 1/dim)
    per element, so of norm about 1 and with dot products of order
    ``1/sqrt(dim)``. Row ``i``'s initial vector depends only on ``seed`` and
    ``i`` (blocks of ``INIT_BLOCK_ROWS`` rows, each from its own generator),
    never on K. Without collectives (none given, none set as default) or with
    one rank, a lookup is a local ``index_select`` with no communication.

    Each forward and each ``apply_gradients`` is a collective when K > 1:
    all ranks must call them in the same order (a rank with no ids passes an
    empty tensor). Out-of-range ids raise before any communication, so a bad
    id on some ranks only would leave the others waiting: the server's data
    path must not produce them.
    """

    shard: torch.Tensor

    def __init__(
        self,
        num_rows: int,
        dim: int,
        optimizer: SparseOptimizer,
        *,
        collectives: Collectives | None = None,
        init_std: float | None = None,
        seed: int = 0,
        name: str = "embedding",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if num_rows < 1 or dim < 1:
            raise ValueError(f"ShardedEmbedding '{name}': num_rows ({num_rows}) and dim ({dim}) must be positive")
        if seed < 0:
            raise ValueError(f"ShardedEmbedding '{name}': seed must be >= 0, got {seed}")
        self.num_rows, self.dim, self.name = num_rows, dim, name
        self.optimizer = optimizer
        self.collectives = collectives if collectives is not None else _default_collectives
        self.rank = self.collectives.rank if self.collectives is not None else 0
        self.size = self.collectives.size if self.collectives is not None else 1
        self.start, self.stop = shard_range(num_rows, self.size, self.rank)
        std = dim**-0.5 if init_std is None else init_std
        initial = _initial_rows(self.start, self.stop, dim, std, seed)
        self.register_buffer("shard", initial.to(dtype=dtype, device=device))
        self.optimizer.bind(self.shard)
        self._bound = self.shard
        self._lookups: list[_Lookup] = []
        self._rank_stops = _stops(num_rows, self.size)  # each rank's end row, for the send counts

    @property
    def distributed(self) -> bool:
        return self.collectives is not None and self.size > 1

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (any shape, integers): ``ids.shape + (dim,)``, differentiable when training."""
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"ShardedEmbedding '{self.name}': ids must be integers, got {ids.dtype}")
        flat = ids.reshape(-1).to(device=self.shard.device, dtype=torch.int64)
        if flat.numel():  # checked before any collective, so that a bad batch fails on its own rank
            low, high = torch.aminmax(flat)
            if int(low) < 0 or int(high) >= self.num_rows:
                bad = flat[(flat < 0) | (flat >= self.num_rows)][0]
                raise ValueError(f"ShardedEmbedding '{self.name}': id {int(bad)} out of range [0, {self.num_rows})")
        record = self.training and torch.is_grad_enabled()
        if not (record or self.distributed):  # single-process validation: a plain gather
            return self.shard.index_select(0, flat).view(*ids.shape, self.dim)
        uniq, inverse = unique_ids(flat)
        if not self.distributed:
            rows = self.shard.index_select(0, uniq)
            lookup = _Lookup(rows, None, uniq, None)
        else:
            assert self.collectives is not None
            if self._rank_stops.device != uniq.device:
                self._rank_stops = self._rank_stops.to(uniq.device)
            ends = torch.searchsorted(uniq, self._rank_stops)  # uniq is sorted, so grouped by owner already
            send_counts = torch.diff(ends, prepend=ends.new_zeros(1)).tolist()
            received, recv_counts = self.collectives.alltoallv(uniq, send_counts)
            local = received - self.start
            local_rows, owner_inverse = local, None
            if record:  # ids from several ranks deduplicated once, here; apply_gradients reuses it
                local_rows, owner_inverse = unique_ids(local)
                if local_rows.numel() == local.numel():  # no id came from two ranks: no sum needed
                    local_rows, owner_inverse = local, None
            rows, _ = self.collectives.alltoallv(self.shard.index_select(0, local), recv_counts)
            lookup = _Lookup(rows, send_counts, local_rows, owner_inverse)
        if record:
            rows.requires_grad_(True)
            self._lookups.append(lookup)
        return gather_rows(rows, inverse).view(*ids.shape, self.dim)

    def apply_gradients(self) -> int:
        """Update the rows of every lookup since the last call from their gradients; rows updated here.

        A lookup whose output got no gradient counts as a zero gradient (its
        collectives still run). With no lookup at all (on every rank) nothing
        happens, not even an optimizer step.
        """
        lookups, self._lookups = self._lookups, []
        if not lookups:
            return 0
        self._rebind_if_moved()
        parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for lookup in lookups:
            grad = lookup.rows.grad
            if grad is None:
                grad = torch.zeros_like(lookup.rows, requires_grad=False)
            grad = grad.detach().contiguous()
            if lookup.send_counts is None:
                parts.append((lookup.local_rows, grad))
                continue
            assert self.collectives is not None
            received, _ = self.collectives.alltoallv(grad, lookup.send_counts)
            if lookup.inverse is not None:
                received = sum_rows(received, lookup.inverse, lookup.local_rows.numel())
            parts.append((lookup.local_rows, received))
        if len(parts) == 1:
            rows, grads = parts[0]
        else:  # several lookups of this table in one step: one summed gradient per row, one step
            rows, where = unique_ids(torch.cat([r for r, _ in parts]))
            grads = sum_rows(torch.cat([g for _, g in parts]), where, rows.numel())
        if self.size > 1:
            grads.div_(self.size)
        self.optimizer.step(rows, grads)
        return int(rows.numel())

    def get_extra_state(self) -> dict[str, Any]:
        """The shard's global row range and its optimizer state, checkpointed with the shard."""
        self._rebind_if_moved()
        return {"num_rows": self.num_rows, "start": self.start, "stop": self.stop,
                "optimizer": self.optimizer.state_dict()}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        found = (state["num_rows"], state["start"], state["stop"])
        if found != (self.num_rows, self.start, self.stop):
            raise ValueError(
                f"ShardedEmbedding '{self.name}': state of rows {found[1]}:{found[2]} of {found[0]} does not match "
                f"this shard, rows {self.start}:{self.stop} of {self.num_rows} (re-shard it first)"
            )
        self._rebind_if_moved()
        self.optimizer.load_state_dict(state["optimizer"])  # copies into the bound state (any device)

    def load_rows(self, pieces: list[dict[str, Any]]) -> None:
        """Take this shard's rows and their optimizer state from shards of any partition of the table.

        ``pieces`` are ``{"shard": rows, "extra": get_extra_state()}`` of old shards
        (any K) that together cover this shard's rows: a restart on another
        number of ranks re-shards the table this way.
        """
        self._rebind_if_moved()
        rows: list[torch.Tensor] = []
        states: dict[str, list[torch.Tensor]] = {key: [] for key in self.optimizer.state}
        covered = self.start
        for piece in sorted(pieces, key=lambda p: p["extra"]["start"]):
            extra = piece["extra"]
            if extra["num_rows"] != self.num_rows:
                raise ValueError(f"ShardedEmbedding '{self.name}': checkpoint has {extra['num_rows']} rows, "
                                 f"this table {self.num_rows}")
            lo, hi = max(covered, extra["start"]), min(self.stop, extra["stop"])
            if lo >= hi:
                continue
            if lo != covered:
                break
            rows.append(piece["shard"][lo - extra["start"] : hi - extra["start"]])
            for key, parts in states.items():
                parts.append(extra["optimizer"][key][lo - extra["start"] : hi - extra["start"]])
            covered = hi
        if covered != self.stop:
            raise ValueError(f"ShardedEmbedding '{self.name}': the checkpoint lacks rows {covered}:{self.stop}")
        if rows:  # else an empty shard (fewer rows than ranks): only the step count to take
            self.shard.copy_(torch.cat(rows))
        self.optimizer.load_state_dict({
            "step": pieces[0]["extra"]["optimizer"]["step"],
            **{key: torch.cat(parts) if parts else self.optimizer.state[key] for key, parts in states.items()},
        })

    def _rebind_if_moved(self) -> None:
        """After ``module.to(device)`` replaced the shard, point the optimizer at it, keeping its state."""
        if self._bound is self.shard:
            return
        state = self.optimizer.state_dict()  # the old state tensors, still alive
        self.optimizer.weight = None  # bind() is once-only: this is a re-bind, state carried over below
        self.optimizer.bind(self.shard)
        self.optimizer.load_state_dict(state)
        self._bound = self.shard

    def _apply(self, fn: Any, recurse: bool = True) -> ShardedEmbedding:
        super()._apply(fn, recurse)
        self._rebind_if_moved()
        return self

    def extra_repr(self) -> str:
        return f"'{self.name}', {self.num_rows}, {self.dim}, rows={self.start}:{self.stop}, ranks={self.size}"


def _initial_rows(start: int, stop: int, dim: int, std: float, seed: int) -> torch.Tensor:
    """Rows ``start:stop`` of the seed's table, generated only from the blocks that overlap them."""
    out = torch.empty((stop - start, dim), dtype=torch.float32)
    if out.is_meta:  # built under torch.device("meta") (melissa-server --check): shapes only
        return out
    for block in range(start // INIT_BLOCK_ROWS, -(-stop // INIT_BLOCK_ROWS)):
        first = block * INIT_BLOCK_ROWS
        # numpy's seed sequence mixes all of (seed, block); torch's CPU generator keeps only 32 bits of a seed.
        rng = np.random.default_rng([seed, block])
        values = torch.from_numpy(rng.standard_normal((INIT_BLOCK_ROWS, dim), dtype=np.float32)).mul_(std)
        lo, hi = max(start, first), min(stop, first + INIT_BLOCK_ROWS)
        out[lo - start : hi - start] = values[lo - first : hi - first]
    return out

