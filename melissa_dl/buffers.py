"""Bounded, thread-safe sample buffers between the receiver and the training loop.

One ``threading.Condition`` per buffer guards everything; the producer (network
receiver) and the consumer (training loop) wake each other with ``notify_all``.

Choices, and why:

* Entries (a sample plus how many times it was served) live in a list, and
  random removal swaps the victim with the last entry, so it is O(1). FIFO uses
  a deque instead, because it removes from the front and must keep the order.
* The Reservoir keeps its list partitioned as ``[never served | served]``.
  Serving an entry for the first time swaps it across the boundary, so picking
  a served entry to evict is one ``randrange`` over the served part, with no
  scan and no side index to keep in sync.
* A buffer is *full* when it cannot grow: the sample count or byte capacity is
  reached, or the producer is blocked on a sample that does not fit. A full
  buffer serves what it holds even below the watermark or below the requested
  batch size, since waiting for more would deadlock.
* A sample larger than ``capacity_bytes`` is accepted when the buffer is empty;
  otherwise it could never be stored and reception would stall forever.
* ``put`` after ``close()`` (or a ``put`` blocked when ``close()`` happens)
  raises ``BufferClosed``: reception is over, so such a sample is a bug.
"""
from __future__ import annotations

import random
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass
from typing import Any, TypeVar

from melissa_dl.errors import BufferClosed, ConfigError
from melissa_dl.sample import Sample

T = TypeVar("T")


@dataclass(slots=True)
class _Entry:
    sample: Sample
    served: int = 0


