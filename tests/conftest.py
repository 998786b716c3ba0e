"""What the pytest of every tier (unit, integration, the ranks of tests/mpi) shares: hooks and fixtures only (the
class the ``clock`` fixture returns is in ``clocks.py``)."""

from __future__ import annotations

import gc
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from clocks import Clock

if not Path("/dev/nvidiactl").exists() or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
    # no GPU: the GPU kernels' tests run Triton's interpreter on CPU tensors, which must be on before triton is
    # first imported (its own library functions are made at import, interpreted or compiled)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_finish(session: pytest.Session) -> None:
    """What the collection imported (torch, the server's modules) lives to the end of the run: frozen out of the
    collector's way, its full collections, during the tests and at the process's exit, no longer walk it (about
    2 s of a ``tests/mpi`` run on 3 ranks), as ``melissa-server``'s ranks do once their trainer is built."""
    gc.freeze()


@pytest.fixture(autouse=True)
def finite_compile_ends_with_its_test() -> Iterator[None]:
    """The non-finite check's loop compiles in a thread of its own (``ingest/finite.py``), adding ~120 MB to the
    process: one that a test started must end with that test, not grow the next one's memory (a measure of it)."""
    yield
    finite = sys.modules.get("melissa_dl.ingest.finite")
    if finite is not None and finite._compiler is not None:
        finite._compiler.join()


@pytest.fixture
def clock(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Clock:
    """A clock the test moves by hand, as the ``time`` of the modules its test module names in ``CLOCKED`` (theirs
    only: the process's own clock runs on)."""
    clock = Clock()
    for module in request.module.CLOCKED:
        monkeypatch.setattr(module, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    return clock
