"""melissa_dl: train neural models on simulations while they run.

The public API, imported from here: ``from melissa_dl import Client``. Each
name is loaded when first used, so that a simulation importing the client does
not pay for torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Block": "melissa_dl.wire.blocks",
    "Client": "melissa_dl.wire.client",
    "ClientError": "melissa_dl.errors",
    "HandshakeRefused": "melissa_dl.errors",
    "Prediction": "melissa_dl.wire.predictions",
    "Predictor": "melissa_dl.wire.client",
    "PredictionRefused": "melissa_dl.errors",
    "ServerUnreachable": "melissa_dl.errors",
    "TrainingModule": "melissa_dl.train.module",
    "Sample": "melissa_dl.buffers.sample",
    "ShardedEmbedding": "melissa_dl.embeddings.table",
    "SparseOptimizer": "melissa_dl.embeddings.sparse_optim",
    "SGD": "melissa_dl.embeddings.sparse_optim",
    "Adagrad": "melissa_dl.embeddings.sparse_optim",
    "RowAdagrad": "melissa_dl.embeddings.sparse_optim",
    "Adam": "melissa_dl.embeddings.sparse_optim",
    "make_sparse_optimizer": "melissa_dl.embeddings.sparse_optim",
    "load_model": "melissa_dl.serving.saved",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from melissa_dl.buffers.sample import Sample
    from melissa_dl.embeddings.sparse_optim import (
        SGD,
        Adagrad,
        Adam,
        RowAdagrad,
        SparseOptimizer,
        make_sparse_optimizer,
    )
    from melissa_dl.embeddings.table import ShardedEmbedding
    from melissa_dl.errors import ClientError, HandshakeRefused, PredictionRefused, ServerUnreachable
    from melissa_dl.serving.saved import load_model
    from melissa_dl.train.module import TrainingModule
    from melissa_dl.wire.blocks import Block
    from melissa_dl.wire.client import Client, Predictor
    from melissa_dl.wire.predictions import Prediction


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'melissa_dl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
