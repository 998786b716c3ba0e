"""Logging with the MPI rank in every line, to stderr and to a per-rank file."""
from __future__ import annotations

import logging
import sys
from pathlib import Path

FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"


def setup_logging(rank: int, log_dir: Path | None = None, level: int = logging.INFO) -> None:
    """Configure the root logger once per process."""
    formatter = logging.Formatter(FORMAT.format(rank=rank), datefmt="%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(logging.FileHandler(log_dir / f"rank{rank}.log"))
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(level)
