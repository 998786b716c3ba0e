"""The package face: the public API from ``melissa_dl`` itself, and a simulation's import does not load torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

import melissa_dl
from melissa_dl.embeddings.sparse_optim import RowAdagrad
from melissa_dl.embeddings.table import ShardedEmbedding
from melissa_dl.train.module import TrainingModule
from melissa_dl.wire.client import Client


def test_the_public_api_is_importable_from_the_package() -> None:
    assert (melissa_dl.Client, melissa_dl.TrainingModule, melissa_dl.ShardedEmbedding, melissa_dl.RowAdagrad) == (
        Client,
        TrainingModule,
        ShardedEmbedding,
        RowAdagrad,
    )
    for name in melissa_dl.__all__:
        assert getattr(melissa_dl, name) is not None, name
    assert set(melissa_dl.__all__) <= set(dir(melissa_dl))


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="module 'melissa_dl' has no attribute 'Clinet'"):
        melissa_dl.Clinet  # noqa: B018


def test_a_simulation_importing_the_client_does_not_load_torch() -> None:
    check = "import sys; from melissa_dl import Client; assert 'torch' not in sys.modules, 'torch was loaded'"
    done = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
