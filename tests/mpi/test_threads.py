"""torch's thread count per rank: the cores its affinity allows, shared with the ranks of its node allowed there."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from mpi4py import MPI

from melissa_dl.train.trainer import torch_threads

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def affinity() -> Iterator[set[int]]:
    """This rank's affinity mask, restored after the test."""
    mask = os.sched_getaffinity(0)
    yield mask
    os.sched_setaffinity(0, mask)


def test_unbound_ranks_share_their_cores(comm: MPI.Comm, affinity: set[int]) -> None:
    assert comm.allgather(affinity) == [affinity] * comm.size, "mpirun -n K starts unbound ranks"
    assert torch_threads(comm) == max(1, len(affinity) // comm.size)


def test_a_rank_counts_only_the_cores_its_mask_allows(comm: MPI.Comm, affinity: set[int]) -> None:
    """Bound, as by srun --cpu-bind or taskset: each rank on a core of its own (where the node has enough)."""
    cores = sorted(affinity)
    if len(cores) < comm.size:
        pytest.skip(f"{len(cores)} cores for {comm.size} ranks")
    os.sched_setaffinity(0, {cores[comm.rank]})
    assert torch_threads(comm) == 1
    os.sched_setaffinity(0, set(cores[comm.rank :: comm.size]))  # disjoint shares of the cores
    assert torch_threads(comm) == len(cores[comm.rank :: comm.size])
