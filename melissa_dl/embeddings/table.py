"""Embedding tables whose rows are partitioned across the ranks (docs/explanation/design.md#partitioned-embeddings).

Rank ``r`` owns the contiguous rows ``shard_range(num_rows, K, r)``; no rank
holds the whole table. A lookup deduplicates the batch's ids (sorted, so
already grouped by owner), sends each id to its owner with one all-to-all,
and gets the rows back with a second one; the output indexes the block of
unique rows (``_Gather``), so its backward sums the gradient of each unique
id (never averaged, as torch, PBG and FBGEMM do) and divides it by K (the
global loss is the mean of the K per-rank losses, docs/explanation/design.md#training-across-ranks).
``apply_gradients`` sends those per-id gradients back to the owners (a third
all-to-all), whose sparse optimizer sums them over ranks and updates only
the touched rows. The second and third all-to-alls know their counts from
the first, so only the first exchanges counts. On one process a lookup is a
plain gather, and its backward hands the optimizer one gradient per id of
the batch to sum.

The shard is a registered buffer, not a parameter: the dense gradient
averager and the user's dense optimizer never see it, and it is saved in the
module's ``state_dict`` together with its row range and optimizer state.

Every rank must run the same sequence of lookups (each one is a collective,
even with no ids) and call ``apply_gradients`` together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch
from torch import nn

from melissa_dl.embeddings import row_kernels

if TYPE_CHECKING:
    from melissa_dl.embeddings.sparse_optim import SparseOptimizer
    from melissa_dl.runtime.collectives import Collectives

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


class UniqueIds(NamedTuple):
    """A batch's distinct ids and how they map back onto it."""

    ids: torch.Tensor  # distinct, ascending
    inverse: torch.Tensor  # for each id of the batch, where it is in ``ids``
    keys: row_kernels.SortedKeys | None = None  # the batch's sorted keys, where the compiled loops made them


def unique_ids(ids: torch.Tensor) -> UniqueIds:
    """``torch.unique(ids, sorted=True, return_inverse=True)`` of 1-D int64 ids; on CPU by a sort and a compiled
    pass where it can (``row_kernels.Kernels.unique``)."""
    kernels = row_kernels.load() if ids.device.type == "cpu" and ids.is_contiguous() and ids.numel() else None
    found = kernels.unique(ids) if kernels is not None else None
    return UniqueIds(*(torch.unique(ids, sorted=True, return_inverse=True) if found is None else found))


def sum_rows(grads: torch.Tensor, unique: UniqueIds, divisor: int = 1) -> torch.Tensor:
    """One row per distinct id, the sum of the ``grads`` rows (one per id of the batch) of that id, divided by
    ``divisor`` (as ``div_`` divides): by walking the sorted keys where the compiled loops made them and take the
    gradients (float32 or float64 on the CPU), else by ``index_add_``."""
    grads, keys = grads.contiguous(), unique.keys
    kernels = row_kernels.usable(grads) if keys is not None else None
    if kernels is None or keys is None:
        return grads.new_zeros((len(unique.ids), grads.shape[1])).index_add_(0, unique.inverse, grads).div_(divisor)
    return kernels.sum_rows(grads, keys, len(unique.ids), divisor)


def set_default_collectives(collectives: Collectives | None) -> Collectives | None:
    """The collectives of tables built without explicit ones (the server sets its own before the user's module);
    the ones before."""
    global _default_collectives
    before, _default_collectives = _default_collectives, collectives
    return before


@dataclass
class _Lookup:
    """What ``apply_gradients`` needs of one forward: the local rows to update, how their ids travelled, and
    the gradient its backward left (None: the output got none, a zero gradient)."""

    ids: torch.Tensor  # local rows: a copy of the batch's ids (one process) or the unique ids received (owners)
    send_counts: list[int] | None = None  # unique ids sent to each owner (None: single process)
    recv_counts: list[int] | None = None  # ids received from each rank (None: single process)
    batch: UniqueIds | None = None  # the batch's distinct ids, onto which the backward sums (None: single process)
    grad: torch.Tensor | None = None

    @property
    def grad_rows(self) -> int:
        """Rows of the gradient: the batch's ids on one process, else the unique ids this rank sent."""
        return len(self.ids) if self.send_counts is None else sum(self.send_counts)


