"""Bounded, thread-safe sample buffers between the receiver and the training loop.

One ``threading.Condition`` per buffer guards everything; the producer (network
receiver) and the consumer (training loop) wake each other with ``notify_all``:
the consumer only when a put is blocked (nothing else waits for room), the
producer only when a waiting get can now be served (a consumer starved of data
would otherwise wake at every sample to find too few).

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
* A batch formed of its samples that a stop left untrained (the other ranks
  could not match it) comes back to the buffer as it is (``hold``): its
  samples have left, and the checkpoint keeps it with them, for the resumed
  run to train first (``take_held``).
* After ``close()`` a buffer drains as its kind says (each sample served once
  more, or FIRO's servings left), unless it was given ``passes_after_data``:
  then it serves every sample it holds that many times, in passes (each in the
  kind's order: FIFO's arrival order, a new random order otherwise; a pass's
  last batch may be short, so that no batch holds a sample twice), and keeps
  them until the last pass, as an epoch-based ``DataLoader`` would once the
  stream has ended. The list is in the pass's order and ``_cursor`` is the
  next to serve, which a checkpoint keeps.
"""

from __future__ import annotations

import random
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, MutableSequence, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import numpy as np

from melissa_dl.buffers.rows import Rows
from melissa_dl.buffers.sample import Sample
from melissa_dl.buffers.windows import Window, Windowing, WindowStore
from melissa_dl.config.registry import BUFFERS, load
from melissa_dl.errors import BufferClosed, ConfigError

if TYPE_CHECKING:
    from melissa_dl.config.sections import BufferConfig

T = TypeVar("T")
VICTIM_DRAWS = 8  # served windows a full Reservoir of windows compares before evicting one


@dataclass(slots=True)
class _Entry:
    sample: Sample | Window
    served: int = 0
    row: int = -1  # of its processed outputs, when the buffer keeps them (``keep_processed``)
    nbytes: int = field(init=False)  # the sample's, here so that freeing a batch does not visit the samples

    def __post_init__(self) -> None:
        self.nbytes = self.sample.nbytes


