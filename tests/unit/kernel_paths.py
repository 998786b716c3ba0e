"""The fixture of the tests that run on both paths of the sparse code: import ``row_path`` and use it."""

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
