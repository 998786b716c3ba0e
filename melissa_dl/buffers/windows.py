"""Windows of consecutive steps of one simulation as a buffer's samples, each step held once (``training.window``).

A buffer with windows takes steps and serves windows: its entries are
``Window``s, which refer to the steps they span, and the ``WindowStore``
holds each step once, however many windows span it. A window is made when
its last missing step arrives, on the rank that owns its first step
(``wire.protocol.Route``: each rank also receives the steps that complete
the windows of its block). A step leaves when no window in the buffer holds
it and no window that may still be made here needs it; a simulation that
ended needs nothing more, nor does any after the data.

Each simulation's timeline keeps a bit per window start made here, so that a
window is made once: after a restart on another number of ranks a step may
come again (a rank that formed no window with it lost its copy), and only
the windows still missing are made then. ``lacks`` says which received steps
a rank must receive again for that reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from melissa_dl.buffers.sample import Sample

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Windowing:
    """The windows a rank makes: ``length`` steps, starting at multiples of ``stride``, at the starts ``owner`` (of
    simulation and step: the rank of the run the start is in) gives this ``rank``."""

    length: int
    stride: int
    owner: Callable[[int, int], int]
    rank: int

    def owns(self, simulation_id: int, start: int) -> bool:
        return start % self.stride == 0 and self.owner(simulation_id, start) == self.rank


@dataclass(slots=True, eq=False)
class Window:
    """A buffer entry's sample: ``length`` consecutive steps from ``time_step`` (its first), each a step held once
    by the store."""

    simulation_id: int
    time_step: int
    parameters: np.ndarray
    steps: tuple[Sample, ...]
    nbytes: int = 0  # the store counts its steps' bytes, once each

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (its steps are kept once, by the store)."""
        return {"simulation_id": self.simulation_id, "time_step": self.time_step}


@dataclass(slots=True, eq=False)
class _Held:
    sample: Sample
    users: int = 0  # windows in the buffer that span it


@dataclass(slots=True, eq=False)
class _Timeline:
    """One simulation on this rank: its steps held, its first and last steps received, the window starts made."""

    first: int
    last: int
    steps: dict[int, _Held] = field(default_factory=dict)
    made: bytearray = field(default_factory=bytearray)  # bit a // stride: the window starting at a was made here
    ended: bool = False


