"""What a checkpoint of a running server holds, and how a server resumes from one
(docs/explanation/design.md#checkpoints).

A checkpoint is a list of named parts (``Part``), each an object that speaks
``state_dict()``/``load_state_dict()`` (``Stateful``); the checkpointer knows
nothing else of them. Files of one version (stored by ``versions.py``)::

    rank<r>/stream.pt    the rank's buffer and ledger, taken together (``Receiver``), and its
                         refusal and duplicate counts
    rank<r>/trainer.pt   its embedding shards with row ranges and optimizer state, RNG states, counters (``Trainer``)
    rank0/dense.pt       the dense module and its optimizer over whole parameters (``Trainer.dense``)
    rank0/study.pt       every simulation's state, attempts and failures; the hellos refused
    rank0/config.json    the resolved configuration

Why it works this way:

* Every rank snapshots at the same batch, right after a lockstep step, when
  no rank holds a formed batch, or at a stop, whose unmatched batches go back
  to the buffers (``loop.py`` decides when): each step a ledger holds is
  then in the model or in a buffer, so a resumed run loses none and trains
  none twice as new. Steps received after the
  snapshot are in no ledger and arrive again from the relaunched simulations.
* Training barely pauses: a part's state may mark values ``Live``, whose
  copies (``snapshots.BackgroundCopies``) are still under way when the
  snapshot goes to the writer: the trainer's tensors are copied while the
  next batch's forward and backward run; serialising and writing run in a
  background thread.
* MPI stays in the main thread: what a rank has written reaches rank 0 in the
  next bookkeeping round (``sync``), and rank 0 commits the newest version
  every rank has written, in another thread.
* A restart on another number of ranks K re-shards: each per-rank part loads
  itself from the old ranks' files (``Reshardable``): the trainer takes its
  new rows of every table from the old shards that overlap them, the receiver
  rebuilds its ledger from all old ledgers keeping the steps the new routing
  sends it, and takes an equal share of the old buffered samples.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from melissa_dl.checkpoint.serialization import dumps, loads
from melissa_dl.checkpoint.snapshots import BackgroundCopies, BackgroundWriter, release, settled
from melissa_dl.checkpoint.versions import (
    FileRecord,
    Version,
    commit,
    ever_committed,
    latest_valid,
    version_dir,
    write_rank_files,
)
from melissa_dl.config.sections import Config, unread_kind_sections
from melissa_dl.errors import CheckpointCorrupt, ConfigError
from melissa_dl.runtime.mpi import Comm
from melissa_dl.runtime.status import HISTORY, STATUS

logger = logging.getLogger(__name__)

# Keys a resumed run must share with the checkpoint: they define the samples, their routing and the model.
FIXED_KEYS = (
    "study",
    "buffer.kind",
    "server.bind_simulation_to_server_rank",
    "training.module",
    "training.class_name",
    "training.options",
    "training.window",
)

# The parts a server checkpoints (file ``<name>.pt``): on every rank, and written by rank 0 only.
STREAM, TRAINER = "stream", "trainer"
DENSE, STUDY = "dense", "study"


class Stateful(Protocol):
    """What a part of a checkpoint speaks, as torch modules and optimizers do."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass(frozen=True)
class OldRanks:
    """One part of a checkpoint written by another number of ranks, for the part to re-shard itself from."""

    size: int  # the ranks that wrote it
    meta: dict[str, Any]  # the checkpoint's: "samples", a list of the samples each old rank had trained
    read: Callable[[int], Any]  # old rank -> its state of this part


@runtime_checkable
class Reshardable(Stateful, Protocol):
    """A part held by every rank, which can load itself from a checkpoint of another number of ranks."""

    def load_resharded(self, old: OldRanks) -> None: ...


