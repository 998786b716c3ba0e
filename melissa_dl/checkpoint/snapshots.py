"""A checkpoint's snapshot and its writing, off the training thread (docs/explanation/design.md#checkpoints).

Training pays only for what it must: ``BackgroundCopy`` copies parameters
and optimizer state to CPU memory while the next forward and backward run,
and ``BackgroundWriter`` writes the files in one thread, in order. A part
marks what only its optimizer steps change as ``Live`` in its state;
``BackgroundCopies`` starts those copies when a snapshot is taken, and the
part's owner waits for them (``wait``) before its next optimizer step.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten


def copy_to_cpu(state: Any, into: Any = None) -> Any:
    """``state`` with every tensor replaced by a CPU copy (the containers are rebuilt, the rest shared).

    ``into``, an earlier copy of a state of the same structure that nothing
    uses any more, gives its tensors to be overwritten: copying into memory
    already touched is several times faster than into new pages.
    """
    leaves, spec = tree_flatten(state)
    old = tree_flatten(into)[0] if into is not None and tree_flatten(into)[1] == spec else [None] * len(leaves)
    return tree_unflatten([_copy(leaf, previous) for leaf, previous in zip(leaves, old)], spec)


def _copy(value: Any, into: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach()
    if (
        isinstance(into, torch.Tensor)
        and into.device.type == "cpu"
        and into.shape == value.shape
        and into.dtype == value.dtype
        and into.data_ptr() != value.data_ptr()
    ):
        return into.copy_(value)
    return value.to("cpu", copy=True)


class BackgroundCopy:
    """``copy_to_cpu(state, into)`` made by a thread (torch copies release the GIL).

    The caller may go on reading the tensors, and must call ``wait`` before
    it changes any of them: training runs its next forward and backward
    while the copy is made, and waits only before its optimizer step.
    """

    def __init__(self, state: Any, into: Any = None, on_release: Callable[[Any], None] | None = None) -> None:
        self._result: Any = None
        self._error: BaseException | None = None
        self._on_release = on_release
        self._thread = threading.Thread(target=self._run, args=(state, into), name="checkpoint-copy", daemon=True)
        self._thread.start()

    def _run(self, state: Any, into: Any) -> None:
        try:
            self._result = copy_to_cpu(state, into)
        except BaseException as error:  # raised by wait(), in the caller's thread
            self._error = error

    def wait(self) -> Any:
        """The copy, once made (any thread may wait)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def release(self) -> None:
        """The copy is written and used no more: ``on_release`` gets its memory, for a later copy's ``into``."""
        self._thread.join()
        if self._on_release is not None and self._error is None:
            self._on_release(self._result)


@dataclass(frozen=True)
class Live:
    """State that only optimizer steps change, in a part's ``state_dict``: copied in the background."""

    state: Any


class BackgroundCopies:
    """The copies of ``Live`` state a snapshot started, each into the memory of the last written copy of the same
    part and key (copying into memory already touched is several times faster than into new pages)."""

    def __init__(self) -> None:
        self._pending: list[BackgroundCopy] = []  # of the last snapshot, until the next optimizer step
        self._spare: dict[str, Any] = {}  # written copies, whose memory the next copies overwrite

    def start(self, part: str, state: Any) -> Any:
        """``state`` with each top-level ``Live`` value replaced by its copy under way."""
        if not isinstance(state, dict):
            return state
        return {
            key: self._start(f"{part}.{key}", value.state) if isinstance(value, Live) else value
            for key, value in state.items()
        }

    def _start(self, name: str, state: Any) -> BackgroundCopy:
        pending = BackgroundCopy(
            state,
            self._spare.pop(name, None),  # dict pop and store: atomic under the GIL
            on_release=lambda written: self._spare.__setitem__(name, written),
        )
        self._pending.append(pending)
        return pending

    def wait(self) -> None:
        """Before the state changes: every copy started is made."""
        for pending in self._pending:
            pending.wait()
        self._pending.clear()


def settled(state: Any) -> Any:
    """A part's state with each top-level ``BackgroundCopy`` replaced by its copy (waited for)."""
    if not isinstance(state, dict):
        return state
    return {key: value.wait() if isinstance(value, BackgroundCopy) else value for key, value in state.items()}


def release(state: Any) -> None:
    """``release`` the top-level copies of a written state."""
    for value in state.values() if isinstance(state, dict) else ():
        if isinstance(value, BackgroundCopy):
            value.release()


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
