"""Writing into the output folder: atomically, durably, and with a one-line verdict when the folder cannot take it.

A full disk, a quota, a read-only mount or lost permissions are not bugs of
the server and a restart cannot help: they get one line naming the path and
the errno, exit code 2 (the supervisor does not restart on it), and a write
that fails removes its temporary file. Everything the server writes for the
user (checkpoints, ``model.pt``, ``report.json``) goes through
``write_atomic``, so a reader never sees half a file under its final name;
what a killed server left half-written is removed at the next start
(``remove_temporaries``).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import tempfile
import threading
import zlib
from collections.abc import Callable, Sequence
from contextlib import suppress
from pathlib import Path
from typing import Any

import numpy as np

from melissa_dl.errors import ConfigError

# What a full or read-only output folder raises: these end the job with exit 2 and one line, not a traceback.
# EEXIST: a file where one of its folders goes.
UNWRITABLE = frozenset(
    {
        errno.ENOSPC,
        errno.EDQUOT,
        errno.EROFS,
        errno.EFBIG,
        errno.EACCES,
        errno.EPERM,
        errno.EISDIR,
        errno.ENOTDIR,
        errno.EEXIST,
    }
)
# The folders of <output_dir> the server writes into, checked with it at start.
OUTPUT_FOLDERS = ("logs", "simulations", "checkpoints", "tensorboard")
_PARALLEL_CHECKSUM = 16 << 20  # above this, the checksum runs in a thread while fsync waits

Chunks = Sequence[bytes | memoryview]  # one file's bytes, in pieces written one after the other


def fsync_dir(path: Path) -> None:
    """Make a rename or a creation in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | memoryview | Chunks) -> tuple[int, str]:
    """Write ``data`` (or its chunks in order) to ``path`` via a fsynced temporary file; returns (size, CRC-32).

    CRC-32 rather than a cryptographic hash: it catches torn and rotten files
    (what a checkpoint must detect) at 3x sha256's speed, which would
    otherwise bound the write. A large file's checksum runs in a thread while
    ``fsync`` waits for the disk (zlib releases the GIL): computing it during
    ``write`` would compete with the copy into the page cache for the cores.
    On failure the temporary file is removed and the error names ``path``.
    """
    chunks = [memoryview(c).cast("B") for c in ([data] if isinstance(data, (bytes, memoryview)) else data)]
    size = sum(chunk.nbytes for chunk in chunks)
    checksum: list[int] = []
    thread = None
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "wb") as handle:
            for chunk in chunks:
                handle.writelines(chunk[start : start + (1 << 30)] for start in range(0, chunk.nbytes, 1 << 30))
            handle.flush()
            if size >= _PARALLEL_CHECKSUM:
                thread = threading.Thread(target=lambda: checksum.append(_crc32(chunks)), name="checkpoint-crc")
                thread.start()
            else:
                checksum.append(_crc32(chunks))
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException as error:
        with suppress(OSError):
            temporary.unlink(missing_ok=True)
        if isinstance(error, OSError):  # name the file the caller asked for: write() names none, replace() two
            error.filename, error.filename2 = str(path), None
        raise
    finally:
        if thread is not None:
            thread.join()
    return size, f"{checksum[0]:08x}"


def _crc32(chunks: Sequence[memoryview]) -> int:
    value = 0
    for chunk in chunks:
        value = zlib.crc32(chunk, value)
    return value


def describe(error: OSError) -> str:
    """``cannot write PATH: ENOSPC (No space left on device)``."""
    name = errno.errorcode.get(error.errno or 0, f"errno {error.errno}")
    return f"cannot write {error.filename or 'into the output folder'}: {name} ({error.strerror})"


def unwritable(error: BaseException) -> str | None:
    """The one line to end the job with, if ``error`` (or its cause: the launcher's ``LogUnwritable``) is a full
    or read-only output folder."""
    advice = "; free space or fix the output folder, then run the same command to resume"
    for candidate in (error, error.__cause__):
        if isinstance(candidate, OSError) and candidate.errno in UNWRITABLE:
            return f"{describe(candidate)}{advice}"
    return None


def check_writable(output: Path) -> None:
    """At start (``--check`` too, creating nothing): ``output`` and its folders can take files, or one line why not.

    Each is probed where it would be created: the nearest folder that exists
    on its path gets a file without a name (``O_TMPFILE``), which vanishes
    even if the process is killed.
    """
    for folder in (output, *(output / name for name in OUTPUT_FOLDERS)):
        existing = next(path for path in (folder, *folder.parents) if path.exists())
        try:
            if not existing.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
            with tempfile.TemporaryFile(dir=existing) as probe:
                probe.write(b"melissa_dl\n")
                probe.flush()
        except OSError as error:
            error.filename = str(folder)
            raise ConfigError(f"output_dir: {describe(error)}") from None


def remove_temporaries(folder: Path) -> None:
    """Remove what ``write_atomic`` calls of a killed server left in ``folder`` (its caller holds the output lock)."""
    for temporary in folder.glob(".*.tmp"):
        with suppress(FileNotFoundError):
            temporary.unlink()


def solved_once(folder: Path | None, key: Any, compute: Callable[[], np.ndarray]) -> np.ndarray:
    """``compute()``, kept in ``folder`` under a name hashed from ``key`` (JSON) and read back by later calls.

    For held-out sets that take seconds to solve and that every run of a
    benchmark needs: the file is written whole or not at all, under a
    temporary name of its own, since runs sharing the folder may start
    together. ``folder`` None computes every time.
    """
    if folder is None:
        return compute()
    path = folder / f"solved-{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]}.npy"
    if path.is_file():
        return np.load(path)
    array = compute()
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=folder, suffix=".tmp", delete=False) as temporary:
        np.save(temporary, array)
    os.replace(temporary.name, path)
    return array
