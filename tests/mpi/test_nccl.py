"""NCCL, started from the MPI communicator, on CUDA tensors: one GPU per rank (docs/how-to/gpus.md#tested-on-a-gpu).

Skipped, with the reason, unless this node has a GPU for every rank; the same
collectives on CPU tensors are tested through MPI and gloo in
test_collectives.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

from melissa_dl.embeddings.sparse_optim import make_sparse_optimizer
from melissa_dl.embeddings.table import ShardedEmbedding, _initial_rows
from melissa_dl.runtime.collectives import GradientAverager, TorchCollectives, make_collectives

GPUS = torch.cuda.device_count()
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        GPUS < MPI.COMM_WORLD.Get_size(),
        reason=f"needs a CUDA device per rank: {GPUS} for {MPI.COMM_WORLD.Get_size()} ranks",
    ),
]


@pytest.fixture(scope="module")
def nccl(comm: MPI.Comm) -> Iterator[TorchCollectives]:
    device = torch.device("cuda", comm.rank)
    torch.cuda.set_device(device)
    collectives = make_collectives(comm, device)
    assert isinstance(collectives, TorchCollectives)
    yield collectives
    collectives.close()


def test_nccl_is_the_process_group_of_the_mpi_ranks(nccl: TorchCollectives, comm: MPI.Comm) -> None:
    assert dist.get_backend() == "nccl"
    assert (dist.get_rank(), dist.get_world_size()) == (comm.rank, comm.size)
    assert len(torch.cuda.nccl.version()) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_allreduce_of_a_cuda_tensor(nccl: TorchCollectives, dtype: torch.dtype) -> None:
    tensor = torch.arange(12, dtype=dtype, device=nccl.device) * (nccl.rank + 1)
    nccl.allreduce_sum_(tensor)
    started = torch.ones(5, device=nccl.device)
    nccl.start_allreduce_sum_(started).wait()
    factor = sum(r + 1 for r in range(nccl.size))
    assert torch.equal(tensor.cpu(), torch.arange(12, dtype=dtype) * factor)
    assert torch.equal(started.cpu(), torch.full((5,), float(nccl.size)))


def test_reduce_scatter_and_allgather_of_cuda_tensors(nccl: TorchCollectives) -> None:
    counts = [r + 2 for r in range(nccl.size)]
    start, mine = sum(counts[: nccl.rank]), counts[nccl.rank]
    out = torch.empty(mine, device=nccl.device)
    nccl.start_reduce_scatter_sum(torch.arange(float(sum(counts)), device=nccl.device), counts, out).wait()
    assert torch.equal(out.cpu(), torch.arange(float(start), start + mine) * nccl.size)
    gathered = torch.full((sum(counts),), -1.0, device=nccl.device)
    gathered[start : start + mine] = nccl.rank
    nccl.start_allgather_(gathered, counts).wait()
    assert torch.equal(gathered.cpu(), torch.cat([torch.full((c,), float(r)) for r, c in enumerate(counts)]))


@pytest.mark.parametrize("dtype", [torch.int64, torch.float32, torch.bool])
def test_alltoallv_of_cuda_rows_with_uneven_counts(nccl: TorchCollectives, dtype: torch.dtype) -> None:
    me, size = nccl.rank, nccl.size

    def rows(source: int, destination: int) -> torch.Tensor:
        return (torch.arange((source + 2 * destination) % 3 + 1) + 16 * source + 4 * destination).to(dtype)

    send = torch.cat([rows(me, d) for d in range(size)]).to(nccl.device)
    recv, recv_counts = nccl.alltoallv(send, [len(rows(me, d)) for d in range(size)])
    assert recv.device == nccl.device and recv_counts == [len(rows(s, me)) for s in range(size)]
    assert torch.equal(recv.cpu(), torch.cat([rows(s, me) for s in range(size)]))


def test_gradients_averaged_over_the_ranks_on_the_gpus(nccl: TorchCollectives) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).to(nccl.device)
    averager = GradientAverager(model.parameters(), nccl, small_bytes=256)  # a large tensor and a pack
    for p in model.parameters():
        p.grad = torch.full_like(p, float(nccl.rank))
    averager.average()
    mean = sum(range(nccl.size)) / nccl.size
    assert all(torch.equal(p.grad.cpu(), torch.full(p.shape, mean)) for p in model.parameters())


def test_a_sharded_table_looks_up_and_updates_rows_over_nccl(nccl: TorchCollectives) -> None:
    """Every rank looks up every row; plain SGD on a sum loss moves each row by lr x (its count over the ranks)
    / K, the mean loss's gradient."""
    table = ShardedEmbedding(40, 4, make_sparse_optimizer("sgd", 0.5), collectives=nccl, seed=3, device=nccl.device)
    whole = _initial_rows(0, 40, 4, 4**-0.5, 3)
    ids = torch.arange(40, device=nccl.device).repeat(2)  # each id twice on every rank
    out = table(ids)
    assert torch.equal(out.detach().cpu(), whole[ids.cpu()])
    out.sum().backward()
    table.apply_gradients()
    assert torch.allclose(table.shard.cpu(), whole[table.start : table.stop] - 0.5 * 2)