class WindowStore:
    """The steps behind a buffer's windows; not thread-safe: the buffer calls it under its lock."""

    def __init__(self, windowing: Windowing) -> None:
        self.windowing = windowing
        self.held = 0  # steps
        self.nbytes = 0
        self._timelines: dict[int, _Timeline] = {}
        self._ended: set[int] = set()  # simulations whose timeline left: a step of theirs still coming makes nothing

    # -------------------------------------------------------------- stream
    def add(self, sample: Sample) -> list[Window]:
        """Hold a step; the windows it completes."""
        sim, step = sample.simulation_id, sample.time_step
        timeline = self._timelines.get(sim)
        if timeline is None:
            if sim in self._ended:  # put while the news of its end came (a failed simulation's last step)
                return []
            timeline = self._timelines[sim] = _Timeline(step, step)
        timeline.first, timeline.last = min(timeline.first, step), max(timeline.last, step)
        if step in timeline.steps:  # a second copy (a resend after a restart): the first serves
            return []
        timeline.steps[step] = _Held(sample)
        self.held += 1
        self.nbytes += sample.nbytes
        made = [
            self._make(sim, timeline, start)
            for start in self._starts(timeline, sim, step)
            if self._complete(timeline, start)
        ]
        for near in range(step - self.windowing.length + 1, step + 1):
            self._free_if_unneeded(sim, timeline, near)
        return made

    def release(self, windows: Iterable[Window]) -> None:
        """Windows left the buffer: their steps no other window holds or may need leave."""
        length = self.windowing.length
        for window in windows:
            sim = window.simulation_id
            timeline = self._timelines[sim]
            steps = timeline.steps
            for step in range(window.time_step, window.time_step + length):
                held = steps[step]
                held.users -= 1
                if not held.users and (timeline.ended or not self._needed(sim, timeline, step)):
                    del steps[step]
                    self.held -= 1
                    self.nbytes -= held.sample.nbytes
            self._drop_if_done(sim, timeline)

    def frees(self, window: Window) -> int:
        """The steps that would leave with the window."""
        timeline = self._timelines[window.simulation_id]
        return sum(
            timeline.steps[step].users == 1 and not self._needed(window.simulation_id, timeline, step)
            for step in range(window.time_step, window.time_step + self.windowing.length)
        )

    def end(self, simulation_id: int) -> None:
        """The simulation ended (done or failed): no window of it is made any more."""
        timeline = self._timelines.get(simulation_id)
        if timeline is None:
            return
        timeline.ended = True
        if not any(timeline.made) and timeline.first < self.windowing.length and timeline.steps:
            logger.warning(
                "simulation %d: its steps %d to %d make no window of %d steps (training.window): none is trained",
                simulation_id,
                timeline.first,
                timeline.last,
                self.windowing.length,
            )
        self._sweep(simulation_id, timeline)

    def end_all(self) -> None:
        """The data ended: what no window holds leaves."""
        for sim in list(self._timelines):
            self.end(sim)

    def lacks(self, simulation_id: int, steps: np.ndarray) -> np.ndarray:
        """Which of ``steps`` (received) a window that may still be made here needs but this rank does not hold:
        after a restart on another number of ranks, those must be received again."""
        timeline = self._timelines.get(simulation_id)
        if timeline is None:
            return np.zeros(len(steps), dtype=bool)
        return np.array(
            [int(s) not in timeline.steps and self._needed(simulation_id, timeline, int(s)) for s in steps], dtype=bool
        )

    # ------------------------------------------------------------- windows
    def _starts(self, timeline: _Timeline, sim: int, step: int) -> list[int]:
        """The starts of the windows ``step`` is in that this rank makes and has not made."""
        stride, owns = self.windowing.stride, self.windowing.owns
        lowest = max(step - self.windowing.length + 1, timeline.first, 0)
        first = -(-lowest // stride) * stride
        return [a for a in range(first, step + 1, stride) if owns(sim, a) and not self._was_made(timeline, a)]

    def _complete(self, timeline: _Timeline, start: int) -> bool:
        steps = timeline.steps
        return all(s in steps for s in range(start, start + self.windowing.length))

    def _make(self, sim: int, timeline: _Timeline, start: int) -> Window:
        """A new window, marked made."""
        index = start // self.windowing.stride
        if len(timeline.made) <= index >> 3:
            timeline.made.extend(bytes((index >> 3) + 1 - len(timeline.made)))
        timeline.made[index >> 3] |= 1 << (index & 7)
        return self._window(sim, timeline, start)

    def _window(self, sim: int, timeline: _Timeline, start: int) -> Window:
        """The window at ``start``, held by the buffer: its steps count one user more."""
        held = [timeline.steps[s] for s in range(start, start + self.windowing.length)]
        for step in held:
            step.users += 1
        samples = tuple(step.sample for step in held)
        return Window(sim, start, samples[0].parameters, samples)

    def _was_made(self, timeline: _Timeline, start: int) -> bool:
        index = start // self.windowing.stride
        return index >> 3 < len(timeline.made) and bool(timeline.made[index >> 3] >> (index & 7) & 1)

    def _needed(self, sim: int, timeline: _Timeline, step: int) -> bool:
        """Whether a window this rank may still make spans ``step``."""
        return not timeline.ended and bool(self._starts(timeline, sim, step))

    def _free_if_unneeded(self, sim: int, timeline: _Timeline, step: int) -> None:
        held = timeline.steps.get(step)
        if held is not None and held.users == 0 and not self._needed(sim, timeline, step):
            del timeline.steps[step]
            self.held -= 1
            self.nbytes -= held.sample.nbytes

    def _sweep(self, sim: int, timeline: _Timeline) -> None:
        """Every step of the timeline that nothing holds or needs leaves, and the timeline with the last if done."""
        for step in list(timeline.steps):
            self._free_if_unneeded(sim, timeline, step)
        self._drop_if_done(sim, timeline)

    def _drop_if_done(self, sim: int, timeline: _Timeline) -> None:
        """An ended simulation's timeline leaves with its last step (its frames are refused from now on)."""
        if timeline.ended and not timeline.steps:
            del self._timelines[sim]
            self._ended.add(sim)

    # ---------------------------------------------------------- checkpoint
    def state(self) -> dict[str, Any]:
        """The steps held (each once) and each simulation's timeline; the windows are the buffer's entries."""
        return {
            "steps": [held.sample.state() for timeline in self._timelines.values() for held in timeline.steps.values()],
            "timelines": {sim: (t.first, t.last, bytes(t.made), t.ended) for sim, t in self._timelines.items()},
        }

    def load(self, state: dict[str, Any], starts: Sequence[tuple[int, int]]) -> list[Window]:
        """Replace everything with ``state``; the windows at ``starts`` (simulation, first step), remade from its
        steps, in that order."""
        self.held, self.nbytes = 0, 0
        self._timelines = {
            sim: _Timeline(first, last, made=bytearray(made), ended=ended)
            for sim, (first, last, made, ended) in state["timelines"].items()
        }
        for entry in state["steps"]:
            sample = Sample.from_state(entry)
            self._timelines[sample.simulation_id].steps[sample.time_step] = _Held(sample)
            self.held += 1
            self.nbytes += sample.nbytes
        windows = []
        for sim, start in starts:
            timeline = self._timelines[sim]
            windows.append(self._window(sim, timeline, start))
        for sim, timeline in list(self._timelines.items()):
            self._sweep(sim, timeline)
        return windows

    def make_complete(self) -> list[Window]:
        """The windows this rank owns whose steps it holds whole but that no rank made: after a restart on another
        number of ranks, the steps of one may come from two old ranks."""
        made = []
        for sim, timeline in self._timelines.items():
            starts = sorted({a for step in timeline.steps for a in self._starts(timeline, sim, step)})
            made += [self._make(sim, timeline, a) for a in starts if not timeline.ended and self._complete(timeline, a)]
        return made

    def resharded(self, olds: Sequence[dict[str, Any]]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """This rank's store state and window entries, from the buffers of a checkpoint of another number of
        ranks (``olds``, their states): the windows whose start it owns now, each simulation's timeline joined
        (the window starts made anywhere, its first and last steps), and every step those windows or the ones
        still to be made here span."""
        timelines: dict[int, tuple[int, int, bytes, bool]] = {}
        for old in olds:
            for sim, (first, last, made, ended) in old["windows"]["timelines"].items():
                if sim in timelines:
                    f, la, m, e = timelines[sim]
                    joined = bytes(a | b for a, b in zip(m.ljust(len(made), b"\0"), made.ljust(len(m), b"\0")))
                    timelines[sim] = (min(f, first), max(la, last), joined, e or ended)
                else:
                    timelines[sim] = (first, last, bytes(made), ended)
        entries = [e for old in olds for e in old["entries"] if self.windowing.owns(e["simulation_id"], e["time_step"])]
        spanned = {(e["simulation_id"], e["time_step"] + i) for e in entries for i in range(self.windowing.length)}
        probe = WindowStore(self.windowing)
        probe.load({"steps": [], "timelines": timelines}, [])
        steps: dict[tuple[int, int], dict[str, Any]] = {}
        for old in olds:
            for step in old["windows"]["steps"]:
                key = (step["simulation_id"], step["time_step"])
                timeline = probe._timelines.get(key[0])
                if key in spanned or (timeline is not None and probe._needed(key[0], timeline, key[1])):
                    steps.setdefault(key, step)
        return {"steps": list(steps.values()), "timelines": timelines}, entries


def stacked(windows: Sequence[Window]) -> tuple[list[Sample], list[np.ndarray]]:
    """Each window as a sample whose fields are its steps' stacked along a leading time axis, and the arrays those
    fields are views of: one per field, ``[windows, length, ...]``, made with one copy of the steps."""
    first = windows[0]
    count, length = len(windows), len(first.steps)
    names = list(first.steps[0].fields)
    owners = [np.array([step.fields[name] for window in windows for step in window.steps]) for name in names]
    arrays = [owner.reshape(count, length, *owner.shape[1:]) for owner in owners]
    nbytes = first.parameters.nbytes + sum(owner.nbytes for owner in owners) // count
    samples = [
        Sample(w.simulation_id, w.time_step, w.parameters, {name: a[i] for name, a in zip(names, arrays)}, nbytes)
        for i, w in enumerate(windows)
    ]
    return samples, owners


def windows_of(steps: Iterable[Sample], length: int, stride: int) -> list[Window]:
    """Every window of ``length`` consecutive steps, starting at multiples of ``stride``, that ``steps`` (each
    simulation's, in any order, a step given twice counted once) hold whole: a held-out set's windows."""
    by_simulation: dict[int, dict[int, Sample]] = {}
    for sample in steps:
        by_simulation.setdefault(sample.simulation_id, {}).setdefault(sample.time_step, sample)
    windows = []
    for sim in sorted(by_simulation):
        held = by_simulation[sim]
        for start in range(-(-min(held) // stride) * stride, max(held) - length + 2, stride):
            if all(s in held for s in range(start, start + length)):
                samples = tuple(held[s] for s in range(start, start + length))
                windows.append(Window(sim, start, samples[0].parameters, samples))
    return windows
