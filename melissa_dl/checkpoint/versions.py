"""Versioned, atomic on-disk checkpoints (docs/explanation/design.md#checkpoints).

Layout under ``root`` (``<output>/checkpoints/``)::

    LATEST                 name of the latest committed version ("v3")
    v3/manifest.json       format, K, batch, config digest, meta, every file's size and CRC-32,
                           and the CRC-32 of the manifest itself
    v3/rank0/<name>        the files of rank 0, ...

Why it is shaped like this:

* A crash can happen anywhere, so every file is written to a temporary name,
  fsynced, renamed and its folder fsynced; a reader never sees half a file
  under its final name.
* The commit point is the ``LATEST`` pointer, written last. Rank files and the
  manifest of an uncommitted version may exist; they are ignored (with a
  warning) and pruned by a later commit.
* Disks and copies still tear or rot files, so the manifest records a size and
  a CRC-32 per file and ``latest_valid`` falls back to an older version when
  one does not match. The manifest carries its own CRC-32 and is checked
  field by field before anything in it is used: an edited or torn manifest
  is one more damaged version, never a crash. ``keep`` versions are kept for that reason; older ones
  are deleted only after a newer one is committed.
* This module does no MPI: every rank calls ``write_rank_files``, the caller
  gathers the records on rank 0, which calls ``commit``.
* The files' bytes come from ``serialization.dumps``; the snapshot and its
  background writing from ``snapshots``.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
import zlib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from melissa_dl.errors import CheckpointCorrupt
from melissa_dl.runtime.files import Chunks, fsync_dir, write_atomic

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: the manifest checksums itself
MANIFEST = "manifest.json"
LATEST = "LATEST"
_VERSION_RE = re.compile(r"^v([1-9][0-9]*)$")
_FILE_RE = re.compile(r"^rank(0|[1-9][0-9]*)/[^./][^/]*$")
_CRC_RE = re.compile(r"^[0-9a-f]{8}$")
_CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class FileRecord:
    """One written file: ``path`` is relative to the version folder (``rank0/model.pt``)."""

    path: str
    size: int
    crc32: str  # 8 hex digits


def version_dir(root: Path, version: int) -> Path:
    return Path(root) / f"v{version}"


def write_rank_files(
    version_path: Path, rank: int, files: Mapping[str, bytes | memoryview | Chunks]
) -> list[FileRecord]:
    """Write one rank's files of a version atomically; the records go to rank 0 for ``commit``."""
    for name in files:
        if not name or "/" in name or name.startswith(".") or name != os.path.basename(name):
            raise ValueError(f"checkpoint file name {name!r} must be a plain name not starting with '.'")
    folder = Path(version_path) / f"rank{rank}"
    folder.mkdir(parents=True, exist_ok=True)
    records = []
    for name, data in files.items():
        size, digest = write_atomic(folder / name, data)
        records.append(FileRecord(f"rank{rank}/{name}", size, digest))
    fsync_dir(folder)
    fsync_dir(folder.parent)
    fsync_dir(folder.parent.parent)
    return records


def _version_numbers(root: Path) -> list[int]:
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _VERSION_RE.match(p.name)))


def _read_latest(root: Path) -> int | None:
    try:
        match = _VERSION_RE.match((root / LATEST).read_text().strip())
    except (OSError, UnicodeDecodeError):  # missing, a directory, unreadable: no pointer to trust
        return None
    return int(match.group(1)) if match else None


def next_version(root: Path) -> int:
    """One above every version folder and the pointer, so a torn folder is never reused."""
    root = Path(root)
    return max([0, *_version_numbers(root), _read_latest(root) or 0]) + 1


def commit(
    root: Path,
    version: int,
    records: Sequence[Sequence[FileRecord]],
    meta: Mapping[str, Any],
    *,
    batch: int,
    config_digest: str,
    keep: int = 3,
) -> Version:
    """Rank 0, after gathering every rank's records (``records[r]``): manifest, then ``LATEST``, then prune."""
    if keep < 1:
        raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
    root = Path(root)
    path = version_dir(root, version)
    manifest: dict[str, Any] = {
        "format": FORMAT_VERSION,
        "version": version,
        "ranks": len(records),
        "batch": batch,
        "config_digest": config_digest,
        "created": time.time(),
        "meta": dict(meta),
        "files": [asdict(record) for rank_records in records for record in rank_records],
    }
    manifest["crc32"] = _manifest_crc32(manifest)
    for rank, rank_records in enumerate(records):
        assert all(r.path.startswith(f"rank{rank}/") for r in rank_records), f"records of rank {rank} misplaced"
    write_atomic(path / MANIFEST, json.dumps(manifest, indent=1).encode())
    fsync_dir(path)
    if (root / LATEST).is_dir() and not (root / LATEST).is_symlink():  # a damaged pointer, skipped when resuming
        logger.warning("checkpoint pointer %s is a directory: replacing it", root / LATEST)
        shutil.rmtree(root / LATEST)
    write_atomic(root / LATEST, f"v{version}\n".encode())
    fsync_dir(root)
    logger.info(
        "checkpoint v%d committed (%d ranks, %d files, batch %d)", version, len(records), len(manifest["files"]), batch
    )
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


def _manifest_crc32(manifest: Mapping[str, Any]) -> str:
    """CRC-32 of the manifest without its own checksum, over a canonical JSON form (key order, spacing)."""
    body = {key: value for key, value in manifest.items() if key != "crc32"}
    return f"{zlib.crc32(json.dumps(body, sort_keys=True, separators=(',', ':')).encode()):08x}"