@dataclass(frozen=True)
class Part:
    """One named part of a checkpoint: the file ``rank<r>/<name>.pt``.

    ``shared``: one for every rank that holds it (or held by rank 0 alone),
    so rank 0 writes it and every holder reads that copy. Every holder still
    takes its ``state_dict`` (a sharded one is gathered: a collective), which
    may return None off rank 0.
    """

    name: str
    state: Stateful
    shared: bool = False


class Group:
    """Several stateful objects saved as one part, each under its name."""

    def __init__(self, **members: Stateful) -> None:
        self.members = members

    def state_dict(self) -> dict[str, Any]:
        return {name: member.state_dict() for name, member in self.members.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, member in self.members.items():
            member.load_state_dict(state[name])


class Checkpointer:
    """One rank's side of the periodic checkpoints of ``parts``; ``snapshot``, ``sync`` and ``final`` are
    called on every rank."""

    def __init__(
        self, config: Config, comm: Comm, parts: Sequence[Part], first_version: int, copies: BackgroundCopies
    ) -> None:
        assert config.training is not None
        self.root = checkpoint_root(config)
        self.comm = comm
        self.rank = comm.Get_rank()
        self.parts = parts
        self.copies = copies
        self.keep = config.checkpoint.keep
        self.digest = config.digest()
        self.module_digest = module_digest(config) if self.rank == 0 else ""
        self.complete = False  # set by ``final`` when the study ended: a rerun then has nothing to do
        self.config_json = json.dumps(config.to_dict(), indent=2).encode()
        self.next_version = first_version
        self._writer = BackgroundWriter()
        self._committer = BackgroundWriter(max_pending=8) if self.rank == 0 else None
        self._written: dict[int, tuple[int, int, list[FileRecord]]] = {}  # version -> batch, samples, records
        self._lock = threading.Lock()

    def snapshot(self, batch: int, samples: int) -> None:
        """Take this rank's parts now, after ``batch`` batches and ``samples`` samples trained here, and write
        them in the background (every rank, at the same batch)."""
        version, self.next_version = self.next_version, self.next_version + 1
        states = {part.name: self.copies.start(part.name, part.state.state_dict()) for part in self.parts}
        states = {part.name: states[part.name] for part in self.parts if self.rank == 0 or not part.shared}
        self._writer.submit(lambda: self._write(version, batch, samples, states))

    def _write(self, version: int, batch: int, samples: int, states: dict[str, Any]) -> None:
        data: dict[str, Any] = {f"{name}.pt": dumps(settled(state)) for name, state in states.items()}
        if self.rank == 0:
            data["config.json"] = self.config_json
        records = write_rank_files(version_dir(self.root, version), self.rank, data)
        for state in states.values():
            release(state)  # written: a later snapshot may copy into this memory
        with self._lock:
            self._written[version] = (batch, samples, records)

    def sync(self) -> None:
        """Collective: rank 0 commits the newest version that every rank has finished writing."""
        with self._lock:
            written = dict(self._written)
        everyone = self.comm.gather(written)
        chosen = None
        if self.rank == 0:
            assert self._committer is not None and everyone is not None
            common = set(written).intersection(*everyone)
            if common:
                chosen = version = max(common)
                batch = written[version][0]
                meta = {
                    "samples": [w[version][1] for w in everyone],
                    "module_digest": self.module_digest,
                    "complete": self.complete,
                }
                records = [w[version][2] for w in everyone]
                self._committer.submit(
                    lambda: commit(
                        self.root, version, records, meta, batch=batch, config_digest=self.digest, keep=self.keep
                    )
                )
        chosen = self.comm.bcast(chosen)
        if chosen is not None:
            with self._lock:
                self._written = {v: w for v, w in self._written.items() if v > chosen}

    def final(self, complete: bool) -> None:
        """Collective, when training ends or stops: commit what was snapshot last, before this returns.

        ``complete``: the study is over, and the last snapshot holds its end.
        """
        self.complete = complete
        self._writer.close()
        self.sync()
        if self._committer is not None:
            self._committer.close()


def checkpoint_root(config: Config) -> Path:
    return config.output_path / "checkpoints"


def start_fresh(config: Config) -> None:
    """``--fresh``: forget the checkpoints, curves and progress history of an earlier run of this output folder."""
    for folder in (checkpoint_root(config), config.output_path / "tensorboard"):
        if folder.exists():
            logger.warning("--fresh: deleting %s", folder)
            shutil.rmtree(folder)
    for name in (HISTORY, STATUS):
        (config.output_path / name).unlink(missing_ok=True)


def find_checkpoint(config: Config) -> Version | None:
    """Rank 0: the version to resume from, or None for a first run; errors say why resuming is impossible."""
    root = checkpoint_root(config)
    if not root.is_dir():
        return None
    version = latest_valid(root, _files_of)
    if version is None:
        if ever_committed(root):
            raise CheckpointCorrupt(
                f"no checkpoint in {root} is intact (see the warnings above); run with --fresh to start over"
            )
        logger.warning("%s holds no committed checkpoint: starting from scratch", root)
        return None
    saved = json.loads(version.read(0, "config.json"))
    for key in unread_kind_sections(config):  # a section this study does not read: no change of it matters
        section, _, kind = key.partition(".")
        saved.get(section, {}).pop(kind, None)
    for key, (old, new) in _changed_keys(saved, config.to_dict()).items():
        if key.startswith(FIXED_KEYS):
            raise ConfigError(
                f"{key}: changed since checkpoint {version.path} ({json.dumps(old)} -> "
                f"{json.dumps(new)}); restore it or run with --fresh to start over"
            )
        logger.warning("resuming with %s changed: %s -> %s", key, json.dumps(old), json.dumps(new))
    saved_digest, digest = version.meta.get("module_digest"), module_digest(config)
    if saved_digest != digest:
        assert config.training is not None
        raise ConfigError(
            f"training.module: {config.training.module} changed since checkpoint {version.path} "
            f"(sha256 {str(saved_digest)[:12]} -> {digest[:12]}): its weights may not fit the new code; "
            "restore the file or run with --fresh to start over"
        )
    logger.info(
        "resuming from checkpoint %s (batch %d, written by %d ranks)",
        version.path,
        version.manifest["batch"],
        version.ranks,
    )
    return version


def _files_of(rank: int) -> tuple[str, ...]:
    """The files a server's ``Checkpointer`` writes for ``rank``: a version without one of them cannot be resumed."""
    names = (STREAM, TRAINER, *((DENSE, STUDY) if rank == 0 else ()))
    return (*(f"{name}.pt" for name in names), *(("config.json",) if rank == 0 else ()))


def module_digest(config: Config) -> str:
    """SHA-256 of the training module's source: a checkpoint's weights belong to the code that made them."""
    assert config.training is not None
    return hashlib.sha256((config.base_dir / config.training.module).read_bytes()).hexdigest()


def _changed_keys(old: Any, new: Any, path: str = "") -> dict[str, tuple[Any, Any]]:
    if isinstance(old, dict) and isinstance(new, dict):
        changes: dict[str, tuple[Any, Any]] = {}
        for key in sorted(set(old) | set(new)):
            changes.update(_changed_keys(old.get(key), new.get(key), f"{path}.{key}" if path else key))
        return changes
    return {} if old == new else {path: (old, new)}


def restore(version: Version, parts: Sequence[Part], rank: int, size: int) -> None:
    """Load each part from ``version``: a shared one from rank 0's copy, one per rank from this rank's file,
    or re-sharded from every old rank's file when ``version`` was written by another number of ranks."""
    for part in parts:
        read = functools.partial(_read_part, version, f"{part.name}.pt")
        if part.shared or version.ranks == size:
            part.state.load_state_dict(read(0 if part.shared else rank))
        else:
            assert isinstance(part.state, Reshardable), part.name
            part.state.load_resharded(OldRanks(version.ranks, version.meta, read))


def _read_part(version: Version, name: str, rank: int) -> Any:
    return loads(version.read(rank, name))
