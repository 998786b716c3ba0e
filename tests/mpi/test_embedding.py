"""ShardedEmbedding across ranks, under ``mpirun -n 1``, ``-n 2`` and ``-n 3``.

The objective invariant (docs/explanation/design.md#training-across-ranks): K ranks training on batches B1..BK give
the same table as one process training on their concatenation with the mean
of the K per-rank losses. Every rank can build every rank's batch, so each
rank also computes the single-process reference locally.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from mpi4py import MPI

from melissa_dl.embeddings.sparse_optim import make_sparse_optimizer
from melissa_dl.embeddings.table import ShardedEmbedding, set_default_collectives, shard_range
from melissa_dl.runtime.collectives import Collectives, MpiCollectives, TorchCollectives

pytestmark = pytest.mark.timeout(120)

NUM_ROWS, DIM = 37, 5
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def no_default_collectives() -> Iterator[None]:
    set_default_collectives(None)
    yield
    set_default_collectives(None)


def make(optimizer: str, collectives: Collectives | None, **kwargs: object) -> ShardedEmbedding:
    lr = 0.5 if optimizer == "sgd" else 0.05
    return ShardedEmbedding(
        NUM_ROWS,
        DIM,
        make_sparse_optimizer(optimizer, lr),
        collectives=collectives,
        dtype=torch.float64,
        seed=3,
        **kwargs,  # type: ignore[arg-type]
    )


def batch(step: int, rank: int) -> torch.Tensor:
    """Rank-specific ids with duplicates within a rank, shared ids across ranks, ids of every owner."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    own = torch.randint(0, NUM_ROWS, (9,), generator=g)
    shared = torch.tensor([0, NUM_ROWS - 1, NUM_ROWS // 2, 7 + step])
    return torch.cat([own, own[:3], shared]).view(4, 4)


def target(step: int, rank: int, n: int) -> torch.Tensor:
    return torch.randn((n, DIM), generator=torch.Generator().manual_seed(77 + 1000 * step + rank), dtype=torch.float64)


def loss_of(out: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    """A rank's mean loss (a plain sum when it has no rows, to avoid the NaN of an empty mean)."""
    flat = out.reshape(-1, DIM)
    diff = (flat - target(step, rank, flat.shape[0])) ** 2
    return diff.mean() if flat.shape[0] else diff.sum()


def gather_table(comm: MPI.Comm, emb: ShardedEmbedding) -> torch.Tensor:
    return torch.cat([torch.from_numpy(s) for s in comm.allgather(emb.shard.numpy())])


def reference_step(ref: ShardedEmbedding, batches: list[torch.Tensor], step: int) -> torch.Tensor:
    """One single-process step on the concatenated batch with the mean of the per-rank losses."""
    out = ref(torch.cat([b.reshape(-1) for b in batches]))
    losses, offset = [], 0
    for rank, b in enumerate(batches):
        losses.append(loss_of(out[offset : offset + b.numel()], step, rank))
        offset += b.numel()
    torch.stack(losses).mean().backward()
    ref.apply_gradients()
    return out.detach()


def owned_unique(ids: list[torch.Tensor], start: int, stop: int) -> int:
    rows = torch.unique(torch.cat([i.reshape(-1) for i in ids]))
    return int(((rows >= start) & (rows < stop)).sum())


def check_invariant(
    comm: MPI.Comm, coll: Collectives, optimizer: str, batch_of: Callable[[int, int], torch.Tensor]
) -> None:
    rank, size = comm.rank, comm.size
    emb, ref = make(optimizer, coll), make(optimizer, None)
    assert emb.distributed == (size > 1)
    for step in range(2):
        batches = [batch_of(step, r) for r in range(size)]
        out = emb(batches[rank])
        assert out.shape == (*batches[rank].shape, DIM) and out.requires_grad
        expected = reference_step(ref, batches, step)
        offset = sum(b.numel() for b in batches[:rank])
        # to rounding: with K not a power of 2, the 1/K of the mean loss rounds differently on the two sides
        torch.testing.assert_close(
            out.detach().reshape(-1, DIM), expected[offset : offset + batches[rank].numel()], rtol=1e-12, atol=1e-12
        )
        loss_of(out, step, rank).backward()
        assert emb.apply_gradients() == owned_unique(batches, emb.start, emb.stop)
        torch.testing.assert_close(gather_table(comm, emb), ref.shard, rtol=1e-12, atol=1e-12)
    if any(b.numel() for b in batches):
        assert not torch.equal(ref.shard, make(optimizer, None).shard)  # it did train


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "rowadagrad"])
def test_k_ranks_match_one_process_on_the_concatenated_batch(
    comm: MPI.Comm, mpi: MpiCollectives, optimizer: str
) -> None:
    check_invariant(comm, mpi, optimizer, batch)


def test_a_rank_without_ids_joins_and_the_others_update_right(comm: MPI.Comm, mpi: MpiCollectives) -> None:
    def batch_of(step: int, rank: int) -> torch.Tensor:
        return torch.zeros(0, dtype=torch.long) if rank == 0 else batch(step, rank)

    check_invariant(comm, mpi, "adam", batch_of)


def test_a_lookup_without_gradient_counts_as_zero(comm: MPI.Comm, mpi: MpiCollectives) -> None:
    emb, ref = make("sgd", mpi), make("sgd", None)
    ids = batch(0, comm.rank)
    if comm.rank == 0:
        emb(ids)  # output unused on this rank: its rows get no gradient from here
    else:
        loss_of(emb(ids), 0, comm.rank).backward()
    emb.apply_gradients()
    out = ref(torch.cat([torch.zeros(0, dtype=torch.long), *(batch(0, r).reshape(-1) for r in range(1, comm.size))]))
    if comm.size > 1:
        n = ids.numel()
        (sum(loss_of(out[i * n : (i + 1) * n], 0, i + 1) for i in range(comm.size - 1)) / comm.size).backward()
    ref.apply_gradients()
    torch.testing.assert_close(gather_table(comm, emb), ref.shard, rtol=1e-12, atol=1e-12)


def test_validation_lookups_match_and_remember_nothing(comm: MPI.Comm, mpi: MpiCollectives) -> None:
    emb, ref = make("sgd", mpi), make("sgd", None)
    ids = batch(1, comm.rank)
    with torch.no_grad():
        out = emb(ids)
    assert not out.requires_grad and torch.equal(out, ref(ids).detach())
    emb.eval()
    assert torch.equal(emb(ids), out)
    assert emb.apply_gradients() == 0 and torch.equal(gather_table(comm, emb), ref.shard)


def test_out_of_range_ids_are_refused_before_any_collective(comm: MPI.Comm, mpi: MpiCollectives) -> None:
    emb = make("sgd", mpi, name="particles")
    for bad in ([3, NUM_ROWS, 1], [[2], [-1]]):
        with pytest.raises(ValueError, match=rf"'particles'.*id {bad[1][0] if isinstance(bad[1], list) else bad[1]} "):
            emb(torch.tensor(bad))
    emb(batch(0, comm.rank)).sum().backward()  # the collectives are still in step afterwards
    assert emb.apply_gradients() == owned_unique([batch(0, r) for r in range(comm.size)], emb.start, emb.stop)


def test_initial_rows_do_not_depend_on_the_number_of_ranks(comm: MPI.Comm, mpi: MpiCollectives) -> None:
    emb = make("sgd", mpi)
    assert (emb.start, emb.stop) == shard_range(NUM_ROWS, comm.size, comm.rank)
    assert emb.shard.shape == (emb.stop - emb.start, DIM)
    assert torch.equal(gather_table(comm, emb), make("sgd", None).shard)


def test_default_collectives_shard_the_table(comm: MPI.Comm, mpi: MpiCollectives) -> None:
    set_default_collectives(mpi)
    emb = make("sgd", None)
    assert emb.collectives is mpi and (emb.start, emb.stop) == shard_range(NUM_ROWS, comm.size, comm.rank)


# Last: the gloo group lives only for the end of this file.
def test_invariant_through_torch_distributed_gloo(comm: MPI.Comm, gloo: TorchCollectives) -> None:
    check_invariant(comm, gloo, "adam", batch)