class _Gather(torch.autograd.Function):
    """``rows.index_select(0, index)``, whose backward keeps the gradient in ``lookup.grad`` for
    ``apply_gradients`` instead of passing it on: summed per row of ``rows`` when those go back to their
    owners, per id of the batch when the optimizer sums them itself. The rows are no parameter: ``anchor``,
    an empty leaf, is what makes autograd call this backward."""

    @staticmethod
    def forward(
        ctx: Any, anchor: torch.Tensor, rows: torch.Tensor, index: torch.Tensor, lookup: _Lookup
    ) -> torch.Tensor:
        ctx.lookup = lookup
        return rows.index_select(0, index)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:
        lookup: _Lookup = ctx.lookup
        if lookup.batch is not None:  # divided by K here: the global loss is the mean of the K ranks' losses
            assert lookup.send_counts is not None
            grad = sum_rows(grad.detach(), lookup.batch, len(lookup.send_counts))
        else:  # a copy, as autograd takes of a gradient someone else holds (the caller's, to backward())
            grad = grad.detach().clone(memory_format=torch.contiguous_format)
        lookup.grad = grad if lookup.grad is None else lookup.grad + grad  # a second backward accumulates
        return None, None, None, None


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
        self._anchor = torch.empty(0, requires_grad=True)  # see _Gather
        # 0 and each rank's end row: how many ids fall below each tells the send counts and any id out of range
        self._bounds = torch.cat([torch.zeros(1, dtype=torch.int64), _stops(num_rows, self.size)])

    @property
    def distributed(self) -> bool:
        return self.collectives is not None and self.size > 1

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of ``ids`` (any shape, integers): ``ids.shape + (dim,)``, differentiable when training."""
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"ShardedEmbedding '{self.name}': ids must be integers, got {ids.dtype}")
        flat = ids.reshape(-1).to(device=self.shard.device, dtype=torch.int64)
        record = self.training and torch.is_grad_enabled()
        if not self.distributed:  # a plain gather; the optimizer sums the gradients of repeated ids
            if flat.numel():
                self._check_range(flat, *torch.stack(torch.aminmax(flat)).tolist())  # one wait for a GPU
            out = (
                self._recorded(self.shard, flat, _Lookup(flat.clone())) if record else self.shard.index_select(0, flat)
            )
            return out.view(*ids.shape, self.dim)
        assert self.collectives is not None
        unique = unique_ids(flat)
        if self._bounds.device != flat.device:
            self._bounds = self._bounds.to(flat.device)
        below = torch.searchsorted(unique.ids, self._bounds).tolist()  # sorted ids, so grouped by owner already
        if below[0] or below[-1] != len(unique.ids):  # before any collective: a bad batch fails on its own rank
            self._check_range(flat, *torch.stack(torch.aminmax(flat)).tolist())
        send_counts = [stop - start for start, stop in zip(below, below[1:])]
        received, recv_counts = self.collectives.alltoallv(unique.ids, send_counts)
        local = received - self.start
        # the rows answer the ids: as many go back to each rank as came from it
        rows, _ = self.collectives.alltoallv(self.shard.index_select(0, local), recv_counts, send_counts)
        out = (
            self._recorded(rows, unique.inverse, _Lookup(local, send_counts, recv_counts, unique))
            if record
            else rows.index_select(0, unique.inverse)
        )
        return out.view(*ids.shape, self.dim)

    def _check_range(self, flat: torch.Tensor, low: int, high: int) -> None:
        """A clear error naming the first id of ``flat`` outside the table, if its smallest or largest is."""
        if low < 0 or high >= self.num_rows:
            bad = flat[(flat < 0) | (flat >= self.num_rows)][0]
            raise ValueError(f"ShardedEmbedding '{self.name}': id {int(bad)} out of range [0, {self.num_rows})")

    def _recorded(self, rows: torch.Tensor, index: torch.Tensor, lookup: _Lookup) -> torch.Tensor:
        """``rows[index]``, differentiable: ``lookup`` gets its gradient."""
        self._lookups.append(lookup)
        return _Gather.apply(self._anchor, rows, index, lookup)

    def apply_gradients(self) -> int | torch.Tensor:
        """Update the rows of every lookup since the last call from their gradients; rows updated here (on the
        device from the GPU kernels).

        A lookup whose output got no gradient counts as a zero gradient (its
        collectives still run). With no lookup at all (on every rank) nothing
        happens, not even an optimizer step.
        """
        lookups, self._lookups = self._lookups, []
        if not lookups:
            return 0
        self._rebind_if_moved()
        ids, grads = [], []
        for lookup in lookups:
            grad = lookup.grad
            grad = self.shard.new_zeros((lookup.grad_rows, self.dim)) if grad is None else grad.contiguous()
            if lookup.send_counts is not None:  # to the owners, the way the ids went
                assert self.collectives is not None
                grad, _ = self.collectives.alltoallv(grad, lookup.send_counts, lookup.recv_counts)
            ids.append(lookup.ids)
            grads.append(grad)
        # an id looked up twice, by two ranks or in two lookups, has its gradients summed by the optimizer
        return self.optimizer.step(
            torch.cat(ids) if len(ids) > 1 else ids[0], torch.cat(grads) if len(grads) > 1 else grads[0]
        )

    def get_extra_state(self) -> dict[str, Any]:
        """The shard's global row range and its optimizer state, checkpointed with the shard."""
        self._rebind_if_moved()
        return {
            "num_rows": self.num_rows,
            "start": self.start,
            "stop": self.stop,
            "optimizer": self.optimizer.state_dict(),
        }

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
                raise ValueError(
                    f"ShardedEmbedding '{self.name}': checkpoint has {extra['num_rows']} rows, "
                    f"this table {self.num_rows}"
                )
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
        self.optimizer.load_state_dict(
            {
                "step": pieces[0]["extra"]["optimizer"]["step"],
                **{key: torch.cat(parts) if parts else self.optimizer.state[key] for key, parts in states.items()},
            }
        )

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
