"""What a checkpoint of a running server holds, and how a server resumes from one (DESIGN §7).

Files of one version (stored by ``checkpoint.py``)::

    rank<r>/stream.pt    the rank's buffer and ledger, taken together (``Receiver.state_dict``), and its
                         refusal and duplicate counts
    rank<r>/trainer.pt   its embedding shards with row ranges and optimizer state, RNG states, counters
    rank0/dense.pt       the dense module and its optimizer (identical on every rank)
    rank0/study.pt       every simulation's state, attempts and failures; the hellos refused
    rank0/config.json    the resolved configuration

Why it works this way:

* Every rank snapshots at the same batch, right after a lockstep step, when
  no rank holds a formed batch: each step a ledger holds is then either in
  the model or in a buffer, so a resumed run loses none and trains none twice
  as new. Steps received after the snapshot are in no ledger and arrive
  again from the relaunched simulations.
* Training barely pauses: the tensors are copied by a thread while the next
  batch's forward and backward run (``Trainer.state_dict``), into the memory of
  the last written snapshot, and serialising and writing run in a
  background thread.
* MPI stays in the main thread: what a rank has written reaches rank 0 in the
  next bookkeeping round (``sync``), and rank 0 commits the newest version
  every rank has written, in another thread.
* A restart on another number of ranks K re-shards: each rank takes its new
  rows of every table from the old shards that overlap them, rebuilds its
  ledger from all old ledgers keeping the steps the new routing sends it, and
  takes an equal share of the old buffered samples.
"""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from melissa_dl.buffers import Buffer
from melissa_dl.checkpoint import (
    FileRecord,
    Version,
    commit,
    ever_committed,
    latest_valid,
    version_dir,
    write_rank_files,
)
from melissa_dl.config import Config
from melissa_dl.embedding import shard_range
from melissa_dl.errors import CheckpointCorrupt, ConfigError
from melissa_dl.ledger import Ledger
from melissa_dl.mpi import Comm
from melissa_dl.protocol import owner_rank
from melissa_dl.receiver import Receiver
from melissa_dl.report import merge_rejections
from melissa_dl.serialization import dumps, loads
from melissa_dl.snapshots import BackgroundWriter

if TYPE_CHECKING:
    from melissa_dl.training import Trainer

logger = logging.getLogger(__name__)

# Keys a resumed run must share with the checkpoint: they define the samples, their routing and the model.
FIXED_KEYS = ("study", "buffer.kind", "server.bind_simulation_to_server_rank",
              "training.module", "training.class_name", "training.options")


