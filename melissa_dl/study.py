"""Rank 0's study bookkeeping: which simulation runs, is done or failed, and why.

A simulation is done only when every server rank holds every step its client
ranks announced in their finalize messages; its process's exit code alone
never makes it done. A simulation that exits non-zero, exits with steps
missing, exits 0 without finalizing (after ``EXIT_GRACE`` seconds in which
its last frames could still be on their way), or sends nothing for
``simulation_timeout`` seconds while the server was ready to read is killed
and relaunched until ``max_retries`` is spent, then reported failed with the
reason. A simulation refused for a reason that a relaunch would meet again
(wrong field layout, wrong client size) fails at once (:meth:`Study.fail`).

The ranks follow the study through :meth:`Study.take_news`: each new attempt
(so that they refuse the frames of the one it replaced) and each simulation
that ended (so that they free what its unfinished steps hold).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Sequence

from launcher import Launcher
from melissa_dl.assembly import Progress
from melissa_dl.receiver import ReceiverReport

logger = logging.getLogger(__name__)

EXIT_GRACE = 5.0  # seconds a simulation that exited 0 has for its finalize messages to be counted


class State(str, Enum):
    QUEUED = "queued"  # submitted, waiting for a free job slot
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


@dataclass
class Simulation:
    id: int
    ranks: int
    state: State = State.QUEUED
    attempts: int = 0  # launches so far
    failures: int = 0  # attempts that failed (a relaunch after a server restart is not one)
    exit_code: int | None = None  # of the last attempt's process, once it ended
    last_activity: float | None = None  # when the last frame arrived, or the job started
    reason: str = ""  # why the last attempt failed
    progress: list[Progress] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.progress = [Progress(0, None) for _ in range(self.ranks)]

    @property
    def received(self) -> int:
        return sum(p.received for p in self.progress)

    @property
    def announced(self) -> bool:
        """Every rank got the finalize messages of every client rank."""
        return all(p.expected is not None for p in self.progress)

    @property
    def complete(self) -> bool:
        return self.announced and all(p.received >= p.expected for p in self.progress)  # type: ignore[operator]


class Study:
    """Drives the simulations through the launcher; ``tick`` is called periodically."""

    def __init__(
        self,
        simulations: int,
        server_size: int,
        launcher: Launcher,
        environment: Callable[[int, int], dict[str, str]],
        expect: Callable[[int, int | None], None],
        max_retries: int,
        timeout: float,
    ) -> None:
        self.simulations = [Simulation(s, server_size) for s in range(simulations)]
        self._launcher = launcher
        self._environment = environment
        self._expect = expect
        self._max_retries = max_retries
        self._timeout = timeout
        self._attempts_started: dict[int, int] = {}
        self._ended: list[int] = []

    def start(self) -> None:
        """Launch every simulation that is not done or failed (after ``load_state_dict``: the unfinished ones)."""
        for sim in self.simulations:
            if sim.state not in (State.DONE, State.FAILED):
                self._launch(sim)

    def load_state_dict(self, state: Sequence[dict[str, Any]]) -> None:
        """Before ``start``, after a restart: each simulation's attempts and failures, and which ones ended."""
        for sim, saved in zip(self.simulations, state):
            sim.attempts, sim.failures = saved.get("attempts", 0), saved.get("failures", 0)
            sim.reason = saved.get("reason", "")
            if saved.get("state") in (State.DONE, State.FAILED):
                sim.state = State(saved["state"])

    def state_dict(self) -> list[dict[str, Any]]:
        """What a restart needs: done and failed simulations stay so, the others run again.

        A queued attempt never ran, so it is not counted: the restart submits it again under its number.
        """
        return [{"state": s.state.value, "attempts": s.attempts - (s.state is State.QUEUED), "failures": s.failures,
                 "reason": s.reason} for s in self.simulations]

    def _launch(self, sim: Simulation) -> None:
        sim.state = State.QUEUED
        sim.exit_code = None
        # the new attempt announces its steps anew; a stale announcement could fail it before its frames are read
        sim.progress = [Progress(p.received, None) for p in sim.progress]
        sim.last_activity = None
        self._expect(sim.id, sim.attempts)
        self._attempts_started[sim.id] = sim.attempts
        self._launcher.submit(sim.id, sim.attempts, self._environment(sim.id, sim.attempts))
        sim.attempts += 1

    def _end(self, sim: Simulation, state: State) -> None:
        sim.state = state
        self._expect(sim.id, None)
        self._ended.append(sim.id)

    def take_news(self) -> tuple[dict[int, int], list[int]]:
        """Attempts started and simulations ended since the last call, for every rank's receiver."""
        news = self._attempts_started, self._ended
        self._attempts_started, self._ended = {}, []
        return news

    def fail(self, simulation_id: int, reason: str) -> None:
        """Fail a running simulation now: a relaunch would meet the same ``reason``."""
        sim = self.simulations[simulation_id]
        if sim.state not in (State.QUEUED, State.RUNNING):
            return
        self._launcher.kill(sim.id)
        sim.reason = reason
        sim.failures += 1
        self._end(sim, State.FAILED)
        logger.error("simulation %d failed at attempt %d, not retried: %s", sim.id, sim.attempts - 1, reason)

    def tick(self, reports: Sequence[ReceiverReport], now: float | None = None) -> None:
        """Merge the ranks' reports, reap jobs and decide each running simulation's fate."""
        now = time.monotonic() if now is None else now
        backpressure = any(r.blocked for r in reports)
        for rank, report in enumerate(reports):
            for sid, progress in report.progress.items():
                self.simulations[sid].progress[rank] = progress
            for sid in report.active:
                self.simulations[sid].last_activity = now
        for sid, code in self._launcher.poll():
            self.simulations[sid].exit_code = code
        running = self._launcher.running()
        for sim in self.simulations:
            if sim.state is State.DONE and sim.id in running and now - sim.last_activity > self._timeout:
                self._launcher.kill(sim.id)  # all its data is in; do not let a hung exit block the study
            if sim.state not in (State.QUEUED, State.RUNNING):
                continue
            if sim.complete:
                if sim.state is State.QUEUED:
                    self._launcher.drop_unstarted(sim.id)  # a relaunch made useless by late frames of the last one
                self._end(sim, State.DONE)
                sim.last_activity = now
                logger.info("simulation %d done (%d steps, attempt %d)", sim.id, sim.received, sim.attempts - 1)
                continue
            if sim.state is State.QUEUED:
                if sim.id not in running and sim.exit_code is None:
                    continue  # still waiting for a job slot (a job that could not start has an exit code)
                sim.state = State.RUNNING
                sim.last_activity = now  # the timeout clock starts with the job
            if backpressure:
                sim.last_activity = now  # a stalled server is not the simulation's fault
            if sim.exit_code not in (None, 0):
                self._retry(sim, f"exit code {sim.exit_code}{self._launcher.output_tail(sim.id, sim.attempts - 1)}")
            elif sim.exit_code == 0 and sim.announced:
                self._retry(sim, "exited with steps missing")
            elif sim.exit_code == 0 and now - sim.last_activity > EXIT_GRACE:  # type: ignore[operator]
                self._retry(sim, "exited 0 without finalize")
            elif now - sim.last_activity > self._timeout:  # type: ignore[operator]
                self._launcher.kill(sim.id)
                self._retry(sim, f"no data for {self._timeout:g} s")

    def _retry(self, sim: Simulation, reason: str) -> None:
        sim.reason = reason
        sim.failures += 1
        if sim.failures > self._max_retries:
            self._end(sim, State.FAILED)
            logger.error("simulation %d failed after %d attempts: %s", sim.id, sim.attempts, reason)
            return
        logger.warning("simulation %d attempt %d: %s; relaunching", sim.id, sim.attempts - 1, reason)
        self._launch(sim)

    @property
    def over(self) -> bool:
        """Every simulation is done or failed and no job is left running."""
        return all(s.state in (State.DONE, State.FAILED) for s in self.simulations) and not self._launcher.running()

    def counts(self) -> dict[str, int]:
        counts = {state.value: 0 for state in State}
        for sim in self.simulations:
            counts[sim.state.value] += 1
        return counts
