"""Collectives and gradient averaging, under ``mpirun -n 1``, ``-n 2`` and ``-n 3``.

Every rank runs the same tests in the same order and calls the same
collectives; only the data differ by rank. CPU tensors are tested through MPI
and through torch.distributed with gloo (the NCCL code path, minus the GPU).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

from melissa_dl.runtime.collectives import (
    Collectives,
    GradientAverager,
    MpiCollectives,
    TorchCollectives,
    _rendezvous_address,
    make_collectives,
)

pytestmark = pytest.mark.timeout(120)

CPU = torch.device("cpu")


@pytest.fixture(params=["mpi", "gloo"])
def coll(request: pytest.FixtureRequest) -> Collectives:
    """Each transport in turn; function-scoped so that pytest keeps the file's test order."""
    return request.getfixturevalue(request.param)


# Runs before any test that opens the module's gloo group.
def test_torch_backend_initialises_from_mpi_and_reinitialises_after_close(comm: MPI.Comm) -> None:
    assert not dist.is_initialized()
    for attempt in range(2):
        collectives = TorchCollectives(comm, "gloo", CPU)
        assert (dist.get_rank(), dist.get_world_size()) == (comm.rank, comm.size)
        tensor = torch.full((3,), float(comm.rank + attempt))
        collectives.allreduce_sum_(tensor)
        expected = sum(r + attempt for r in range(comm.size))
        assert torch.equal(tensor, torch.full((3,), float(expected)))
        with pytest.raises(RuntimeError, match="already initialised"):
            TorchCollectives(comm, "gloo", CPU)
        collectives.close()
        assert not dist.is_initialized()


