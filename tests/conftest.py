"""What the pytest of every tier (unit, integration, the ranks of tests/mpi) shares."""

from __future__ import annotations

import gc

import pytest


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the collection imported (torch, the server's modules) lives to the end of the run: frozen out of the
    collector's way, its full collections, during the tests and at the process's exit, no longer walk it (about
    2 s of a ``tests/mpi`` run on 3 ranks), as ``melissa-server``'s ranks do once their trainer is built."""
    gc.freeze()
