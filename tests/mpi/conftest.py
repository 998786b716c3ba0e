"""Fixtures of the tests that run under `mpirun -n 1`, `-n 2` and `-n 3`."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest
import torch
from mpi4py import MPI

from melissa_dl.runtime.collectives import MpiCollectives, TorchCollectives


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failure on one rank ends every rank at once: the others would wait in a collective until the timeout."""
    report = yield
    if report.failed and MPI.COMM_WORLD.Get_size() > 1:
        sys.stderr.write(
            f"rank {MPI.COMM_WORLD.Get_rank()}: {item.nodeid} failed, aborting every rank\n{report.longreprtext}\n"
        )
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)
    return report


@pytest.fixture(scope="module")
def comm() -> Iterator[MPI.Comm]:
    """A private communicator per test file, so that files cannot mix their messages."""
    duplicate = MPI.COMM_WORLD.Dup()
    yield duplicate
    duplicate.Free()


@pytest.fixture(scope="module")
def mpi(comm: MPI.Comm) -> Iterator[MpiCollectives]:
    collectives = MpiCollectives(comm)
    yield collectives
    collectives.close()


@pytest.fixture(scope="module")
def gloo(comm: MPI.Comm) -> Iterator[TorchCollectives]:
    """Each file's own process group, closed at the end of the file (one group per process at a time)."""
    collectives = TorchCollectives(comm, "gloo", torch.device("cpu"))
    yield collectives
    collectives.close()
