"""How a server tells the outside world (``melissa-launcher``, batch scripts) how it is doing."""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from melissa_dl.errors import ConfigError

EXIT_CONFIG = (
    2  # bad configuration, an output folder full or not writable, or nothing to resume from: a restart cannot help
)
EXIT_FAILED_SIMULATIONS = 3  # the study ran to its end, some simulations failed
EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal after a checkpoint; the same command resumes
HEARTBEAT = "heartbeat"  # file in the output folder that rank 0 touches at every bookkeeping round
STATUS = "status.json"  # rank 0's latest status, rewritten atomically (``melissa-server --status``)
HISTORY = "progress.jsonl"  # every status so far, one JSON per line (what the plots draw over time)
LOCK = "server.lock"  # in the output folder: held by the server working on it
SILENT = 10.0  # seconds without a heartbeat after which a server whose lock is free is taken for gone
FAILURE = "failure.json"  # in the output folder: the cause of the error that ended the server, for melissa-launcher
CAUSE_CHARS = 500  # a cause's message is cut to this


def lock_output(output: Path) -> IO[str]:
    """Refuse a second server on the same output folder (the lock dies with the process, even on kill -9)."""
    output.mkdir(parents=True, exist_ok=True)
    handle = open(output / LOCK, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        raise ConfigError(
            f"output_dir: another melissa-server (pid {handle.read().strip() or '?'}) is running on {output}"
        ) from None
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


def server_gone(output: Path) -> bool:
    """Whether no server works on ``output`` any more: its lock is free and its heartbeat silent for
    :data:`SILENT` seconds (the lock alone could be another node's, on a file system that keeps locks per node)."""
    try:
        with open(output / LOCK) as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when closed
        beat = (output / HEARTBEAT).stat().st_mtime
    except BlockingIOError:  # held: a server runs
        return False
    except FileNotFoundError:  # never locked, or no heartbeat yet
        return True
    return time.time() - beat > SILENT


def read_history(path: Path) -> list[dict[str, Any]]:
    """Every status in ``path``, but a last line torn by a server killed while appending it."""
    history = []
    for line in path.read_text().splitlines():
        try:
            history.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return history


def runs(history: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """The statuses of a history (``progress.jsonl``) by server run, in order: a restart starts its clock again,
    so a status whose run began (``updated - elapsed_s``) over a second after the one before's is a new run's."""
    grouped: list[list[dict[str, Any]]] = []
    for status in history:
        began = status["updated"] - status["elapsed_s"]
        if not grouped or began - (grouped[-1][-1]["updated"] - grouped[-1][-1]["elapsed_s"]) > 1.0:
            grouped.append([])
        grouped[-1].append(status)
    return grouped


def record_failure(output: Path, error: BaseException, trace: TracebackType | None) -> None:
    """Write the cause of the error that ends the server, in one line (type, message, and the line that raised it),
    into :data:`FAILURE`: how ``melissa-launcher`` tells a server that fails the same way at every restart. Whole
    or not at all, under a temporary name of its own, since several ranks may fail at once."""
    message = " ".join("".join(traceback.format_exception_only(type(error), error)).split())[:CAUSE_CHARS]
    frames = traceback.extract_tb(trace)
    where = f" ({frames[-1].filename}:{frames[-1].lineno}, in {frames[-1].name})" if frames else ""
    with tempfile.NamedTemporaryFile("w", dir=output, prefix=f".{FAILURE}.", suffix=".tmp", delete=False) as handle:
        json.dump({"cause": message + where}, handle)
    os.replace(handle.name, output / FAILURE)


def read_failure(output: Path) -> str | None:
    """The cause that :func:`record_failure` wrote, if a whole record is there."""
    try:
        cause = json.loads((output / FAILURE).read_text())["cause"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return cause if isinstance(cause, str) else None