class Buffer(ABC):
    """Common machinery; subclasses only choose what to serve and what to drop."""

    kind: str = ""
    in_order: ClassVar[bool] = False  # a pass after the data keeps the arrival order (else: a new random order)
    Options: ClassVar[type | None] = None
    """A dataclass of the kind's own options (its section ``buffer.<kind>``; each field documented in
    ``metadata["doc"]``), or None; the section read is ``self.options``."""

    def __init__(
        self,
        *,
        capacity_samples: int | None,
        capacity_bytes: int | None,
        watermark: int,
        seed: int,
        pseudo_epochs: int = 1,
        passes_after_data: int | None = None,
        options: Any = None,
        windowing: Windowing | None = None,
    ) -> None:
        self.options = options
        self.passes_after_data = passes_after_data
        self._cap_samples = capacity_samples
        self._cap_bytes = capacity_bytes
        self._watermark = watermark
        self._pseudo_epochs = pseudo_epochs
        self._rng = random.Random(seed)
        self._cond = threading.Condition(threading.Lock())
        self._entries: MutableSequence[_Entry] = self._new_container()
        self._blocked: list[int] = []  # nbytes of puts waiting for room
        self._takers: list[int] = []  # sizes asked by gets waiting for samples
        self._nbytes = 0
        self._total_put = 0
        self._total_served = 0
        self._put_wait = 0.0
        self._get_wait = 0.0
        self._closed = False
        self._rows: Rows | None = None
        self._passes_left: int | None = None  # after the data, in passes: those not finished yet
        self._cursor = 0  # in passes: the next entry of this pass to serve
        self._windows = WindowStore(windowing) if windowing is not None else None  # entries are its windows
        self._untrained: list[Any] = []  # batches of its samples a stop left untrained, in training order

    @staticmethod
    def from_config(
        section: BufferConfig, rank: int, passes_after_data: int | None = None, windowing: Windowing | None = None
    ) -> Buffer:
        """Rank ``rank``'s buffer, of the kind the section chooses (each rank draws from its own seed), serving
        what it holds ``passes_after_data`` times once the data has ended (None: its kind's drain), and windows of
        steps as its samples with ``windowing``."""
        return make_buffer(
            section.kind,
            capacity_samples=section.capacity_samples,
            capacity_bytes=section.capacity_bytes,
            watermark=section.per_server_watermark,
            seed=section.seed + rank,
            pseudo_epochs=section.pseudo_epochs,
            passes_after_data=passes_after_data,
            options=section.options_of.get(section.kind),
            windowing=windowing,
        )

    # ----------------------------------------------------------- public API
    def put(self, sample: Sample, timeout: float | None = None, on_insert: Callable[[], None] | None = None) -> bool:
        """Store ``sample``, waiting for room; False if ``timeout`` expires first.

        ``on_insert`` runs under the buffer's lock once the sample is in, so
        that ``state_dict_with`` sees the sample and its side effect together.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        nb = sample.nbytes
        blocked = False
        rows = self._rows
        prepared = rows.prepare(sample) if rows is not None else None  # the user's process, outside the lock
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
            if self._windows is not None:
                for window in self._windows.add(sample):
                    self._insert(_Entry(window))
                self._nbytes = self._windows.nbytes
            else:
                self._insert(self._entry(sample, prepared if rows is self._rows else None))
                self._nbytes += nb
            self._total_put += 1
            if on_insert is not None:
                on_insert()
            if self._takers and self._servable(min(self._takers)) is not None:
                self._cond.notify_all()
            return True

    def get_batch(self, size: int, timeout: float | None = None) -> list[Sample | Window] | None:
        """Up to ``size`` distinct samples (with windows: ``Window``s); [] at end of stream, None on timeout."""
        return self._take(size, timeout, lambda entries: [e.sample for e in entries])

    def get_processed(self, size: int, timeout: float | None = None) -> tuple[Any, Any] | list[Any] | None:
        """As ``get_batch``, but the batch of the samples' kept ``process`` outputs (see ``keep_processed``) and
        their ``(simulation, step)`` (``Rows.gather``)."""
        rows = self._rows
        assert rows is not None, "keep_processed() first"
        return self._take(size, timeout, lambda entries: rows.gather([e.row for e in entries]))

    def keep_processed(self, process: Callable[[Sample], Any], pin_memory: bool = False) -> None:
        """From now on, run ``process`` once per sample as it is put, and keep its outputs as rows
        (``melissa_dl.buffers.rows``) for ``get_processed``, whose batches are in pinned memory if
        ``pin_memory``; the samples held already are processed now."""
        with self._cond:
            self._rows = Rows(process, self._cap_samples or 64, pin_memory)
            for entry in self._entries:
                assert isinstance(entry.sample, Sample), "a buffer of windows keeps no processed rows"
                entry.row = self._rows.add(entry.sample, self._rows.prepare(entry.sample))

    def _take(self, size: int, timeout: float | None, form: Callable[[Sequence[_Entry]], T]) -> T | list[Any] | None:
        """``form`` of up to ``size`` entries served (called under the lock, before any of them leaves);
        [] at end of stream, None on timeout."""
        if size < 1:
            raise ValueError(f"batch size must be >= 1, got {size}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (k := self._servable(size)) is None:
                self._takers.append(size)
                try:
                    waited = self._block(deadline)
                finally:
                    self._takers.remove(size)
                if waited is None:
                    return None
                self._get_wait += waited
            if k == 0:
                return []
            batch = self._serve(k, form)
            if self._blocked:  # room freed, or entries became evictable: only a blocked put waits for that
                self._cond.notify_all()
            return batch

    def hold(self, batch: Any) -> None:
        """Keep ``batch`` (formed of this buffer's samples, its own memory) untrained, for ``take_held``: the
        consumer's only, as formed batches are."""
        self._untrained.insert(0, batch)

    def take_held(self) -> Any:
        """The oldest batch held, or None."""
        return self._untrained.pop(0) if self._untrained else None

    def close(self) -> None:
        """Reception is over: wake every waiter so the buffer drains, or serves its passes after the data."""
        with self._cond:
            if self._windows is not None:  # no window is made any more
                self._windows.end_all()
                self._nbytes = self._windows.nbytes
            if not self._closed and self._passes_left is None:  # else: passes a checkpoint resumed, reopened
                self._on_close()
                if self.passes_after_data is not None and self._entries:
                    self._entries = list(self._entries)
                    self._passes_left = self.passes_after_data
                    self._new_pass()
            self._closed = True
            self._cond.notify_all()

    def end_simulation(self, simulation_id: int) -> None:
        """The simulation ended (done or failed): with windows, its steps that no window holds leave."""
        if self._windows is not None:
            with self._cond:
                self._windows.end(simulation_id)
                self._nbytes = self._windows.nbytes
                if self._blocked:
                    self._cond.notify_all()

    def lacks(self, simulation_id: int, steps: np.ndarray) -> np.ndarray:
        """Which of ``steps`` (received on some rank) this rank must receive again: with windows, after a restart on
        another number of ranks, those a window still to be made here spans and that it does not hold."""
        if self._windows is None:
            return np.zeros(len(steps), dtype=bool)
        with self._cond:
            return self._windows.lacks(simulation_id, steps)

    @property
    def windowed(self) -> bool:
        """Its entries are windows of steps (``melissa_dl.buffers.windows``)."""
        return self._windows is not None

    @property
    def held_steps(self) -> int:
        """Steps held: with windows, each once however many windows span it."""
        return self._held()

    @property
    def passes_done(self) -> int | None:
        """After the data, with ``passes_after_data``: the passes finished over what the buffer held (None before
        the data ended, or without passes)."""
        with self._cond:
            if self.passes_after_data is None or not self._closed:
                return None
            return self.passes_after_data - (self._passes_left or 0)

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
            return [(e.sample.simulation_id, e.sample.time_step, e.served) for e in self._entries]

    def state_dict(self) -> dict[str, Any]:
        """Picklable snapshot; arrays are shared with the buffer, not copied."""
        return self.state_dict_with(lambda: None)[0]

    def state_dict_with(self, other: Callable[[], T]) -> tuple[dict[str, Any], T]:
        """``state_dict()`` and ``other()`` taken under the same lock (see ``put``'s ``on_insert``)."""
        with self._cond:
            return {
                "kind": self.kind,
                "entries": [{**e.sample.state(), "served": e.served} for e in self._entries],
                "windows": self._windows.state() if self._windows is not None else None,
                "total_put": self._total_put,
                "total_served": self._total_served,
                "put_wait_seconds": self._put_wait,
                "get_wait_seconds": self._get_wait,
                "closed": self._closed,
                "rng_state": self._rng.getstate(),
                "passes_left": self._passes_left,
                "cursor": self._cursor,
                "held": list(self._untrained),
            }, other()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the whole state with ``state`` from a buffer of the same kind."""
        if state["kind"] != self.kind:
            raise ConfigError(f"buffer: checkpoint holds a {state['kind']!r} buffer, configured kind is {self.kind!r}")
        with self._cond:
            self._entries = self._new_container()
            if self._rows is not None:
                self._rows = Rows(self._rows.process, self._cap_samples or 64, self._rows.pin_memory)
            self._load_entries(state)
            self._total_put = state["total_put"]
            self._total_served = state["total_served"]
            self._put_wait = state["put_wait_seconds"]
            self._get_wait = state["get_wait_seconds"]
            self._closed = state["closed"]
            self._rng.setstate(state["rng_state"])
            self._passes_left, self._cursor = state.get("passes_left"), state.get("cursor", 0)
            self._untrained = list(state.get("held", []))
            if self._passes_left is not None:  # in the order of the pass under way
                self._entries = list(self._entries)
            else:
                self._after_load()
            self._cond.notify_all()

    def _load_entries(self, state: dict[str, Any]) -> None:
        """The entries of ``state``, in its order, and their bytes."""
        if self._windows is not None:
            starts = [(d["simulation_id"], d["time_step"]) for d in state["entries"]]
            entries = [_Entry(window) for window in self._windows.load(state["windows"], starts)]
            self._nbytes = self._windows.nbytes
        else:
            entries = [self._entry(Sample.from_state(d)) for d in state["entries"]]
            self._nbytes = sum(e.sample.nbytes for e in entries)
        for entry, d in zip(entries, state["entries"]):
            entry.served = d["served"]
            self._entries.append(entry)

    def load_resharded(self, olds: Sequence[dict[str, Any]], rank: int, size: int) -> None:
        """Rank ``rank`` of ``size``, from the buffers of a checkpoint of another number of ranks (``olds``, their
        states), before the receiver starts (not atomic: nothing puts yet): an equal share of their samples
        (windows: those whose start this rank owns now, with the steps they span and those of the windows still to
        be made here), never-served first, counted as put here, and the batches held of every ``size``-th old rank
        from ``rank`` on. A kind with state of its own overrides this to share that state as well."""
        windows = None
        if self._windows is not None:
            windows, entries = self._windows.resharded(olds)
        else:
            entries = [entry for old in olds for entry in old["entries"]][rank::size]
        entries.sort(key=lambda entry: entry["served"] > 0)
        put = len(windows["steps"]) if windows is not None else len(entries)  # the watermark counts steps
        held = [batch for old in olds[rank::size] for batch in old.get("held", [])]
        state = {**self.state_dict(), "entries": entries, "windows": windows, "total_put": put, "held": held}
        self.load_state_dict(state)  # passes anew
        if self._windows is not None:
            with self._cond:
                for window in self._windows.make_complete():
                    self._insert(_Entry(window))

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

    def _held(self) -> int:
        return self._windows.held if self._windows is not None else len(self._entries)

    def _fits(self, nb: int) -> bool:
        """Room for ``nb`` bytes more; always, while it has nothing to serve (else reception would wait forever:
        with windows, on steps that make no window yet)."""
        if not self._entries:
            return True
        n = self._held()
        if self._cap_samples is not None and n >= self._cap_samples:
            return False
        return self._cap_bytes is None or self._nbytes + nb <= self._cap_bytes

    def _servable(self, size: int) -> int | None:
        """How many entries a get of ``size`` takes now, or None while it must wait for more."""
        n = len(self._entries) - self._cursor  # those not served yet in a pass after the data
        if self._closed or self._full():
            return min(size, n)
        if self._total_put >= self._watermark and n >= size:
            return size
        return None

    def _full(self) -> bool:
        """The buffer cannot grow (probe: a blocked put, else a 1-byte sample)."""
        return not self._fits(min(self._blocked) if self._blocked else 1)

    def _entry(self, sample: Sample, prepared: Any = None) -> _Entry:
        """A new entry, with its row of processed outputs when the buffer keeps them."""
        if self._rows is None:
            return _Entry(sample)
        return _Entry(sample, row=self._rows.add(sample, prepared or self._rows.prepare(sample)))

    def _serve(self, k: int, form: Callable[[Sequence[_Entry]], T]) -> T:
        """``form`` of ``k`` entries the kind picks (called before any leaves), which are then served: the batch's
        hot path, so one pass per step and no call per entry where possible."""
        if self._passes_left is not None:
            batch = form(self._entries[self._cursor : self._cursor + k])
            self._next_in_pass(k)
        else:
            picked = self._pick(k)
            batch = form(picked)
            self._served(picked)
        self._total_served += k
        return batch

    def _new_pass(self) -> None:
        """Every entry once more, in the kind's order (shuffled, but for FIFO's arrival order)."""
        if not self.in_order:
            self._rng.shuffle(self._entries)
        self._cursor = 0

    def _next_in_pass(self, k: int) -> None:
        """``k`` entries of the pass served: at its end the next pass, or, after the last, every entry leaves."""
        self._cursor += k
        if self._cursor < len(self._entries):
            return
        assert self._passes_left is not None
        self._passes_left -= 1
        if self._passes_left:
            self._new_pass()
            return
        self._forget(self._entries)
        self._entries = []
        self._cursor = 0

    @abstractmethod
    def _pick(self, k: int) -> Sequence[_Entry]:
        """The ``k`` entries the kind serves next; those that will leave may already be out of ``_entries``."""

    def _served(self, picked: Sequence[_Entry]) -> None:
        """What serving does to the ``picked`` entries, once formed into a batch: by default, they leave."""
        self._forget(picked)

    def _take_last(self, k: int) -> Sequence[_Entry]:
        """The last ``k`` entries, out of ``_entries``."""
        picked = self._entries[-k:]
        del self._entries[-k:]
        return picked

    def _remove(self, i: int) -> _Entry:
        """O(1) removal: the last entry takes the place of entry ``i``."""
        entries = self._entries
        entry = entries[i]
        entries[i] = entries[-1]
        entries.pop()
        return entry

    def _forget(self, entries: Sequence[_Entry]) -> None:
        """Entries left: their bytes and rows are free again (with windows: the steps no window needs any more)."""
        if self._windows is not None:
            self._windows.release([entry.sample for entry in entries])  # type: ignore[misc]
            self._nbytes = self._windows.nbytes
            return
        self._nbytes -= sum([entry.nbytes for entry in entries])
        if self._rows is not None:
            self._rows.release([entry.row for entry in entries])

    def _new_container(self) -> MutableSequence[_Entry]:
        return []

    def _insert(self, entry: _Entry) -> None:
        self._entries.append(entry)

    def _make_room(self, nb: int) -> None:
        """Hook for kinds that may evict to make room; default: never evict."""

    def _after_load(self) -> None:
        """Hook to rebuild derived structures after ``load_state_dict``."""

    def _on_close(self) -> None:
        """Hook: reception just ended."""


class FifoBuffer(Buffer):
    """Served in arrival order, removed when served."""

    kind = "fifo"
    in_order = True

    def _new_container(self) -> MutableSequence[_Entry]:
        return deque()

    def _pick(self, k: int) -> Sequence[_Entry]:
        """The first ``k`` entries, all leaving: no per-entry bookkeeping but the bytes and rows freed."""
        popleft = self._entries.popleft  # type: ignore[attr-defined]
        return [popleft() for _ in range(k)]


class FiroBuffer(Buffer):
    """First in, random out; removed after ``pseudo_epochs`` servings.

    The entries are kept in a uniformly random order: an arrival goes to a
    random place and that place's entry to the end (the inside-out
    Fisher-Yates shuffle), so the last ``k`` entries are ``k`` picked at
    random, taken with one slice; an entry served fewer than ``pseudo_epochs``
    times goes back the same way.
    """

    kind = "firo"

    def _insert(self, entry: _Entry) -> None:
        entries = self._entries
        entries.append(entry)
        j = self._rng.randrange(len(entries))
        entries[-1], entries[j] = entries[j], entries[-1]

    def _pick(self, k: int) -> Sequence[_Entry]:
        return self._take_last(k)

    def _served(self, picked: Sequence[_Entry]) -> None:
        """Count a serving of each picked entry: those served ``pseudo_epochs`` times leave, the others go back."""
        if self._pseudo_epochs == 1:  # all leave: no count left to keep
            self._forget(picked)
            return
        gone = []
        for entry in picked:
            entry.served += 1
            if entry.served >= self._pseudo_epochs:
                gone.append(entry)
            else:
                self._insert(entry)
        self._forget(gone)


class ReservoirBuffer(Buffer):
    """Random out, kept; when full, an arrival replaces a random served sample.

    Invariant: ``_entries[:_n_fresh]`` were never served, the rest were;
    after reception the order is shuffled once and the buffer drains as a
    FIRO does, from the end.
    """

    kind = "reservoir"
    _n_fresh = 0
    _places: list[int] | None = None  # of the entries picked last, unless they were drained

    def _insert(self, entry: _Entry) -> None:
        entries = self._entries
        entries.append(entry)
        entries[-1], entries[self._n_fresh] = entries[self._n_fresh], entries[-1]
        self._n_fresh += 1

    def _pick(self, k: int) -> Sequence[_Entry]:
        """``k`` entries at random; after reception, the last ``k`` of the order shuffled at ``close``, served
        once more and gone (so there is no count left to keep)."""
        if self._closed:
            self._places = None
            return self._take_last(k)
        self._places = self._rng.sample(range(len(self._entries)), k)
        return [self._entries[i] for i in self._places]

    def _served(self, picked: Sequence[_Entry]) -> None:
        """A first serving moves the entry across the boundary (in descending order of place: moving entry i only
        touches places >= i, so the places still to settle stay valid)."""
        if self._places is None:
            self._forget(picked)
            return
        for entry in picked:
            entry.served += 1
        entries, fresh = self._entries, self._n_fresh
        for i in sorted((i for i in self._places if i < fresh), reverse=True):
            fresh -= 1
            entries[i], entries[fresh] = entries[fresh], entries[i]
        self._n_fresh = fresh

    def _on_close(self) -> None:
        self._rng.shuffle(self._entries)
        self._n_fresh = 0  # the order is no longer partitioned, and nothing is put any more

    def _make_room(self, nb: int) -> None:
        while not self._fits(nb) and self._n_fresh < len(self._entries):
            self._forget([self._remove(self._victim())])

    def _victim(self) -> int:
        """A served entry's place, at random; with windows, of a few drawn, the one whose leaving frees the most
        steps (a window's steps leave only with the last window spanning them: a random window frees few)."""
        if self._windows is None:
            return self._rng.randrange(self._n_fresh, len(self._entries))
        places = [self._rng.randrange(self._n_fresh, len(self._entries)) for _ in range(VICTIM_DRAWS)]
        frees = self._windows.frees
        return max(places, key=lambda i: frees(self._entries[i].sample))  # type: ignore[arg-type]

    def _after_load(self) -> None:
        """Open: never-served entries first (a checkpoint taken while draining has them anywhere). Closed:
        the order shuffled at ``close``, as it was."""
        if self._closed:
            self._n_fresh = 0
            return
        self._entries[:] = sorted(self._entries, key=lambda e: e.served > 0)  # stable: a no-op if partitioned
        self._n_fresh = sum(1 for e in self._entries if e.served == 0)


def make_buffer(
    kind: str,
    *,
    capacity_samples: int | None,
    capacity_bytes: int | None,
    watermark: int,
    seed: int,
    pseudo_epochs: int = 1,
    passes_after_data: int | None = None,
    options: Any = None,
    windowing: Windowing | None = None,
) -> Buffer:
    """The buffer of kind ``kind`` (a name of the registry's ``BUFFERS``), its module loaded now."""
    found: type[Buffer] = load(BUFFERS, kind, "buffer.kind")
    return found(
        capacity_samples=capacity_samples,
        capacity_bytes=capacity_bytes,
        watermark=watermark,
        seed=seed,
        pseudo_epochs=pseudo_epochs,
        passes_after_data=passes_after_data,
        options=options,
        windowing=windowing,
    )