def test_rendezvous_address_is_rank_0_choice(comm: MPI.Comm, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    host, port = _rendezvous_address(comm)
    assert host == "127.0.0.1" and port > 0  # one host in these tests
    assert comm.allgather((host, port)) == [(host, port)] * comm.size
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    assert _rendezvous_address(comm)[0] == "localhost"


def test_make_collectives_uses_mpi_on_cpu(comm: MPI.Comm) -> None:
    collectives = make_collectives(comm, CPU)
    assert isinstance(collectives, MpiCollectives)
    assert (collectives.rank, collectives.size) == (comm.rank, comm.size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_allreduce_sum_in_place(coll: Collectives, dtype: torch.dtype) -> None:
    tensor = torch.arange(12, dtype=dtype).reshape(3, 4) * (coll.rank + 1)
    pointer = tensor.data_ptr()
    coll.allreduce_sum_(tensor)
    factor = sum(r + 1 for r in range(coll.size))
    assert tensor.data_ptr() == pointer
    assert torch.equal(tensor, torch.arange(12, dtype=dtype).reshape(3, 4) * factor)


def _pieces(size: int) -> list[int]:
    """Uneven pieces, the last rank's empty."""
    return [r + 2 for r in range(size - 1)] + [0 if size > 1 else 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_reduce_scatter_leaves_each_rank_the_sum_of_its_piece(coll: Collectives, dtype: torch.dtype) -> None:
    counts = _pieces(coll.size)
    tensor = torch.arange(sum(counts), dtype=dtype) * (coll.rank + 1)
    out = torch.full((counts[coll.rank],), -1.0, dtype=dtype)
    coll.start_reduce_scatter_sum(tensor, counts, out).wait()
    start = sum(counts[: coll.rank])
    factor = sum(r + 1 for r in range(coll.size))
    assert torch.equal(out, torch.arange(start, start + counts[coll.rank], dtype=dtype) * factor)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_allgather_fills_every_rank_with_every_piece_in_place(coll: Collectives, dtype: torch.dtype) -> None:
    counts = _pieces(coll.size)
    tensor = torch.full((sum(counts),), -1).to(dtype)
    start = sum(counts[: coll.rank])
    tensor[start : start + counts[coll.rank]] = coll.rank
    pointer = tensor.data_ptr()
    coll.start_allgather_(tensor, counts).wait()
    assert tensor.data_ptr() == pointer
    assert torch.equal(tensor, torch.cat([torch.full((c,), r) for r, c in enumerate(counts)]).to(dtype))


def test_allreduce_refuses_non_contiguous(coll: Collectives) -> None:
    with pytest.raises(ValueError, match="contiguous"):
        coll.allreduce_sum_(torch.zeros(4, 4).t())


def _rows(source: int, destination: int, count: int, width: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The rows ``source`` sends ``destination``: small integers exact in every dtype."""
    values = torch.arange(count) + 16 * source + 4 * destination
    if width is None:
        return values.to(dtype)
    return (values[:, None] + 32 * torch.arange(width)[None, :]).to(dtype)


def _count(source: int, destination: int) -> int:
    """Uneven counts; rank 0 sends nothing to rank 1."""
    return (source + 2 * destination + 1) % 3


@pytest.mark.parametrize(
    ("width", "dtype"), [(None, torch.int64), (3, torch.float32), (3, torch.bfloat16), (None, torch.bool)]
)
def test_alltoallv_uneven_rows(coll: Collectives, width: int | None, dtype: torch.dtype) -> None:
    me, size = coll.rank, coll.size
    counts = [_count(me, d) for d in range(size)]
    send = torch.cat([_rows(me, d, counts[d], width, dtype) for d in range(size)])
    recv, recv_counts = coll.alltoallv(send, counts)
    assert recv_counts == [_count(s, me) for s in range(size)]
    assert recv.dtype == dtype
    assert torch.equal(recv, torch.cat([_rows(s, me, _count(s, me), width, dtype) for s in range(size)]))


def test_alltoallv_takes_a_contiguous_tensor_of_any_strides(coll: Collectives) -> None:
    """A column (strides (1, n)) is contiguous for torch, though a view of its bytes needs it flattened first."""
    column = torch.arange(float(coll.size)).view(1, coll.size).t() + 10 * coll.rank
    assert column.is_contiguous() and column.stride() == (1, coll.size)
    recv, _ = coll.alltoallv(column, [1] * coll.size)
    assert torch.equal(recv, torch.tensor([[10.0 * s + coll.rank] for s in range(coll.size)]))


def _all_to_alls(coll: Collectives, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the transport's all-to-all calls from now on (counts and rows alike)."""
    calls: list[str] = []

    def counted(name: str, call: Any) -> Any:
        return lambda *args, **kwargs: (calls.append(name), call(*args, **kwargs))[1]

    if isinstance(coll, MpiCollectives):
        comm = coll.comm

        class Counting:
            def __getattr__(self, name: str) -> Any:
                return counted(name, getattr(comm, name)) if name.startswith("Alltoall") else getattr(comm, name)

        monkeypatch.setattr(coll, "comm", Counting())
    else:
        monkeypatch.setattr(dist, "all_to_all_single", counted("all_to_all_single", dist.all_to_all_single))
    return calls


def test_alltoallv_reply_with_the_counts_received_skips_their_exchange(
    coll: Collectives, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply sends back as many rows to each rank as came from it: the caller passes the counts it knows, and
    only the rows move."""
    me, size = coll.rank, coll.size
    counts = [_count(me, d) for d in range(size)]
    send = torch.cat([_rows(me, d, counts[d], 3, torch.float32) for d in range(size)])
    calls = _all_to_alls(coll, monkeypatch)
    question, asked = coll.alltoallv(send, counts)
    assert len(calls) == 2  # the counts, then the rows
    answer, answered = coll.alltoallv(question * 2, asked, recv_counts=counts)
    assert len(calls) == 3  # the rows only
    assert answered == counts and torch.equal(answer, send * 2)


def test_alltoallv_with_no_rows_anywhere(coll: Collectives) -> None:
    recv, recv_counts = coll.alltoallv(torch.empty(0, 5), [0] * coll.size)
    assert recv_counts == [0] * coll.size and recv.shape == (0, 5)


def test_alltoallv_refuses_bad_counts(coll: Collectives) -> None:
    with pytest.raises(ValueError, match="send_counts"):
        coll.alltoallv(torch.zeros(3), [4] + [0] * (coll.size - 1))
    expects_itself = [int(r == coll.rank) for r in range(coll.size)]  # one row from this rank, which sends none
    for recv_counts in ([0] * (coll.size + 1), [-1] + [0] * (coll.size - 1), expects_itself):
        with pytest.raises(ValueError, match="recv_counts"):
            coll.alltoallv(torch.zeros(0), [0] * coll.size, recv_counts)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at ``step``; sizes differ by rank so the mean of means matters."""
    generator = torch.Generator().manual_seed(100 + rank + 1000 * step)
    size = 4 + 3 * rank
    return torch.randn(size, 5, generator=generator), torch.randn(size, 3, generator=generator)


@pytest.mark.parametrize(("optimizer", "steps"), [(torch.optim.SGD, 1), (torch.optim.Adam, 2)])
@pytest.mark.parametrize(("small_bytes", "overlapping"), [(1 << 20, False), (0, False), (0, True)])
def test_ranks_train_like_one_model_on_the_mean_loss(
    coll: Collectives, optimizer: type[torch.optim.Optimizer], steps: int, small_bytes: int, overlapping: bool
) -> None:
    """K ranks on B_1..B_K equal one model whose loss is the mean of the K batch losses
    (docs/explanation/design.md#training-across-ranks).

    In float64: the ranks' and the reference's sums take other orders, and in float32 Adam made that 1.1e-6 on
    3 ranks of an Intel Xeon (a gradient that cancels), which says nothing of the invariant."""
    model = _mlp().double()
    averager = GradientAverager(model.parameters(), coll, small_bytes=small_bytes)
    assert len(averager.large) == (4 if small_bytes == 0 else 0)
    opt = optimizer(model.parameters(), lr=0.1)
    for step in range(steps):
        averager.zero_grad()
        x, y = (t.double() for t in _batch(coll.rank, step))
        with averager.overlapping() if overlapping else contextlib.nullcontext():
            nn.functional.mse_loss(model(x), y).backward()
        averager.average()
        opt.step()

    reference = _mlp().double()
    reference_opt = optimizer(reference.parameters(), lr=0.1)
    for step in range(steps):
        reference_opt.zero_grad()
        losses = [
            nn.functional.mse_loss(reference(x.double()), y.double())
            for x, y in (_batch(r, step) for r in range(coll.size))
        ]
        torch.stack(losses).mean().backward()
        reference_opt.step()
    for trained, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(trained, expected, atol=1e-6, rtol=0)


def test_large_gradients_are_reduced_where_backward_left_them(coll: Collectives) -> None:
    """No memset and no add: after zero_grad the gradients are None, and a large one stays the tensor backward
    made; small ones become views of one flat tensor."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 2))
    averager = GradientAverager(model.parameters(), coll, small_bytes=64 * 64 * 4)
    assert [p is model[0].weight for p in averager.large] == [True] and len(averager.packs) == 1
    averager.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    model(torch.ones(3, 64)).sum().backward()
    made = model[0].weight.grad
    averager.average()
    assert model[0].weight.grad is made
    flat = averager.packs[0][0]
    for p in (model[0].bias, *model[1].parameters()):
        assert p.grad is not None and p.grad.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


def test_overlapped_reductions_keep_one_order_when_a_rank_leaves_a_parameter_out(coll: Collectives) -> None:
    """Rank 0 never uses the middle layer: its gradient is zeros there, reduced in the same order as on the
    ranks that produced it during backward (no mismatched or hanging reduction), and the mean is right."""
    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)])
    averager = GradientAverager(layers.parameters(), coll, small_bytes=0)
    used = [0, 2] if coll.rank == 0 else [0, 1, 2]

    def loss() -> torch.Tensor:
        x = torch.ones(2, 4)
        for i in used:
            x = layers[i](x)
        return x.sum()

    own = torch.autograd.grad(loss(), list(layers.parameters()), allow_unused=True)
    expected = [torch.zeros_like(p) if g is None else g.clone() for p, g in zip(layers.parameters(), own)]
    for tensor in expected:
        coll.allreduce_sum_(tensor)
        tensor.div_(coll.size)
    for _ in range(2):
        averager.zero_grad()
        with averager.overlapping():
            loss().backward()
        averager.average()
        for p, mean in zip(layers.parameters(), expected):
            torch.testing.assert_close(p.grad, mean)


def test_missing_or_non_contiguous_gradients_count_as_zeros_or_are_made_contiguous(coll: Collectives) -> None:
    """Float32 and float64 parameters get separate packs; stale values in a pack never leak into a mean."""
    model = nn.ModuleDict({"single": nn.Linear(4, 4), "wide": nn.Linear(4, 2).double()})
    frozen = nn.Parameter(torch.zeros(3), requires_grad=False)
    averager = GradientAverager([*model.parameters(), frozen, model["single"].weight], coll, small_bytes=64)
    assert len(averager.packs) == 2 and frozen.grad is None  # the weights of 64 bytes are large, the biases packed
    assert {id(p) for p in averager.large} == {id(model["single"].weight), id(model["wide"].weight)}
    me, size = coll.rank, coll.size
    for flat, _, _ in averager.packs:
        flat.fill_(7.0)  # stale values a missing gradient must not contribute
    for p in model.parameters():
        p.grad = torch.full_like(p, float(me + 1))
    model["single"].weight.grad = torch.full((4, 4), float(me + 1)).t()  # not contiguous
    model["single"].bias.grad = None if me == 0 else model["single"].bias.grad
    averager.average()
    mean = sum(r + 1 for r in range(size)) / size
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.is_contiguous()
        expected = (mean - 1 / size) if name == "single.bias" else mean
        torch.testing.assert_close(p.grad, torch.full_like(p, expected))
    averager.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_sparse_gradients_are_refused(coll: Collectives) -> None:
    embedding = nn.Embedding(10, 4, sparse=True)
    averager = GradientAverager(embedding.parameters(), coll)
    embedding.weight.grad = None
    embedding(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="sparse gradient"):
        averager.average()
