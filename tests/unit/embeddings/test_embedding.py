"""ShardedEmbedding on one process, and the row -> rank map (no MPI)."""

from __future__ import annotations

import copy
import pickle
import sys
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from melissa_dl.embeddings import row_kernels
from melissa_dl.embeddings import table as embedding_module
from melissa_dl.embeddings.sparse_optim import make_sparse_optimizer
from melissa_dl.embeddings.table import (
    ShardedEmbedding,
    row_owners,
    set_default_collectives,
    shard_range,
    sum_rows,
    unique_ids,
)

LR = 0.1
COMPILE = row_kernels.load.__wrapped__  # uncached, and whatever path the test runs on

pytestmark = pytest.mark.usefixtures("row_path")


@pytest.fixture(autouse=True)
def no_default_collectives() -> Iterator[None]:
    set_default_collectives(None)
    yield
    set_default_collectives(None)


class NoCommunication:
    """Collectives of one rank (or pretending to be rank r of K) that fail if ever called."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        self.rank, self.size = rank, size

    def allreduce_sum_(self, tensor: torch.Tensor) -> None:
        raise AssertionError("no collective expected")

    def alltoallv(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        raise AssertionError("no collective expected")

    def close(self) -> None:
        pass


def table(num_rows: int = 20, dim: int = 3, optimizer: str = "sgd", **kwargs: object) -> ShardedEmbedding:
    return ShardedEmbedding(num_rows, dim, make_sparse_optimizer(optimizer, LR), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", range(1, 8))
@pytest.mark.parametrize("num_rows", [0, 1, 5, 6, 7, 20, 101])
def test_shard_ranges_cover_contiguously_balanced_remainder_first(num_rows: int, size: int) -> None:
    ranges = [shard_range(num_rows, size, r) for r in range(size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_rows
    assert all(ranges[r][1] == ranges[r + 1][0] for r in range(size - 1))
    lengths = [stop - start for start, stop in ranges]
    assert lengths == sorted(lengths, reverse=True) and max(lengths) - min(lengths) <= 1
    assert sum(length > num_rows // size for length in lengths) == num_rows % size
    rows = torch.arange(num_rows)
    owners = row_owners(rows, num_rows, size)
    expected = torch.cat([torch.full((stop - start,), r) for r, (start, stop) in enumerate(ranges)])
    assert torch.equal(owners, expected.long())
    assert torch.equal(
        row_owners(rows.flip(0).view(-1, 1) if num_rows else rows, num_rows, size).view(-1), expected.flip(0).long()
    )


def test_shard_range_examples_and_invalid_arguments() -> None:
    assert [shard_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [shard_range(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    for args in [(10, 0, 0), (10, 2, 2), (10, 2, -1), (-1, 2, 0)]:
        with pytest.raises(ValueError):
            shard_range(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_unique_ids_and_sum_rows_are_torch_unique_and_index_add(dtype: torch.dtype, row_path: str) -> None:
    ids = torch.randint(0, 50, (300,), generator=torch.Generator().manual_seed(0))
    wide = torch.tensor([2**40, 3, 2**40, 5])  # keys of 64 bits
    for batch in (ids, ids[:0], wide, torch.tensor([2**61, -3, 2**61, -(2**61)])):  # the last beyond packing
        unique = unique_ids(batch)
        expected_unique, expected_inverse = torch.unique(batch, sorted=True, return_inverse=True)
        assert torch.equal(unique.ids, expected_unique) and torch.equal(unique.inverse, expected_inverse)
        assert unique.ids.dtype == unique.inverse.dtype == torch.int64
        grads = torch.randn(len(batch), 4, generator=torch.Generator().manual_seed(1)).to(dtype)
        expected = grads.new_zeros(len(expected_unique), 4).index_add_(0, expected_inverse, grads)
        for walked in (unique, unique._replace(keys=None)):  # by the sorted keys, by index_add_
            summed = sum_rows(grads, walked)
            assert summed.dtype == dtype
            assert torch.equal(summed, expected)  # summed in the same order: the same values
            assert torch.equal(sum_rows(grads, walked, 3), expected / 3)
    assert (unique_ids(ids).keys is not None) == (row_path == "compiled")  # then walked by their keys


@pytest.mark.parametrize("failure", ["numba missing", "a damaged cache file"])
def test_a_compiler_that_fails_leaves_the_torch_path(
    failure: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from melissa_dl import embeddings
    from melissa_dl.embeddings import row_loops

    def broken(*args: object) -> object:
        raise EOFError(failure)

    if failure == "numba missing":
        monkeypatch.setitem(sys.modules, "melissa_dl.embeddings.row_loops", None)  # importing it raises ImportError
        monkeypatch.delattr(embeddings, "row_loops")
    else:
        monkeypatch.setattr(row_loops, "adam", broken)
    assert COMPILE() is None
    assert "numba's compiled loops are not available" in caplog.text


@pytest.mark.parametrize("how", ["share_memory", "deepcopy", "pickle"])
def test_a_table_moved_to_shared_memory_or_copied_trains_as_the_original(how: str) -> None:
    """``share_memory()`` gives the shard new memory under the same tensor; a copy of the module has a shard of
    its own: the optimizer must update the memory the shard has now."""
    moved = {
        "share_memory": lambda m: m.share_memory(),
        "deepcopy": copy.deepcopy,
        "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    }[how](table(optimizer="rowadagrad"))
    reference = table(optimizer="rowadagrad")
    for emb in (moved, reference):
        for ids in ([1, 2, 1], [2, 5]):
            emb(torch.tensor(ids)).pow(2).sum().backward()
            emb.apply_gradients()
    assert not torch.equal(reference.shard, table().shard), "the reference did not train"
    assert torch.equal(moved.shard, reference.shard)


def test_single_process_matches_nn_embedding_with_sgd() -> None:
    emb = table()
    assert emb.collectives is None and (emb.start, emb.stop) == (0, 20) and emb.shard.shape == (20, 3)
    assert "shard" in dict(emb.named_buffers()) and not list(emb.parameters())
    reference = nn.Embedding(20, 3)
    reference.weight.data.copy_(emb.shard)
    ids = torch.tensor([[3, 7, 3], [19, 0, 3]])
    target = torch.linspace(-1, 1, 18).view(2, 3, 3)
    out, expected = emb(ids), reference(ids)
    assert out.shape == (2, 3, 3) and torch.equal(out, expected)
    for y in (out, expected):
        ((y - target) ** 2).mean().backward()
    assert emb.apply_gradients() == 4  # rows 0, 3, 7, 19
    assert reference.weight.grad is not None
    assert torch.allclose(emb.shard, reference.weight.detach() - LR * reference.weight.grad, atol=1e-7)
    assert emb.apply_gradients() == 0  # nothing looked up since


def test_two_lookups_in_one_step_sum_their_gradients() -> None:
    emb = table()
    reference = nn.Embedding(20, 3)
    reference.weight.data.copy_(emb.shard)
    a, b = torch.tensor([1, 2, 2]), torch.tensor([2, 5])
    for e in (emb, reference):
        (e(a).sum() * 2 + (e(b) ** 2).sum()).backward()
    assert emb.apply_gradients() == 3
    assert reference.weight.grad is not None
    assert torch.allclose(emb.shard, reference.weight.detach() - LR * reference.weight.grad, atol=1e-7)


def test_the_output_takes_in_place_ops_and_a_second_backward_as_nn_embedding() -> None:
    emb = table()
    reference = nn.Embedding(20, 3)
    reference.weight.data.copy_(emb.shard)
    ids = torch.tensor([[3, 7], [7, 7]])
    for e in (emb, reference):
        out = e(ids)
        out.mul_(torch.arange(1.0, 5.0).view(2, 2, 1))  # not a leaf: in place is fine
        loss = (out**2).sum()
        loss.backward(retain_graph=True)
        loss.backward()  # gradients accumulate
    assert emb.apply_gradients() == 2
    assert reference.weight.grad is not None
    torch.testing.assert_close(emb.shard, reference.weight.detach() - LR * reference.weight.grad)


def test_the_batch_and_the_gradient_may_change_between_backward_and_the_update() -> None:
    emb = table()
    reference = nn.Embedding(20, 3)
    reference.weight.data.copy_(emb.shard)
    ids, upstream = torch.tensor([1, 2, 2]), torch.linspace(-1, 1, 9).view(3, 3)
    for e in (emb, reference):
        e(ids).backward(upstream)
    ids.copy_(torch.tensor([5, 6, 7]))
    upstream.zero_()
    assert emb.apply_gradients() == 2
    assert reference.weight.grad is not None
    torch.testing.assert_close(emb.shard, reference.weight.detach() - LR * reference.weight.grad)


def test_lookup_without_gradient_validation_and_eval_remember_nothing() -> None:
    emb = table()
    before = emb.shard.clone()
    emb(torch.tensor([4, 5]))  # output unused: zero gradient
    assert emb.apply_gradients() == 2 and torch.equal(emb.shard, before)
    with torch.no_grad():
        out = emb(torch.tensor([[4, 9], [4, 0]], dtype=torch.int32))
    assert torch.equal(out, nn.functional.embedding(torch.tensor([[4, 9], [4, 0]]), before))
    assert not out.requires_grad and emb.apply_gradients() == 0
    emb.eval()
    assert not emb(torch.tensor([4])).requires_grad and emb.apply_gradients() == 0


def test_empty_ids_and_shapes() -> None:
    emb = table(dim=4)
    assert emb(torch.zeros(0, dtype=torch.long)).shape == (0, 4)
    assert emb(torch.zeros(2, 0, dtype=torch.int32)).shape == (2, 0, 4)
    assert emb(torch.tensor(7)).shape == (4,)
    assert emb.apply_gradients() == 1  # row 7
    emb(torch.zeros(0, dtype=torch.long)).sum().backward()
    assert emb.apply_gradients() == 0


def test_bad_ids_are_refused_naming_the_table() -> None:
    emb = table(name="nodes")
    with pytest.raises(ValueError, match=r"'nodes'.*id 20 out of range \[0, 20\)"):
        emb(torch.tensor([1, 20, -3]))
    with pytest.raises(ValueError, match="id -3 "):
        emb(torch.tensor([[1], [-3]]))
    with pytest.raises(TypeError, match="'nodes'.*integers"):
        emb(torch.tensor([1.0]))
    assert emb.apply_gradients() == 0


def test_no_communication_without_collectives_or_with_one_rank() -> None:
    assert table().collectives is None
    set_default_collectives(NoCommunication())  # type: ignore[arg-type]
    emb = table()
    assert isinstance(emb.collectives, NoCommunication) and not emb.distributed
    emb(torch.tensor([1, 1, 2])).sum().backward()
    assert emb.apply_gradients() == 2
    explicit = NoCommunication()
    assert table(collectives=explicit).collectives is explicit  # type: ignore[arg-type]


def test_initial_rows_depend_on_seed_and_row_only() -> None:
    num_rows, dim = 3 * embedding_module.INIT_BLOCK_ROWS // 2 + 7, 2
    whole = table(num_rows, dim, seed=5).shard
    for size in (2, 3, 5):
        parts = [table(num_rows, dim, seed=5, collectives=NoCommunication(r, size)).shard for r in range(size)]
        assert torch.equal(torch.cat(parts), whole)
    assert not torch.equal(table(num_rows, dim, seed=6).shard, whole)
    assert abs(float(whole.std()) - dim**-0.5) < 0.02
    assert float(table(100, 16, init_std=0.01).shard.std()) < 0.02


def test_state_dict_holds_shard_range_and_optimizer_state() -> None:
    emb = table(optimizer="adam")
    for ids in ([1, 2], [2, 3]):
        emb(torch.tensor(ids)).sum().backward()
        emb.apply_gradients()
    state = emb.state_dict()
    restored = table(optimizer="adam")
    restored.load_state_dict(state)
    assert torch.equal(restored.shard, emb.shard)
    for e in (emb, restored):
        e(torch.tensor([2, 4])).pow(2).sum().backward()
        e.apply_gradients()
    assert torch.equal(restored.shard, emb.shard)  # the moments and the step count came back too
    other = table(optimizer="adam", collectives=NoCommunication(1, 2))
    state["_extra_state"]["start"], state["_extra_state"]["stop"] = 10, 20
    state["shard"] = state["shard"][10:]
    state["_extra_state"]["optimizer"]["moments"] = state["_extra_state"]["optimizer"]["moments"][10:]
    other.load_state_dict(state)
    state["_extra_state"]["start"] = 9
    with pytest.raises(ValueError, match="re-shard"):
        other.load_state_dict(state)


def test_moving_the_module_rebinds_the_optimizer() -> None:
    emb = table(optimizer="adam")
    emb(torch.tensor([1])).sum().backward()
    emb.apply_gradients()
    emb.to(torch.float64)  # replaces the buffer, as .to(cuda) would
    assert emb.shard.dtype == torch.float64
    before = emb.shard.clone()
    emb(torch.tensor([1])).sum().backward()
    emb.apply_gradients()
    assert not torch.equal(emb.shard[1], before[1]) and torch.equal(emb.shard[2], before[2])


@pytest.mark.parametrize(("before", "after"), [(3, 2), (2, 3), (1, 4), (4, 1)])
def test_load_rows_re_shards_rows_and_optimizer_state_to_another_k(before: int, after: int) -> None:
    whole = table(optimizer="adam")
    for ids in ([1, 2, 19], [2, 7, 13]):
        whole(torch.tensor(ids)).pow(2).sum().backward()
        whole.apply_gradients()
    state = whole.state_dict()
    extra = state["_extra_state"]

    def piece(start: int, stop: int) -> dict:
        optimizer = {"step": extra["optimizer"]["step"], "moments": extra["optimizer"]["moments"][start:stop]}
        return {
            "shard": state["shard"][start:stop],
            "extra": {"num_rows": 20, "start": start, "stop": stop, "optimizer": optimizer},
        }

    pieces = [piece(*shard_range(20, before, r)) for r in range(before)]
    for rank in range(after):
        shard = table(optimizer="adam", collectives=NoCommunication(rank, after))
        shard.load_rows(list(reversed(pieces)))  # any order
        start, stop = shard_range(20, after, rank)
        assert torch.equal(shard.shard, whole.shard[start:stop])
        loaded = shard.optimizer.state_dict()
        assert loaded["step"] == 2 and torch.equal(loaded["moments"], extra["optimizer"]["moments"][start:stop])
    with pytest.raises(ValueError, match="lacks rows 0:"):
        table(optimizer="adam").load_rows(pieces[1:])