class Buffer(ABC):
    """Common machinery; subclasses only choose what to serve and what to drop."""

    kind: str = ""

    def __init__(self, *, capacity_samples: int | None, capacity_bytes: int | None,
                 watermark: int, seed: int, pseudo_epochs: int = 1) -> None:
        self._cap_samples = capacity_samples
        self._cap_bytes = capacity_bytes
        self._watermark = watermark
        self._pseudo_epochs = pseudo_epochs
        self._rng = random.Random(seed)
        self._cond = threading.Condition(threading.Lock())
        self._entries: MutableSequence[_Entry] = self._new_container()
        self._blocked: list[int] = []  # nbytes of puts waiting for room
        self._nbytes = 0
        self._total_put = 0
        self._total_served = 0
        self._put_wait = 0.0
        self._get_wait = 0.0
        self._closed = False

    # ----------------------------------------------------------- public API
    def put(self, sample: Sample, timeout: float | None = None,
            on_insert: Callable[[], None] | None = None) -> bool:
        """Store ``sample``, waiting for room; False if ``timeout`` expires first.

        ``on_insert`` runs under the buffer's lock once the sample is in, so
        that ``state_dict_with`` sees the sample and its side effect together.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        nb = sample.nbytes
        blocked = False
        with self._cond:
            try:
                while True:
                    if self._closed:
                        raise BufferClosed(f"{self.kind} buffer: put after close()")
                    self._make_room(nb)
                    if self._fits(nb):
                        break
                    if not blocked:  # the consumer may now treat us as full
                        self._blocked.append(nb)
                        blocked = True
                        self._cond.notify_all()
                    waited = self._block(deadline)
                    if waited is None:
                        return False
                    self._put_wait += waited
            finally:
                if blocked:
                    self._blocked.remove(nb)
            self._insert(_Entry(sample))
            self._nbytes += nb
            self._total_put += 1
            if on_insert is not None:
                on_insert()
            self._cond.notify_all()
            return True

    def get_batch(self, size: int, timeout: float | None = None) -> list[Sample] | None:
        """Up to ``size`` distinct samples; [] at end of stream, None on timeout."""
        if size < 1:
            raise ValueError(f"batch size must be >= 1, got {size}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                n = len(self._entries)
                if self._closed or self._full():
                    batch = self._serve(min(size, n))
                    break
                if self._total_put >= self._watermark and n >= size:
                    batch = self._serve(size)
                    break
                waited = self._block(deadline)
                if waited is None:
                    return None
                self._get_wait += waited
            if batch:
                self._cond.notify_all()  # room freed, or entries became evictable
            return batch

    def close(self) -> None:
        """Reception is over: wake every waiter so the buffer drains."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def producer_waiting(self) -> bool:
        """A put is waiting for room: the buffer is what holds reception back."""
        return bool(self._blocked)

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def total_put(self) -> int:
        return self._total_put

    @property
    def total_served(self) -> int:
        return self._total_served

    @property
    def put_wait_seconds(self) -> float:
        return self._put_wait

    @property
    def get_wait_seconds(self) -> float:
        return self._get_wait

    def served_counts(self) -> list[tuple[int, int, int]]:
        """``(simulation_id, time_step, times served)`` per held sample, storage order."""
        with self._cond:
            return [(e.sample.simulation_id, e.sample.time_step, e.served)
                    for e in self._entries]

    def state_dict(self) -> dict[str, Any]:
        """Picklable snapshot; arrays are shared with the buffer, not copied."""
        return self.state_dict_with(lambda: None)[0]

    def state_dict_with(self, other: Callable[[], T]) -> tuple[dict[str, Any], T]:
        """``state_dict()`` and ``other()`` taken under the same lock (see ``put``'s ``on_insert``)."""
        with self._cond:
            return {
                "kind": self.kind,
                "entries": [{"simulation_id": e.sample.simulation_id,
                             "time_step": e.sample.time_step,
                             "parameters": e.sample.parameters,
                             "fields": dict(e.sample.fields),
                             "served": e.served} for e in self._entries],
                "total_put": self._total_put,
                "total_served": self._total_served,
                "put_wait_seconds": self._put_wait,
                "get_wait_seconds": self._get_wait,
                "closed": self._closed,
                "rng_state": self._rng.getstate(),
            }, other()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the whole state with ``state`` from a buffer of the same kind."""
        if state["kind"] != self.kind:
            raise ConfigError(f"buffer: checkpoint holds a {state['kind']!r} buffer, "
                              f"configured kind is {self.kind!r}")
        with self._cond:
            self._entries = self._new_container()
            for d in state["entries"]:
                sample = Sample(d["simulation_id"], d["time_step"],
                                d["parameters"], dict(d["fields"]))
                self._entries.append(_Entry(sample, d["served"]))
            self._nbytes = sum(e.sample.nbytes for e in self._entries)
            self._total_put = state["total_put"]
            self._total_served = state["total_served"]
            self._put_wait = state["put_wait_seconds"]
            self._get_wait = state["get_wait_seconds"]
            self._closed = state["closed"]
            self._rng.setstate(state["rng_state"])
            self._after_load()
            self._cond.notify_all()

    # ------------------------------------------------------------ machinery
    def _block(self, deadline: float | None) -> float | None:
        """Wait for a notify; seconds spent, or None when ``deadline`` has passed."""
        start = time.monotonic()
        if deadline is None:
            self._cond.wait()
        elif deadline <= start:
            return None
        else:
            self._cond.wait(deadline - start)
        return time.monotonic() - start

    def _fits(self, nb: int) -> bool:
        n = len(self._entries)
        if self._cap_samples is not None and n >= self._cap_samples:
            return False
        return self._cap_bytes is None or n == 0 or self._nbytes + nb <= self._cap_bytes

    def _full(self) -> bool:
        """The buffer cannot grow (probe: a blocked put, else a 1-byte sample)."""
        return not self._fits(min(self._blocked) if self._blocked else 1)

    def _serve(self, k: int) -> list[Sample]:
        indices = self._pick(k)
        batch = [self._entries[i].sample for i in indices]
        # Descending order: removing or moving entry i only touches positions
        # >= i, so the indices still to process stay valid.
        for i in sorted(indices, reverse=True):
            self._entries[i].served += 1
            self._after_serve(i)
        self._total_served += k
        return batch

    def _remove(self, i: int) -> None:
        """O(1) removal: the last entry takes the place of entry ``i``."""
        entries = self._entries
        self._nbytes -= entries[i].sample.nbytes
        entries[i] = entries[-1]
        entries.pop()

    def _new_container(self) -> MutableSequence[_Entry]:
        return []

    def _insert(self, entry: _Entry) -> None:
        self._entries.append(entry)

    def _make_room(self, nb: int) -> None:
        """Hook for kinds that may evict to make room; default: never evict."""

    def _after_load(self) -> None:
        """Hook to rebuild derived structures after ``load_state_dict``."""

    def _after_serve(self, i: int) -> None:
        if self._done(self._entries[i]):
            self._remove(i)

    def _pick(self, k: int) -> list[int]:
        """``k`` distinct indices, uniformly at random."""
        return self._rng.sample(range(len(self._entries)), k)

    @abstractmethod
    def _done(self, entry: _Entry) -> bool:
        """Whether a just-served entry leaves the buffer."""


class FifoBuffer(Buffer):
    """Served in arrival order, removed when served."""

    kind = "fifo"

    def _new_container(self) -> MutableSequence[_Entry]:
        return deque()

    def _pick(self, k: int) -> list[int]:
        return list(range(k))

    def _remove(self, i: int) -> None:
        self._nbytes -= self._entries[i].sample.nbytes
        del self._entries[i]  # i < batch size: cheap on a deque, keeps order

    def _done(self, entry: _Entry) -> bool:
        return True


class FiroBuffer(Buffer):
    """First in, random out; removed after ``pseudo_epochs`` servings."""

    kind = "firo"

    def _done(self, entry: _Entry) -> bool:
        return entry.served >= self._pseudo_epochs


class ReservoirBuffer(Buffer):
    """Random out, kept; when full, an arrival replaces a random served sample.

    Invariant: ``_entries[:_n_fresh]`` were never served, the rest were.
    """

    kind = "reservoir"
    _n_fresh = 0

    def _insert(self, entry: _Entry) -> None:
        entries = self._entries
        entries.append(entry)
        entries[-1], entries[self._n_fresh] = entries[self._n_fresh], entries[-1]
        self._n_fresh += 1

    def _after_serve(self, i: int) -> None:
        if i < self._n_fresh:  # first serving: move across the boundary
            j = self._n_fresh - 1
            self._entries[i], self._entries[j] = self._entries[j], self._entries[i]
            self._n_fresh = i = j
        super()._after_serve(i)

    def _done(self, entry: _Entry) -> bool:
        return self._closed  # after reception, serving drains the buffer

    def _make_room(self, nb: int) -> None:
        while not self._fits(nb) and self._n_fresh < len(self._entries):
            self._remove(self._rng.randrange(self._n_fresh, len(self._entries)))

    def _after_load(self) -> None:
        self._n_fresh = sum(1 for e in self._entries if e.served == 0)
        if any(e.served == 0 for e in list(self._entries)[self._n_fresh:]):
            raise ValueError("reservoir state: never-served entries must come first")


_KINDS: dict[str, type[Buffer]] = {
    cls.kind: cls for cls in (FifoBuffer, FiroBuffer, ReservoirBuffer)}


BUFFER_KINDS = tuple(_KINDS)
"""The buffer kinds by the name ``buffer.kind`` gives (the config's choices come from here)."""


def make_buffer(kind: str, *, capacity_samples: int | None, capacity_bytes: int | None,
                watermark: int, seed: int, pseudo_epochs: int = 1) -> Buffer:
    """Build the buffer named by the configuration's ``kind`` (its section, checked, holds the other values)."""
    return _KINDS[kind](capacity_samples=capacity_samples, capacity_bytes=capacity_bytes,
               watermark=watermark, seed=seed, pseudo_epochs=pseudo_epochs)