class Checkpointer:
    """One rank's side of the periodic checkpoints; ``snapshot``, ``sync`` and ``final`` are called on every rank."""

    def __init__(self, config: Config, comm: Comm, trainer: Trainer, receiver: Receiver,
                 study_state: Callable[[], dict[str, Any]] | None, first_version: int) -> None:
        assert config.training is not None
        self.root = checkpoint_root(config)
        self.comm = comm
        self.rank = comm.Get_rank()
        self.trainer = trainer
        self.receiver = receiver
        self.study_state = study_state
        self.keep = config.training.keep_checkpoints
        self.digest = config.digest()
        self.module_digest = module_digest(config) if self.rank == 0 else ""
        self.complete = False  # set by ``final`` when the study ended: a rerun then has nothing to do
        self.config_json = json.dumps(config.to_dict(), indent=2).encode()
        self.next_version = first_version
        self._writer = BackgroundWriter()
        self._committer = BackgroundWriter(max_pending=8) if self.rank == 0 else None
        self._written: dict[int, tuple[int, int, list[FileRecord]]] = {}  # version -> batch, samples, records
        self._lock = threading.Lock()
        self._arena: Any = None  # tensors of the last written snapshot, reused by the next one

    def snapshot(self) -> None:
        """Take this rank's state now and write it in the background (every rank, at the same batch)."""
        version, self.next_version = self.next_version, self.next_version + 1
        batch = self.trainer.summary.batches
        with self._lock:
            arena, self._arena = self._arena, None
        state = self.trainer.state_dict(into=arena)
        stream = self.receiver.state_dict()
        study = self.study_state() if self.study_state is not None else None
        self._writer.submit(lambda: self._write(version, batch, state, stream, study))

    def _write(self, version: int, batch: int, state: dict[str, Any], stream: dict[str, Any],
               study: dict[str, Any] | None) -> None:
        copied = state["copied"].wait()
        files = {
            "stream.pt": stream,
            "trainer.pt": {"tables": copied["tables"], "rng": state["rng"], "summary": state["summary"]},
        }
        if self.rank == 0:
            module = {**copied["parameters"], **state["buffers"]}
            files["dense.pt"] = {"module": module, "optimizer": copied["optimizer"]}
            files["study.pt"] = study
        data: dict[str, Any] = {name: dumps(obj) for name, obj in files.items()}
        if self.rank == 0:
            data["config.json"] = self.config_json
        records = write_rank_files(version_dir(self.root, version), self.rank, data)
        with self._lock:
            self._written[version] = (batch, state["summary"].samples, records)
            self._arena = copied  # written: the next snapshot may copy into this memory

    def sync(self) -> None:
        """Collective: rank 0 commits the newest version that every rank has finished writing."""
        with self._lock:
            written = dict(self._written)
        everyone = self.comm.gather(written)
        chosen = None
        if self.rank == 0:
            assert self._committer is not None
            common = set(written).intersection(*everyone)
            if common:
                chosen = max(common)
                batch = written[chosen][0]
                meta = {"samples": [w[chosen][1] for w in everyone], "module_digest": self.module_digest,
                        "complete": self.complete}
                records = [w[chosen][2] for w in everyone]
                self._committer.submit(lambda: commit(self.root, chosen, records, meta, batch=batch,
                                                      config_digest=self.digest, keep=self.keep))
        chosen = self.comm.bcast(chosen)
        if chosen is not None:
            with self._lock:
                self._written = {v: w for v, w in self._written.items() if v > chosen}

    def final(self, snapshot: bool = True, complete: bool = False) -> None:
        """Collective, when training ends or stops: a last checkpoint, committed before this returns.

        ``complete``: the study is over, and this checkpoint holds its end.
        """
        if snapshot:
            self.snapshot()
        self.complete = complete
        self._writer.close()
        self.sync()
        if self._committer is not None:
            self._committer.close()


def checkpoint_root(config: Config) -> Path:
    return config.output_path / "checkpoints"


def start_fresh(config: Config) -> None:
    """``--fresh``: forget the checkpoints and curves of an earlier run of this output folder."""
    for folder in (checkpoint_root(config), config.output_path / "tensorboard"):
        if folder.exists():
            logger.warning("--fresh: deleting %s", folder)
            shutil.rmtree(folder)


def find_checkpoint(config: Config) -> Version | None:
    """Rank 0: the version to resume from, or None for a first run; errors say why resuming is impossible."""
    root = checkpoint_root(config)
    if not root.is_dir():
        return None
    version = latest_valid(root, _files_of)
    if version is None:
        if ever_committed(root):
            raise CheckpointCorrupt(f"no checkpoint in {root} is intact (see the warnings above); "
                                    "run with --fresh to start over")
        logger.warning("%s holds no committed checkpoint: starting from scratch", root)
        return None
    saved = json.loads(version.read(0, "config.json"))
    for key, (old, new) in _changed_keys(saved, config.to_dict()).items():
        if key.startswith(FIXED_KEYS):
            raise ConfigError(f"{key}: changed since checkpoint {version.path} ({json.dumps(old)} -> "
                              f"{json.dumps(new)}); restore it or run with --fresh to start over")
        logger.warning("resuming with %s changed: %s -> %s", key, json.dumps(old), json.dumps(new))
    saved_digest, digest = version.meta.get("module_digest"), module_digest(config)
    if saved_digest != digest:
        assert config.training is not None
        raise ConfigError(f"training.module: {config.training.module} changed since checkpoint {version.path} "
                          f"(sha256 {str(saved_digest)[:12]} -> {digest[:12]}): its weights may not fit the new code; "
                          "restore the file or run with --fresh to start over")
    logger.info("resuming from checkpoint %s (batch %d, written by %d ranks)",
                version.path, version.manifest["batch"], version.ranks)
    return version


