"""Versioned, atomic on-disk checkpoints (DESIGN.md §7).

Layout under ``root`` (``<output>/checkpoints/``)::

    LATEST                 name of the latest committed version ("v3")
    v3/manifest.json       format, K, batch, config digest, meta, every file's size and sha256
    v3/rank0/<name>        the files of rank 0, ...

Why it is shaped like this:

* A crash can happen anywhere, so every file is written to a temporary name,
  fsynced, renamed and its folder fsynced; a reader never sees half a file
  under its final name.
* The commit point is the ``LATEST`` pointer, written last. Rank files and the
  manifest of an uncommitted version may exist; they are ignored (with a
  warning) and pruned by a later commit.
* Disks and copies still tear or rot files, so the manifest records a size and
  a sha256 per file and ``latest_valid`` falls back to an older version when
  one does not match. ``keep`` versions are kept for that reason; older ones
  are deleted only after a newer one is committed.
* This module does no MPI: every rank calls ``write_rank_files``, the caller
  gathers the records on rank 0, which calls ``commit``.

Serialisation rule (``dumps``/``loads``): everything goes through
``torch.save`` with cloudpickle as its pickler. Tensors are stored as torch
storages, anything else (buffers of numpy arrays, lambdas, local classes) is
cloudpickled; loading needs ``weights_only=False``, so only load checkpoints
you wrote.
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import cloudpickle
import torch

from melissa_dl.errors import MelissaError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
LATEST = "LATEST"
_VERSION_RE = re.compile(r"^v([1-9][0-9]*)$")
_CHUNK = 8 << 20
_PARALLEL_HASH = 16 << 20  # above this, hash in a thread while fsync waits


class CheckpointCorrupt(MelissaError, RuntimeError):
    """A version on disk is torn or damaged; the message says which and why."""


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One written file: ``path`` is relative to the version folder (``rank0/model.pt``)."""

    path: str
    size: int
    sha256: str


def dumps(obj: Any) -> bytes:
    """Serialise any state: tensors as torch storages, the rest cloudpickled (see module doc)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_module=cloudpickle, pickle_protocol=5)
    return buffer.getvalue()


def loads(data: bytes | memoryview, map_location: Any = "cpu") -> Any:
    """Inverse of ``dumps``; tensors land on the CPU unless told otherwise (restarts may change devices)."""
    return torch.load(io.BytesIO(data), map_location=map_location, weights_only=False)


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version}"


def _fsync_dir(path: Path) -> None:
    """Make a rename or a creation in ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes | memoryview) -> tuple[int, str]:
    """Write ``data`` to ``path`` via a fsynced temporary file; returns (size, sha256).

    A large file is hashed in a thread while ``fsync`` waits for the disk
    (hashlib releases the GIL): hashing during ``write`` would compete with its
    copy into the page cache for the same cores.
    """
    view = memoryview(data).cast("B")
    hasher = hashlib.sha256()
    thread = None
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "wb") as handle:
            for start in range(0, view.nbytes, 1 << 30):
                handle.write(view[start:start + (1 << 30)])
            handle.flush()
            if view.nbytes >= _PARALLEL_HASH:
                thread = threading.Thread(target=hasher.update, args=(view,), name="checkpoint-hash")
                thread.start()
            else:
                hasher.update(view)
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    finally:
        if thread is not None:
            thread.join()
    return view.nbytes, hasher.hexdigest()


def write_rank_files(version_path: Path, rank: int, files: Mapping[str, bytes | memoryview]) -> list[FileRecord]:
    """Write one rank's files of a version atomically; the records go to rank 0 for ``commit``."""
    for name in files:
        if not name or "/" in name or name.startswith(".") or name != os.path.basename(name):
            raise ValueError(f"checkpoint file name {name!r} must be a plain name not starting with '.'")
    folder = Path(version_path) / f"rank{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for name, data in files.items():
        size, digest = _write_atomic(folder / name, data)
        records.append(FileRecord(f"rank{rank}/{name}", size, digest))
    _fsync_dir(folder)
    _fsync_dir(folder.parent)
    _fsync_dir(folder.parent.parent)
    return records


def _version_numbers(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _VERSION_RE.match(p.name)))


def _read_latest(root: Path) -> int | None:
    try:
        match = _VERSION_RE.match((root / LATEST).read_text().strip())
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return int(match.group(1)) if match else None


def next_version(root: Path) -> int:
    """One above every version folder and the pointer, so a torn folder is never reused."""
    root = Path(root)
    return max([0, *_version_numbers(root), _read_latest(root) or 0]) + 1


def commit(root: Path, version: int, records: Sequence[Sequence[FileRecord]], meta: Mapping[str, Any], *,
           batch: int, config_digest: str, keep: int = 3) -> Version:
    """Rank 0, after gathering every rank's records (``records[r]``): manifest, then ``LATEST``, then prune."""
    if keep < 1:
        raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
    root = Path(root)
    path = version_dir(root, version)
    manifest = {
        "format": FORMAT_VERSION,
        "version": version,
        "ranks": len(records),
        "batch": batch,
        "config_digest": config_digest,
        "created": time.time(),
        "meta": dict(meta),
        "files": [asdict(record) for rank_records in records for record in rank_records],
    }
    for rank, rank_records in enumerate(records):
        assert all(r.path.startswith(f"rank{rank}/") for r in rank_records), f"records of rank {rank} misplaced"
    _write_atomic(path / MANIFEST, json.dumps(manifest, indent=1).encode())
    _fsync_dir(path)
    _write_atomic(root / LATEST, f"v{version}\n".encode())
    _fsync_dir(root)
    logger.info("checkpoint v%d committed (%d ranks, %d files, batch %d)",
                version, len(records), len(manifest["files"]), batch)
    _prune(root, version, keep)
    return Version(version, path, manifest)


