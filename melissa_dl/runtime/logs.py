"""Logging with the MPI rank in every line, to stderr and to a per-rank file.

Only the project's own loggers (``melissa_dl``, ``launcher``) speak at INFO:
a training module's libraries would otherwise fill the log with their INFO
lines. Other loggers pass WARNING and above, unless ``server.log_level``
names them.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from pathlib import Path

FORMAT = "%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"
OWN = ("melissa_dl", "launcher")  # the loggers of this project


def setup_logging(rank: int, log_dir: Path | None = None, levels: str | Mapping[str, str] = "INFO") -> None:
    """Configure logging once per process. ``levels``: the level of the project's own loggers, or a level per
    logger name (the project's own default to INFO, any other logger named gets its level)."""
    formatter = logging.Formatter(FORMAT.format(rank=rank), datefmt="%H:%M:%S")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        handlers.append(_LogFile(log_dir / f"rank{rank}.log"))
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        handler.setFormatter(formatter)
        root.addHandler(handler)
    root.setLevel(logging.WARNING)
    named = {name: levels for name in OWN} if isinstance(levels, str) else {**dict.fromkeys(OWN, "INFO"), **levels}
    for name, level in named.items():
        logging.getLogger(name).setLevel(level)


class _LogFile(logging.FileHandler):
    """A log file that gives up, saying so once on stderr, when its folder fills up: stderr still has every line.

    (The default prints a traceback for every record it fails to write.)
    """

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
        elif not self.failed:
            self.failed = True
            sys.stderr.write(f"melissa_dl: log file {self.baseFilename}: {error}; logging to stderr only\n")