def _file_crc32(path: Path) -> str:
    value = 0
    chunk = bytearray(_CHUNK)
    with open(path, "rb", buffering=0) as handle:
        while n := handle.readinto(chunk):
            value = zlib.crc32(memoryview(chunk)[:n], value)
    return f"{value:08x}"


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
        return [f["path"][len(prefix) :] for f in self.manifest["files"] if f["path"].startswith(prefix)]

    def read(self, rank: int, name: str) -> bytearray:
        """A file's bytes, in writable memory: what ``loads`` makes of it can be used in place."""
        if name not in self.names(rank):
            raise KeyError(f"checkpoint v{self.number} has no file {name!r} for rank {rank}")
        path = self.path / f"rank{rank}" / name
        data = bytearray(path.stat().st_size)
        with open(path, "rb", buffering=0) as handle:
            view, done = memoryview(data), 0
            while done < len(data) and (n := handle.readinto(view[done:])):
                done += n
        return data


def _nothing_required(rank: int) -> Collection[str]:
    return ()


def verify(path: Path, required: Callable[[int], Collection[str]] = _nothing_required) -> Version:
    """Check a version folder's manifest and every file's size and CRC-32; ``CheckpointCorrupt`` says why not.

    ``required(rank)``: the names that rank's files must include.
    """
    path = Path(path)
    match = _VERSION_RE.match(path.name)
    if match is None:
        raise CheckpointCorrupt(f"{path} is not a version folder")
    manifest = _read_manifest(path)
    if manifest["version"] != int(match.group(1)):
        raise CheckpointCorrupt(f"checkpoint {path.name}: manifest names version {manifest['version']}")
    for record in manifest["files"]:
        file = path / record["path"]
        try:
            size = file.stat().st_size
            if size != record["size"]:
                raise CheckpointCorrupt(
                    f"checkpoint {path.name}: size mismatch of {record['path']} "
                    f"({size} bytes, manifest says {record['size']})"
                )
            if _file_crc32(file) != record["crc32"]:
                raise CheckpointCorrupt(f"checkpoint {path.name}: checksum mismatch of {record['path']}")
        except FileNotFoundError:
            raise CheckpointCorrupt(f"checkpoint {path.name}: missing file {record['path']}") from None
        except OSError as error:  # a bad disk block, a symlink loop, a folder: this version cannot be read
            raise CheckpointCorrupt(f"checkpoint {path.name}: cannot read {record['path']} ({error})") from None
    version = Version(int(match.group(1)), path, manifest)
    for rank in range(version.ranks):
        if missing := sorted(set(required(rank)) - set(version.names(rank))):
            raise CheckpointCorrupt(f"checkpoint {path.name}: no {', '.join(missing)} for rank {rank}")
    return version


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of a version folder, whole and well-formed; every field used later is checked here."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointCorrupt(f"checkpoint {path.name}: missing manifest") from None
    except (OSError, ValueError, RecursionError) as error:  # a directory, bad UTF-8, bad or too deep JSON
        raise CheckpointCorrupt(f"checkpoint {path.name}: unreadable manifest ({error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise CheckpointCorrupt(
            f"checkpoint {path.name}: unsupported manifest format {found!r} (this server reads format {FORMAT_VERSION})"
        )
    if manifest.get("crc32") != _manifest_crc32(manifest):
        raise CheckpointCorrupt(f"checkpoint {path.name}: manifest checksum mismatch (edited or torn)")
    fields = {"version": int, "ranks": int, "batch": int, "config_digest": str, "meta": dict, "files": list}
    for key, kind in fields.items():
        if not isinstance(manifest.get(key), kind) or isinstance(manifest[key], bool):
            raise CheckpointCorrupt(f"checkpoint {path.name}: manifest field {key!r} missing or not {kind.__name__}")
    ranks: set[int] = set()
    for record in manifest["files"]:
        if not (
            isinstance(record, dict)
            and isinstance(record.get("path"), str)
            and _FILE_RE.match(record["path"])
            and type(record.get("size")) is int
            and record["size"] >= 0
            and isinstance(record.get("crc32"), str)
            and _CRC_RE.match(record["crc32"])
        ):
            raise CheckpointCorrupt(f"checkpoint {path.name}: malformed file record {str(record)[:120]}")
        ranks.add(int(record["path"].split("/")[0][4:]))
    if not 1 <= manifest["ranks"] <= len(manifest["files"]) or ranks != set(range(manifest["ranks"])):
        raise CheckpointCorrupt(
            f"checkpoint {path.name}: manifest says {manifest['ranks']} ranks, its files are of ranks {sorted(ranks)}"
        )
    return manifest


def ever_committed(root: Path) -> bool:
    """A pointer or a manifest is there: some version was committed, even if none is intact now."""
    root = Path(root)
    return (root / LATEST).exists() or any((version_dir(root, n) / MANIFEST).exists() for n in _version_numbers(root))


def latest_valid(root: Path, required: Callable[[int], Collection[str]] = _nothing_required) -> Version | None:
    """The newest version that verifies (``verify``): ``LATEST`` first, then the other folders newest first."""
    root = Path(root)
    numbers = _version_numbers(root)
    latest = _read_latest(root)
    if latest is None and (root / LATEST).exists():
        logger.warning("checkpoint pointer %s is unreadable; trying every version", root / LATEST)
    if latest is not None and latest in numbers:
        try:
            version = verify(version_dir(root, latest), required)
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
            return verify(version_dir(root, number), required)
        except CheckpointCorrupt as error:
            logger.warning("%s; trying an older version", error)
    return None