def _prune(root: Path, committed: int, keep: int) -> None:
    """Keep the ``keep`` newest manifested versions up to ``committed``; delete older and torn ones below it."""
    kept = 0
    for number in reversed(_version_numbers(root)):
        if number > committed:
            continue
        path = version_dir(root, number)
        if number == committed or (kept < keep and (path / MANIFEST).is_file()):
            kept += 1
            continue
        shutil.rmtree(path, ignore_errors=True)
        logger.info("checkpoint v%d pruned", number)


def _sha256_file(path: Path) -> str:
    hasher = hashlib.sha256()
    chunk = bytearray(_CHUNK)
    with open(path, "rb", buffering=0) as handle:
        while n := handle.readinto(chunk):
            hasher.update(memoryview(chunk)[:n])
    return hasher.hexdigest()


@dataclass(frozen=True)
class Version:
    """A verified checkpoint version."""

    number: int
    path: Path
    manifest: dict[str, Any]

    @property
    def ranks(self) -> int:
        return int(self.manifest["ranks"])

    @property
    def meta(self) -> dict[str, Any]:
        return self.manifest["meta"]

    def names(self, rank: int) -> list[str]:
        prefix = f"rank{rank}/"
        return [f["path"][len(prefix):] for f in self.manifest["files"] if f["path"].startswith(prefix)]

    def read(self, rank: int, name: str) -> bytes:
        if name not in self.names(rank):
            raise KeyError(f"checkpoint v{self.number} has no file {name!r} for rank {rank}")
        return (self.path / f"rank{rank}" / name).read_bytes()


def verify(path: Path) -> Version:
    """Check a version folder's manifest and every file's size and sha256; ``CheckpointCorrupt`` says why not."""
    path = Path(path)
    match = _VERSION_RE.match(path.name)
    if match is None:
        raise CheckpointCorrupt(f"{path} is not a version folder")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointCorrupt(f"checkpoint {path.name}: missing manifest") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointCorrupt(f"checkpoint {path.name}: unreadable manifest JSON ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION \
            or not isinstance(manifest.get("files"), list) or not isinstance(manifest.get("meta"), dict):
        raise CheckpointCorrupt(f"checkpoint {path.name}: unsupported or malformed manifest")
    if manifest.get("version") != int(match.group(1)):
        raise CheckpointCorrupt(f"checkpoint {path.name}: manifest names version {manifest.get('version')}")
    for record in manifest["files"]:
        file = path / record["path"]
        try:
            size = file.stat().st_size
        except FileNotFoundError:
            raise CheckpointCorrupt(f"checkpoint {path.name}: missing file {record['path']}") from None
        if size != record["size"]:
            raise CheckpointCorrupt(f"checkpoint {path.name}: size mismatch of {record['path']} "
                                    f"({size} bytes, manifest says {record['size']})")
        if _sha256_file(file) != record["sha256"]:
            raise CheckpointCorrupt(f"checkpoint {path.name}: checksum mismatch of {record['path']}")
    return Version(int(match.group(1)), path, manifest)


def latest_valid(root: Path) -> Version | None:
    """The newest version that verifies: ``LATEST`` first, then the other folders newest first."""
    root = Path(root)
    numbers = _version_numbers(root)
    latest = _read_latest(root)
    if latest is None and (root / LATEST).exists():
        logger.warning("checkpoint pointer %s is unreadable; trying every version", root / LATEST)
    if latest is not None and latest in numbers:
        try:
            version = verify(version_dir(root, latest))
        except CheckpointCorrupt as error:
            logger.warning("%s; trying the other versions", error)
        else:
            for number in (n for n in numbers if n > latest):
                logger.warning("checkpoint v%d skipped: newer than %s (v%d), never committed", number, LATEST, latest)
            return version
    elif latest is not None:
        logger.warning("checkpoint v%d named by %s is missing; trying the other versions", latest, LATEST)
    for number in reversed(numbers):
        if number == latest:
            continue
        try:
            return verify(version_dir(root, number))
        except CheckpointCorrupt as error:
            logger.warning("%s; trying an older version", error)
    return None


_STOP = object()


class BackgroundWriter:
    """Runs checkpoint-writing jobs in one thread, so that training only pays for the in-memory snapshot.

    Jobs run one at a time, in order. A job's exception is kept and raised
    in the caller by the next ``submit``, ``wait`` or ``close``.
    ``submit`` blocks while ``max_pending`` jobs already wait, which bounds
    the snapshots held in memory.
    """

    def __init__(self, max_pending: int = 1) -> None:
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_pending)
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is _STOP:
                    return
                job()
            except BaseException as error:  # handed to the caller by _raise
                with self._lock:
                    if self._error is None:
                        self._error = error
            finally:
                self._queue.task_done()

    def _raise(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    @property
    def busy(self) -> bool:
        """True while a job runs or waits (a caller may skip a checkpoint rather than stall)."""
        return self._queue.unfinished_tasks > 0

    def submit(self, job: Callable[[], Any]) -> None:
        self._raise()
        if self._closed:
            raise RuntimeError("BackgroundWriter.submit after close")
        self._queue.put(job)

    def wait(self) -> None:
        """Block until every submitted job has finished."""
        self._queue.join()
        self._raise()

    def close(self) -> None:
        """Finish the submitted jobs and join the thread."""
        if not self._closed:
            self._closed = True
            self._queue.put(_STOP)
            self._thread.join()
        self._raise()

    def __enter__(self) -> BackgroundWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
