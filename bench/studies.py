"""What the benches that run whole studies share: the server's command line and judging a model on held-out samples."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

ROOT = Path(__file__).resolve().parents[1]


def environment() -> dict[str, str]:
    """This environment, with the checkout importable by the server's ranks."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def mpirun() -> str:
    """The venv's ``mpirun`` (pip's mpich) if there is one, else the one on the PATH."""
    local = Path(sys.executable).parent / "mpirun"
    return str(local) if local.exists() else "mpirun"


def per_sample_errors(module: Any, model: Path, held_out: list[Any]) -> np.ndarray:
    """The final model's mean squared error on each held-out sample (in the module's normalised units)."""
    module.load_state_dict(torch.load(model, weights_only=True))
    module.eval()
    x, y = default_collate([module.process(s) for s in held_out])
    with torch.no_grad():
        return ((module(x) - y) ** 2).mean(dim=1).numpy()


def p99(errors: np.ndarray) -> float:
    return float(np.quantile(errors, 0.99))
