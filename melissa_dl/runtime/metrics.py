"""One TensorBoard writer per rank, which the trainer, the study's generations and the stream write through.

It opens when training starts (``open``), once a restore has said which
batch the run continues from: ``purge_step`` drops what a dead run logged
after its checkpoint. Points given before that (the generations drawn while
the module made its held-out samples) wait for it. ``sources`` (the
receiver's stream scalars) are read and written with every training point
(``point``), so that their curves share the training's steps. A rank that
does not train gets ``Metrics(None)``, which writes and keeps nothing.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

Scalars = Callable[[], dict[str, float]]
RECORD_HEAD = 12  # bytes before an event in an event file: its length and the length's CRC

# TensorBoard sorts its groups of tags by name: "loss" first, then module (a TrainingModule's own), sampling,
# stream, system, training and validation
TRAIN_LOSS = "loss/train"  # each rank's
VALIDATION_LOSS = "loss/validation"  # the study's, written by rank 0


class Metrics:
    """``about``: rank 0's configuration and hyperparameters, written as text and to the HParams tab when the
    writer opens."""

    def __init__(
        self, folder: Path | None, sources: Sequence[Scalars] = (), about: tuple[str, dict[str, Any]] | None = None
    ) -> None:
        self.folder = folder
        self.sources = list(sources)
        self.about = about
        self._writer: Any = None
        self._closed = False  # points given after close() are dropped
        self._waiting: list[tuple[str, str, Any, int]] = []  # (kind, tag, value, step) given before open()

    def open(self, purge_step: int) -> None:
        """Start writing, replacing whatever was logged at ``purge_step`` and after; write what waited."""
        if self.folder is None:
            return
        from torch.utils.tensorboard import SummaryWriter  # slow import, only when training

        if purge_step > 1:
            drop_after(self.folder, purge_step)
        self._writer = SummaryWriter(str(self.folder), purge_step=purge_step)
        if self.about is not None:
            self._describe(*self.about, step=purge_step - 1)
        waiting, self._waiting = self._waiting, []
        for kind, tag, value, step in waiting:
            self._write(kind, tag, value, step)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._write("scalar", tag, value, step)

    def figure(self, tag: str, draw: Callable[[], Any], step: int) -> None:
        """A matplotlib figure or an ``[H, W, 3]`` uint8 image, drawn by ``draw`` only when it is written (none if it
        returns None)."""
        self._write("figure", tag, draw, step)

    def point(self, step: int, values: dict[str, float]) -> None:
        """The training's ``values`` at ``step``, with every source's."""
        for source in self.sources:
            values = {**values, **source()}
        for tag, value in values.items():
            self.scalar(tag, value, step)

    def _describe(self, config: str, hyperparameters: dict[str, Any], step: int) -> None:
        """The resolved configuration (a JSON text) and its hyperparameters, against the validation loss."""
        from torch.utils.tensorboard.summary import hparams

        self._writer.add_text("config", "".join(f"    {line}\n" for line in config.splitlines()), step)  # as code
        for summary in hparams(hyperparameters, {VALIDATION_LOSS: 0.0}):  # the metric's values are its scalars
            self._writer.file_writer.add_summary(summary, step)

    def close(self) -> None:
        """Write what is pending; a second call, or a point given after, does nothing."""
        self._closed = True
        self._waiting = []
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def _write(self, kind: str, tag: str, value: Any, step: int) -> None:
        if self.folder is None or self._closed:
            return
        if self._writer is None:
            self._waiting.append((kind, tag, value, step))
        elif kind == "scalar":
            self._writer.add_scalar(tag, value, step)
        elif isinstance(picture := value(), np.ndarray):
            self._writer.add_image(tag, picture, step, dataformats="HWC")
        elif picture is not None:
            self._writer.add_figure(tag, picture, step)


def drop_after(folder: Path, purge_step: int) -> None:
    """Drop from ``folder``'s event files what a dead run wrote at ``purge_step`` and after (a torn last record
    too). TensorBoard would drop them itself, at the resumed run's purge_step, but warning each time it loads the
    folder ("Detected out of order event.step likely caused by a TensorFlow restart"); a TensorBoard that had read
    them before still does."""
    from google.protobuf.message import DecodeError  # type: ignore[import-untyped]
    from tensorboard.compat.proto.event_pb2 import Event

    for path in sorted(folder.glob("*tfevents*")):
        data = path.read_bytes()
        kept, dropped, at = [], 0, 0
        while at + RECORD_HEAD <= len(data):  # records: length (8 bytes), its CRC (4), the event, its CRC (4)
            (length,) = struct.unpack("<Q", data[at : at + 8])
            end = at + RECORD_HEAD + length + 4
            if end > len(data):
                dropped += 1
                break
            try:
                event = Event.FromString(data[at + RECORD_HEAD : end - 4])
            except DecodeError:  # not an event: the rest is kept as it is, for TensorBoard to skip
                kept.append(data[at:])
                break
            if event.HasField("summary") and event.step >= purge_step:
                dropped += 1
            else:
                kept.append(data[at:end])
            at = end
        if dropped:
            pruned = path.with_name(".pruning")  # no event file's name while it is written
            pruned.write_bytes(b"".join(kept))
            os.replace(pruned, path)
