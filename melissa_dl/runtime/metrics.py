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

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Scalars = Callable[[], dict[str, float]]


class Metrics:
    def __init__(self, folder: Path | None, sources: Sequence[Scalars] = ()) -> None:
        self.folder = folder
        self.sources = list(sources)
        self._writer: Any = None
        self._closed = False  # points given after close() are dropped
        self._waiting: list[tuple[str, str, Any, int]] = []  # (kind, tag, value, step) given before open()

    def open(self, purge_step: int) -> None:
        """Start writing, replacing whatever was logged at ``purge_step`` and after; write what waited."""
        if self.folder is None:
            return
        from torch.utils.tensorboard import SummaryWriter  # slow import, only when training

        self._writer = SummaryWriter(str(self.folder), purge_step=purge_step)
        waiting, self._waiting = self._waiting, []
        for kind, tag, value, step in waiting:
            self._write(kind, tag, value, step)

    def scalar(self, tag: str, value: float, step: int) -> None:
        self._write("scalar", tag, value, step)

    def figure(self, tag: str, draw: Callable[[], Any], step: int) -> None:
        """A matplotlib figure, drawn by ``draw`` only when it is written."""
        self._write("figure", tag, draw, step)

    def point(self, step: int, values: dict[str, float]) -> None:
        """The training's ``values`` at ``step``, with every source's."""
        for source in self.sources:
            values = {**values, **source()}
        for tag, value in values.items():
            self.scalar(tag, value, step)

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
        else:
            self._writer.add_figure(tag, value(), step)