def _files_of(rank: int) -> tuple[str, ...]:
    """The files ``Checkpointer`` writes for ``rank``: a version without one of them cannot be resumed."""
    return ("stream.pt", "trainer.pt", *(("dense.pt", "study.pt", "config.json") if rank == 0 else ()))


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


def restore_stream(version: Version, rank: int, size: int, receiver: Receiver, bind_simulation: bool) -> None:
    """Before reception starts: this rank's ledger and buffered samples from the checkpoint."""
    if version.ranks == size:
        stream = loads(version.read(rank, "stream.pt"))
        buffer = {**stream["buffer"], "entries": _owned(stream["buffer"]["entries"]), "closed": False}
        receiver.load_state_dict({**stream, "buffer": buffer})
        return
    streams = [loads(version.read(old, "stream.pt")) for old in range(version.ranks)]
    ledger = Ledger()
    for stream in streams:
        ledger.merge(stream["ledger"], lambda sim, steps: owner_rank(sim, steps, size, bind_simulation) == rank)
    entries = [entry for stream in streams for entry in stream["buffer"]["entries"]][rank::size]
    first = rank == 0  # the old ranks' counters, added up once
    receiver.load_state_dict({
        "buffer": _fresh_buffer_with(receiver.buffer, _owned(entries)),
        "ledger": ledger.state_dict(),
        "bytes_received": sum(s["bytes_received"] for s in streams) if first else 0,
        "duplicates": sum(s["duplicates"] for s in streams) if first else 0,
        "rejected": merge_rejections([s["rejected"] for s in streams]) if first else {},
    })


def _owned(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The samples with arrays of their own: views would pin the whole checkpoint file while one sample stays."""
    return [{**entry, "parameters": np.array(entry["parameters"]),
             "fields": {name: np.array(array) for name, array in entry["fields"].items()}} for entry in entries]


def _fresh_buffer_with(buffer: Buffer, entries: list[dict[str, Any]]) -> dict[str, Any]:
    """The state of a fresh buffer holding another partition's samples (never-served first, as a reservoir needs)."""
    entries = sorted(entries, key=lambda entry: entry["served"] > 0)
    return {**buffer.state_dict(), "entries": entries, "total_put": len(entries)}


def restore_trainer(version: Version, rank: int, size: int, trainer: Trainer) -> None:
    """The model, optimizers, table rows of this rank's range, RNG states and counters."""
    own = rank if rank < version.ranks else 0
    sources = {own} | {
        old for table in trainer.tables.values() for old in range(version.ranks)
        if _overlap(shard_range(table.num_rows, version.ranks, old), (table.start, table.stop))
    }
    states = {old: loads(version.read(old, "trainer.pt")) for old in sorted(sources)}
    summary = states[own]["summary"]
    if version.ranks != size:  # the samples trained per rank, regrouped so that their sum stays right
        summary.samples = sum(n for old, n in enumerate(version.meta["samples"]) if old % size == rank)
    pieces = {name: [state["tables"][name] for state in states.values()] for name in trainer.tables}
    trainer.load_state_dict({"dense": loads(version.read(0, "dense.pt")), "tables": pieces, "rng": states[own]["rng"],
                             "summary": summary})


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return max(a[0], b[0]) < min(a[1], b[1])


def restore_study(version: Version) -> dict[str, Any]:
    """``simulations`` (the study's ``state_dict``) and ``handshake_rejected`` (refusal counts)."""
    return loads(version.read(0, "study.pt"))
