"""Embedding tables sharded across ranks and the sparse optimizers that update their rows."""
