"""melissa_dl: train neural models on simulations while they run.

The public API, imported from here: ``from melissa_dl import Client``. Each
name is loaded when first used, so that a simulation importing the client does
not pay for torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Client": "melissa_dl.client",
    "ClientError": "melissa_dl.errors",
    "HandshakeRefused": "melissa_dl.errors",
    "ServerUnreachable": "melissa_dl.errors",
    "TrainingModule": "melissa_dl.module",
    "Sample": "melissa_dl.sample",
    "ShardedEmbedding": "melissa_dl.embedding",
    "SparseOptimizer": "melissa_dl.sparse_optim",
    "SGD": "melissa_dl.sparse_optim",
    "Adagrad": "melissa_dl.sparse_optim",
    "RowAdagrad": "melissa_dl.sparse_optim",
    "Adam": "melissa_dl.sparse_optim",
    "make_sparse_optimizer": "melissa_dl.sparse_optim",
}
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from melissa_dl.client import Client
    from melissa_dl.embedding import ShardedEmbedding
    from melissa_dl.errors import ClientError, HandshakeRefused, ServerUnreachable
    from melissa_dl.module import TrainingModule
    from melissa_dl.sample import Sample
    from melissa_dl.sparse_optim import SGD, Adagrad, Adam, RowAdagrad, SparseOptimizer, make_sparse_optimizer


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'melissa_dl' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
