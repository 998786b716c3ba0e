"""The fixture of the tests that run on both paths of the sparse code, ``row_path``: a test of this folder takes it
by name, or a whole module through ``pytestmark = pytest.mark.usefixtures("row_path")``."""

from __future__ import annotations

import pytest

from melissa_dl.embeddings import row_kernels


@pytest.fixture(params=["compiled", "torch"])
def row_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The test once with numba's compiled row loops (a dependency: here they must load), once with torch's ops
    (what GPUs, float16 tables and a machine without numba run)."""
    if request.param == "torch":
        monkeypatch.setattr(row_kernels, "load", lambda: None)
    else:
        assert row_kernels.load() is not None
    return str(request.param)
