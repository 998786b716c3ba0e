"""Fixtures of the tests that run under `mpirun -n 1` and `mpirun -n 2`."""
from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from mpi4py import MPI

from melissa_dl.collectives import MpiCollectives, TorchCollectives


@pytest.fixture(scope="module")
def comm() -> Iterator[MPI.Comm]:
    """A private communicator per test file, so that files cannot mix their messages."""
    duplicate = MPI.COMM_WORLD.Dup()
    yield duplicate
    duplicate.Free()


@pytest.fixture(scope="module")
def mpi(comm: MPI.Comm) -> MpiCollectives:
    return MpiCollectives(comm)


@pytest.fixture(scope="module")
def gloo(comm: MPI.Comm) -> Iterator[TorchCollectives]:
    """Each file's own process group, closed at the end of the file (one group per process at a time)."""
    collectives = TorchCollectives(comm, "gloo", torch.device("cpu"))
    yield collectives
    collectives.close()
