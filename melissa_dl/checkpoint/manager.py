"""The one owner of a server's checkpoints (docs/explanation/design.md#checkpoints): what to resume from, the parts,
when to snapshot.

The server opens it (``open``: a fresh start, or the version to resume
from, checked against this configuration) and registers its parts as it
builds them (``add``: each is restored from that version at once); the
training loop calls it when training begins (``begin``), after every step
(``after_step``: a snapshot every ``checkpoint.interval`` batches),
in every bookkeeping round (``sync``: commits), in every round where no
rank holds a formed batch (``when_idle``) and at the end (``final``).
``recovery.Checkpointer`` writes and commits, ``versions`` stores; the
parts know only ``state_dict``.
"""

from __future__ import annotations

import time

from melissa_dl.checkpoint.recovery import Checkpointer, Part, checkpoint_root, find_checkpoint, restore, start_fresh
from melissa_dl.checkpoint.snapshots import BackgroundCopies
from melissa_dl.checkpoint.versions import Version, next_version
from melissa_dl.config.sections import Config
from melissa_dl.errors import CheckpointCorrupt, ConfigError
from melissa_dl.runtime.files import remove_temporaries
from melissa_dl.runtime.mpi import Comm


class CheckpointManager:
    def __init__(self, config: Config, comm: Comm) -> None:
        self.config = config
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.root = checkpoint_root(config)
        self.interval = config.checkpoint.interval if config.training is not None else 0
        self.spacing = config.checkpoint.seconds
        self.parts: list[Part] = []  # the stream's, the trainer's, and on rank 0 the study's
        self.version: Version | None = None  # resumed from
        self.copies = BackgroundCopies()  # of the parts' live state: the trainer waits for them before a step
        self._checkpointer: Checkpointer | None = None  # from begin()
        self._unrecorded = False  # simulations ended that no snapshot taken or asked for has recorded yet
        self._requested = False  # a snapshot at the first chance: after the next step, or when idle
        self._next_record = 0.0  # rank 0's clock: no snapshot for ended simulations before then

    def open(self, fresh: bool, refused: str | None = None) -> Version | None:
        """Collective: start over (``fresh``) or find the version to resume from, which every rank gets (None: a
        first run). Raises ``ConfigError`` on every rank when rank 0 cannot resume, or ``refused`` the folder."""
        found: tuple[Version | None, str | None] | None = None
        if self.rank == 0:
            found = (None, refused) if refused is not None else self._find(fresh)
        self.version, failure = self.comm.bcast(found)
        if failure is not None:
            raise ConfigError(failure)
        return self.version

    def _find(self, fresh: bool) -> tuple[Version | None, str | None]:
        try:
            remove_temporaries(self.root)  # of a server killed while writing
            if fresh:
                start_fresh(self.config)
            return (find_checkpoint(self.config) if self.config.training is not None else None), None
        except (ConfigError, CheckpointCorrupt) as error:
            return None, str(error)

    def add(self, *parts: Part) -> None:
        """More parts of the checkpoints, restored from the version opened when resuming."""
        if self.version is not None:
            restore(self.version, parts, self.rank, self.size)
        self.parts += parts

    def begin(self) -> None:
        """Collective, when training begins: the versions written from now on follow every earlier one."""
        first = self.comm.bcast(next_version(self.root) if self.rank == 0 else None)
        self._checkpointer = Checkpointer(self.config, self.comm, self.parts, first, self.copies)

    def due(self, batches: int) -> bool:
        """Whether a snapshot follows the step that makes ``batches``."""
        return self._requested or (self.interval > 0 and batches % self.interval == 0)

    def after_step(self, batches: int, samples: int) -> None:
        """Every rank, after each lockstep step: a snapshot when it is due."""
        if self.due(batches):
            self.snapshot(batches, samples)

    def when_idle(self, batches: int, samples: int) -> None:
        """Every rank, in a round where no rank holds a formed batch: the snapshot asked for, if any."""
        if self._requested:
            self.snapshot(batches, samples)

    def snapshot(self, batches: int, samples: int) -> None:
        assert self._checkpointer is not None, "begin() first"
        self._checkpointer.snapshot(batches, samples)
        self._requested = False

    def sync(self, ended: bool = False) -> None:
        """Collective, in a bookkeeping round: commit what every rank has written; ``ended``: simulations ended
        in this round (every rank knows it from the round's news), which a snapshot will record.

        Rank 0's clock alone spaces those snapshots, so that every rank takes them at the same step."""
        if self._checkpointer is None:
            return
        self._checkpointer.sync()
        self._unrecorded |= ended
        if self._unrecorded and (self.spacing == 0 or self.comm.bcast(time.monotonic() >= self._next_record)):
            self._unrecorded, self._requested = False, True
            self._next_record = time.monotonic() + self.spacing

    def final(self, complete: bool) -> None:
        """Collective, when training ends or stops: commit the last snapshot (``complete``: of the study's end)."""
        assert self._checkpointer is not None, "begin() first"
        self._checkpointer.final(complete)
