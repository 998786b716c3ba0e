"""torch's thread count per rank: the cores its affinity allows, less the simulations of its node, shared with the
ranks of its node allowed there."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import pytest
import torch
from mpi4py import MPI

from melissa_dl.config.sections import TrainingConfig
from melissa_dl.train.trainer import set_threads, torch_threads

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


def test_the_simulations_the_launcher_runs_on_rank_0s_node_take_their_cores(comm: MPI.Comm, affinity: set[int]) -> None:
    """Every rank here is on rank 0's node, where the launcher runs its simulations: their ranks come off the
    cores before the server's ranks share the rest, and each rank keeps one thread however many there are."""
    assert torch_threads(comm, simulations=1) == max(1, (len(affinity) - 1) // comm.size)
    assert torch_threads(comm, simulations=len(affinity)) == 1
    assert torch_threads(comm, simulations=0) == torch_threads(comm)


def test_set_threads_sets_the_intra_and_inter_op_counts_and_rank_0_logs_every_ranks_choice(
    comm: MPI.Comm, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="melissa_dl.train.trainer")
    training = TrainingConfig(module="module.py", class_name="Module", threads=1)
    assert set_threads(training, comm, simulations=0) == 1
    assert torch.get_num_threads() == torch.get_num_interop_threads() == 1  # this process's first inter-op setting
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("torch threads per rank")]
    expected = f"torch threads per rank (intra- and inter-op): 1 on {comm.size} ranks (training.threads)"
    assert logged == ([expected] if comm.rank == 0 else [])
