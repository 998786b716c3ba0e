"""Rank 0's study bookkeeping: which simulation runs, is done or failed, and why.

A simulation is done only when every server rank holds every step its client
ranks announced in their finalize messages; its process's exit code alone
never makes it done. A simulation that exits non-zero, exits with steps
missing, exits 0 without finalizing (after ``EXIT_GRACE`` seconds from the
round that saw it exit, in which its last frames could still be on their way
to rank 0's bookkeeping), or sends nothing for
``simulation_timeout`` seconds while the server was ready to read is killed
and relaunched until ``max_retries`` is spent, then reported failed with the
reason. A simulation whose failure a relaunch would meet again fails at once:
refused at the handshake for its field layout or client size
(:meth:`Study.fail`), a program that cannot run (exit code 126 or 127), frames
refused for what they hold (dtype, shape, unknown field, NaN), or a client
usage error (``ClientError``, the last line the program wrote, before what srun or
mpirun add). An attempt that
exited 0 with frames refused for what they hold (dtype, shape, unknown
field, NaN) failed for them, and a relaunch would send them again. Every failure
reason carries the end of the attempt's output and its log's path. If no
simulation succeeds among the first to end (the first wave of ``job_limit``,
at least ``GIVE_UP_AFTER``), the study launches nothing more: the rest would
fail the same way.

Parameters are asked of the study's sampler (:mod:`launcher.samplers`) as
the study goes, keeping one wave (``job_limit`` simulations) drawn ahead of
the running ones, so that only simulations not yet started get what a
learning sampler learnt. A simulation is launched only in the round after
its parameters were drawn: by then every rank knows them, so no frame can
arrive at a rank that does not know what to attach to it. When the sampler
learns, each done simulation's loss statistic is told to it once every step
it sent has its loss (:mod:`melissa_dl.study.learning`); a failed one is told
None. Should the sampler wait for statistics while nothing runs and no new
loss has come for ``LEARNING_GRACE`` seconds (training cannot go on: a rank
below its buffer's watermark, say), the done simulations are told what they
have, so that the study never stalls.

The ranks follow the study through :meth:`Study.take_news`: each new attempt
(so that they refuse the frames of the one it replaced), each simulation
that ended (so that they free what its unfinished steps hold) and the
parameters drawn since the last round.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

import numpy as np

from launcher import NOT_RUNNABLE, Launcher, Sampler, program_last_line
from melissa_dl.ingest.assembly import Progress
from melissa_dl.ingest.handshake import DETERMINISTIC
from melissa_dl.ingest.receiver import ReceiverReport
from melissa_dl.study.learning import Records, SimulationLosses
from melissa_dl.study.sampling import DRAWN_AHEAD, held_out_table
from melissa_dl.wire import client
from melissa_dl.wire.security import Security

if TYPE_CHECKING:
    from melissa_dl.config.sections import LauncherConfig, StudyConfig
    from melissa_dl.runtime.metrics import Metrics

logger = logging.getLogger(__name__)

EXIT_GRACE = 5.0  # seconds a simulation that exited 0 has for its finalize messages to be counted
INTERRUPTED = "(a crash, a kill or a stop)"  # what may have ended the server's run while a simulation ran
REPEATED_REFUSALS = DETERMINISTIC | {"non_finite", "time_step", "undeclared", "order"}  # kinds a relaunch sends again
LEARNING_GRACE = 5.0  # seconds without a new loss, nothing running, before a waiting sampler gets partial statistics
GIVE_UP_AFTER = 3  # failed simulations, and no success, before the study stops (at least the first wave's)
CLIENT_ERROR = "ClientError"  # in the program's last line of an attempt's output: a mistake in its use of the API


@dataclass(frozen=True)
class Generation:
    """A generation drawn by a sampler that breeds, and what was known when it was drawn (its picture)."""

    number: int
    bred_fraction: float
    names: list[str]  # of the one or two parameters pictured
    drawn: np.ndarray  # [members, 1 or 2]: its simulations' parameters
    bred: np.ndarray  # [members]: which of them were bred
    known: np.ndarray  # [n, 1 or 2]: the simulations with a statistic then
    statistics: np.ndarray  # [n]: theirs

    def write(self, metrics: Metrics) -> None:
        """Its bred fraction and its picture (``plots.generation``), on TensorBoard."""
        from melissa_dl.study.plots import generation

        metrics.scalar("sampling/bred_fraction", self.bred_fraction, self.number)
        metrics.figure(
            "sampling/generations",
            lambda: generation(
                self.number, self.bred_fraction, self.names, self.drawn, self.bred, self.known, self.statistics
            ),
            self.number,
        )


class State(str, Enum):
    QUEUED = "queued"  # submitted, waiting for a free job slot
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


NOTHING_YET = Progress(0, None)


@dataclass(slots=True)  # a study builds one per declared simulation at its start: 10^5 of them
class Simulation:
    id: int
    ranks: int
    state: State = State.QUEUED
    attempts: int = 0  # launches so far
    failures: int = 0  # attempts that failed (a relaunch after a server restart is not one)
    exit_code: int | None = None  # of the last attempt's process, once it ended
    last_activity: float | None = None  # when the last frame arrived, or the job started
    reason: str = ""  # why the last attempt failed
    log: str = ""  # that attempt's log file
    output: str = ""  # the end of that log: the simulation's own error, usually
    refused: tuple[str, str] | None = None  # kind and message of the running attempt's first refused frame
    steps: int = 0  # steps it sent, once done: what its loss statistic waits for
    statistic: float | None = None  # its loss statistic, once told to the sampler
    progress: list[Progress] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.progress = [NOTHING_YET] * self.ranks

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
    """Drives the simulations through the launcher; ``tick`` is called periodically.

    A tick visits the running simulations and those that something happened
    to, not the whole study: the ranks wait for it, and a study may declare
    10^5 simulations.
    """

    def __init__(
        self,
        simulations: int,
        server_size: int,
        launcher: Launcher,
        sampler: Sampler,
        environment: Callable[[int, int, np.ndarray], dict[str, str]],
        expect: Callable[[int, int | None], None],
        max_retries: int,
        timeout: float,
        job_limit: int,
        names: Sequence[str] = (),
        statistic: str = "mean",
        plotted: Sequence[int] = (0, 1),
        held_out: np.ndarray | None = None,
    ) -> None:
        held_out = np.empty((0, sampler.low.size)) if held_out is None else held_out
        self.trained = simulations  # the simulations trained on; the held-out ones follow them
        self.simulations = [Simulation(s, server_size) for s in range(simulations + len(held_out))]
        self.sampler = sampler
        self.parameters = np.concatenate([np.full((simulations, sampler.low.size), np.nan), held_out])
        self.names = list(names) or [str(i) for i in range(sampler.low.size)]
        self.losses = SimulationLosses(statistic)
        self._job_limit = job_limit
        self._unsent: list[int] = []  # parameters drawn, for the ranks in the next news
        self._sent: list[int] = []  # parameters the ranks got in the last news: launched at the next tick
        self._untold: set[int] = set()  # done, statistic not yet told to a sampler that learns
        self._learning = True  # losses came since the last tick (at first: the grace counts from the first tick)
        self._learnt_at = 0.0  # when losses last came
        self._plotted = [i for i in plotted if i < sampler.low.size]
        self._pictured = 0  # generations taken by take_generations
        self._running: dict[int, Simulation] = {}
        self._counts = dict.fromkeys(State, 0) | {State.QUEUED: len(self.simulations)}
        self._launcher = launcher
        self._environment = environment
        self._expect = expect
        self._max_retries = max_retries
        self._timeout = timeout
        self._give_up_after = min(max(job_limit, GIVE_UP_AFTER), len(self.simulations))
        self.gave_up = ""  # why the study stopped before every simulation ran, if it did
        self.first_start: float | None = None  # when this run's first job started: the time left counts from it
        self._interrupted: list[int] = []  # restored simulations that ran when the last run ended
        self._attempts_started: dict[int, int] = {}
        self._ended: list[int] = []
        self._announced: dict[Progress, Progress] = {}  # see _kept

    @classmethod
    def from_config(
        cls,
        study: StudyConfig,
        launching: LauncherConfig,
        server_size: int,
        launcher: Launcher,
        sampler: Sampler,
        environment: Callable[[int, int, np.ndarray], dict[str, str]],
        expect: Callable[[int, int | None], None],
    ) -> Study:
        """The study of the ``study`` section, its attempts bounded by the ``launcher`` section (``launching``)."""
        return cls(
            study.simulations,
            server_size,
            launcher,
            sampler,
            environment,
            expect,
            launching.max_retries,
            launching.simulation_timeout,
            launching.job_limit,
            study.parameter_names,
            study.loss_statistic,
            study.plotted(),
            held_out_table(study),
        )

    def start(self) -> None:
        """After ``load_state_dict``: the unfinished simulations whose parameters were drawn run again, the
        held-out ones first (the validation loss needs all of them), once the ranks have their parameters (the
        next news)."""
        unfinished = [*self.simulations[self.trained :], *self.simulations[: self.sampler.drawn]]
        self._unsent = [s.id for s in unfinished if s.state not in (State.DONE, State.FAILED)]
        if self._interrupted:
            logger.info(
                "%d simulations ran when the server's last run ended: relaunched (simulation %d first)",
                len(self._interrupted),
                self._interrupted[0],
            )

    @property
    def held_out_ended(self) -> bool:
        """Every held-out simulation is done or failed: the validation set is whole (False if there is none)."""
        held_out = self.simulations[self.trained :]
        return bool(held_out) and all(s.state in (State.DONE, State.FAILED) for s in held_out)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Before ``start``, after a restart: each simulation's attempts and failures, and which ones ended; the
        sampler, the parameters drawn and what was learnt."""
        self.sampler.load_state_dict(state["sampler"])
        self._pictured = sum(r.stop <= self.sampler.drawn for r, _ in self.sampler.generations().values())  # pictured
        self.parameters[:] = state["parameters"]
        self.losses.load_state_dict(state["losses"])
        for sim, saved in zip(self.simulations, state["simulations"]):
            sim.attempts, sim.failures = saved.get("attempts", 0), saved.get("failures", 0)
            sim.reason, sim.log, sim.output = saved.get("reason", ""), saved.get("log", ""), saved.get("output", "")
            if saved.get("state") in (State.DONE, State.FAILED):
                self._set_state(sim, State(saved["state"]))
            elif saved.get("state") == State.RUNNING and sim.attempts:  # not one waiting for its retry
                sim.reason = f"relaunched: the server's run ended while attempt {sim.attempts - 1} ran {INTERRUPTED}"
                self._interrupted.append(sim.id)
            sim.steps, sim.statistic = saved.get("steps", 0), self.losses.final.get(sim.id)
            if sim.state is State.DONE and self._learns_from(sim) and sim.id not in self.losses.final:
                self._untold.add(sim.id)

    def state_dict(self) -> dict[str, Any]:
        """What a restart needs: done and failed simulations stay so, the others run again; the sampler and what
        it was told.

        A queued attempt never ran, so it is not counted: the restart submits it again under its number.
        """
        return {
            "simulations": [
                {
                    "state": s.state.value,
                    "attempts": s.attempts - (s.state is State.QUEUED and s.attempts > 0),
                    "failures": s.failures,
                    "reason": s.reason,
                    "log": s.log,
                    "output": s.output,
                    "steps": s.steps,
                }
                for s in self.simulations
            ],
            "sampler": self.sampler.state_dict(),
            "parameters": self.parameters.copy(),
            "losses": self.losses.state_dict(),
        }

    def _set_state(self, sim: Simulation, state: State) -> None:
        self._counts[sim.state] -= 1
        self._counts[state] += 1
        sim.state = state
        if state is State.RUNNING:
            self._running[sim.id] = sim
        else:
            self._running.pop(sim.id, None)

    def _launch(self, sim: Simulation) -> None:
        self._set_state(sim, State.QUEUED)
        sim.exit_code = None
        # the new attempt announces its steps anew; a stale announcement could fail it before its frames are read
        for rank, progress in enumerate(sim.progress):
            if progress.expected is not None:
                sim.progress[rank] = Progress(progress.received, None)
        sim.last_activity = None
        sim.refused = None
        self._expect(sim.id, sim.attempts)
        self._attempts_started[sim.id] = sim.attempts
        row = self.parameters[sim.id]
        named = dict(zip(self.names, row.tolist()))
        self._launcher.submit(sim.id, sim.attempts, self._environment(sim.id, sim.attempts, row), named)
        sim.attempts += 1

    def _end(self, sim: Simulation, state: State) -> None:
        self._set_state(sim, state)
        self._expect(sim.id, None)
        self._ended.append(sim.id)
        if state is State.DONE:
            sim.steps = sim.received
            if self._learns_from(sim):
                self._untold.add(sim.id)
        elif sim.id < self.trained:  # the sampler drew it
            self.losses.forget(sim.id)  # nothing of a failed simulation is a parent
            self.sampler.tell(sim.id, None)

    def _learns_from(self, sim: Simulation) -> bool:
        """Whether the sampler learns from this simulation's losses: one it drew, when it learns."""
        return self.sampler.learns and sim.id < self.trained

    def take_news(self) -> tuple[dict[int, int], list[int], dict[int, np.ndarray]]:
        """Attempts started, simulations ended and parameters drawn since the last call, for every rank's
        receiver."""
        news = self._attempts_started, self._ended, {s: self.parameters[s] for s in self._unsent}
        self._sent += self._unsent
        self._attempts_started, self._ended, self._unsent = {}, [], []
        return news

    def learn(self, records: Sequence[Records]) -> None:
        """The ranks' losses per sample since the last round."""
        for part in records:
            self._learning |= len(part[0]) > 0
            self.losses.add(part)

    def _tell_finished(self, all_now: bool = False) -> None:
        """Tell the sampler the statistic of every done simulation whose steps all have their loss (``all_now``:
        of every done one, with what it has)."""
        for sid in sorted(self._untold):
            sim = self.simulations[sid]
            if all_now or self.losses.seen(sid) >= sim.steps:
                sim.statistic = self.losses.reduce(sid)
                self.sampler.tell(sid, sim.statistic)
                self._untold.discard(sid)

    def conclude(self) -> None:
        """Training is over: the done simulations not yet told get the statistic of the steps it trained on (for
        the report; the last ones may not have had all their steps trained on)."""
        self._tell_finished(all_now=True)

    def _draw(self, now: float) -> None:
        """Keep one wave of simulations drawn ahead of the running ones."""
        if self.gave_up:
            return
        ahead = len(self._launcher.queued()) + len(self._unsent) + len(self._sent)
        want = DRAWN_AHEAD * self._job_limit - len(self._launcher.running()) - ahead
        if want <= 0:
            return
        rows = self.sampler.ask(want)
        if (
            not len(rows)
            and not ahead
            and not self._launcher.running()
            and self._untold
            and now - self._learnt_at >= LEARNING_GRACE
        ):
            self._tell_finished(all_now=True)  # neither simulations nor training can complete what it waits for
            rows = self.sampler.ask(want)
        first = self.sampler.drawn - len(rows)
        self.parameters[first : self.sampler.drawn] = rows
        self._unsent += range(first, self.sampler.drawn)

    def take_generations(self) -> list[Generation]:
        """The generations drawn whole since the last call, for TensorBoard (a sampler breeds a whole
        generation at once, but the study asks only for the simulations it is about to run)."""
        generations = self.sampler.generations()
        new = [g for g in sorted(generations) if g >= self._pictured and generations[g][0].stop <= self.sampler.drawn]
        self._pictured += len(new)
        known = np.array([s for s, value in self.losses.final.items() if value is not None], dtype=np.int64)
        columns = self._plotted
        return [
            Generation(
                g,
                generations[g][1],
                [self.names[i] for i in columns],
                self.parameters[list(generations[g][0])][:, columns],
                np.array([self.sampler.describe(s).get("parent") is not None for s in generations[g][0]]),
                self.parameters[known][:, columns],
                np.array([self.losses.final[s] for s in known], dtype=np.float64),
            )
            for g in new
        ]

    def describe(self, simulation: int) -> dict[str, Any]:
        """What the report says of how a simulation's parameters were chosen, and what training made of it."""
        row = self.parameters[simulation]
        named = None if np.isnan(row).any() else dict(zip(self.names, row.tolist()))
        drawn = self.sampler.describe(simulation) if simulation < self.trained else {"held_out": True}
        return {"parameters": named, **drawn, "statistic": self.simulations[simulation].statistic}

    def fail(self, simulation_id: int, reason: str) -> None:
        """Fail a running simulation now: a relaunch would meet the same ``reason``."""
        sim = self.simulations[simulation_id]
        if sim.state not in (State.QUEUED, State.RUNNING):
            return
        self._launcher.kill(sim.id)
        self._failed(sim, reason, retry=False)

    def tick(self, reports: Sequence[ReceiverReport], now: float | None = None, stopping: bool = False) -> None:
        """Merge the ranks' reports, reap jobs and decide each running simulation's fate.

        ``stopping``: the server was asked to stop. A stop sent to the whole job (``scancel``) reaches the
        simulations too, so an attempt that ends now is no failure: the checkpoint to come holds it unfinished, and
        the resumed study runs it again. Nothing new is launched either, only to be killed."""
        now = time.monotonic() if now is None else now
        for sid in [] if stopping else self._sent:  # every rank knows their parameters since the last round
            if self.simulations[sid].state is State.QUEUED:  # not given up on meanwhile
                self._launch(self.simulations[sid])
        self._sent = self._sent if stopping else []
        backpressure = self._merge(reports, now)
        ended = self._launcher.poll()
        for sid, code in ended:
            self.simulations[sid].exit_code = code
            self.simulations[sid].last_activity = now  # the grace for its last announcements starts with its exit
        running = self._launcher.running()
        for sid in running:
            sim = self.simulations[sid]
            idle = now - sim.last_activity if sim.last_activity is not None else 0.0
            if sim.state is State.DONE and idle > self._timeout:
                self._launcher.kill(sim.id)  # all its data is in; do not let a hung exit block the study
        # a queued simulation moves only when its job started or ended, or late frames of its last attempt came
        moved = running.union((sid for sid, _ in ended), (sid for report in reports for sid in report.progress))
        for sid in sorted(self._running.keys() | {s for s in moved if self.simulations[s].state is State.QUEUED}):
            sim = self.simulations[sid]
            if sim.complete:
                if sim.state is State.QUEUED:
                    self._launcher.drop_unstarted(sim.id)  # a relaunch made useless by late frames of the last one
                self._end(sim, State.DONE)
                sim.last_activity = now
                logger.info("simulation %d done (%d steps, attempt %d)", sim.id, sim.received, sim.attempts - 1)
                continue
            if not stopping:
                self._judge(sim, sim.id in running, now, backpressure)
        self._look_ahead(now)

    def _judge(self, sim: Simulation, running: bool, now: float, backpressure: bool) -> None:
        """An attempt not complete: started now, or failed by its exit or its silence."""
        if sim.state is State.QUEUED:
            if not running and sim.exit_code is None:
                return  # still waiting for a job slot (a job that could not start has an exit code)
            self._set_state(sim, State.RUNNING)
            sim.last_activity = now  # the timeout clock starts with the job
            if self.first_start is None:
                self.first_start = now
        if backpressure:
            sim.last_activity = now  # a stalled server is not the simulation's fault
        if sim.exit_code not in (None, 0):
            self._failed(sim, f"exit code {sim.exit_code}", retry=sim.exit_code not in NOT_RUNNABLE)
        elif sim.exit_code == 0 and sim.announced:
            self._failed(sim, "exited with steps missing")
        elif sim.exit_code == 0 and now - sim.last_activity > EXIT_GRACE:  # type: ignore[operator]
            self._failed(sim, "exited 0 without finalize")
        elif now - sim.last_activity > self._timeout:  # type: ignore[operator]
            self._launcher.kill(sim.id)
            self._failed(sim, f"no data for {self._timeout:g} s")

    def _look_ahead(self, now: float) -> None:
        """After a round: the sampler told what training learnt, the next simulations drawn, the study given up
        on if hopeless, and the launcher told once it is over (persistent workers end then, not with training)."""
        if self._learning:
            self._learnt_at, self._learning = now, False
        self._tell_finished()
        self._draw(now)
        self._give_up_if_hopeless()
        if self.over:
            self._launcher.finish()

    def _merge(self, reports: Sequence[ReceiverReport], now: float) -> bool:
        """What each rank received of each simulation; whether a rank's buffer made it wait."""
        for rank, report in enumerate(reports):
            for sid, progress in report.progress.items():
                self.simulations[sid].progress[rank] = self._kept(progress)
            for sid in report.active:
                self.simulations[sid].last_activity = now
            for sid, refused in report.refused.items():
                self.simulations[sid].refused = self.simulations[sid].refused or refused  # the first says most
        return any(r.blocked for r in reports)

    def _kept(self, progress: Progress) -> Progress:
        """One object per value of an announced progress, which a done simulation keeps to the end of the study
        (two objects a simulation otherwise, per rank)."""
        return self._announced.setdefault(progress, progress) if progress.expected is not None else progress

    def _failed(self, sim: Simulation, cause: str, retry: bool = True) -> None:
        """An attempt failed for ``cause``: relaunch it, unless retries are spent, the study gave up, or a relaunch
        would fail the same way (``retry`` False; an attempt that exited 0 but had frames refused for what they
        hold; a ``ClientError``)."""
        attempt = sim.attempts - 1
        sim.log, sim.output = str(self._launcher.log_path(sim.id, attempt)), self._launcher.output_tail(sim.id, attempt)
        if sim.refused is not None:
            cause += f"; its frames were refused: {sim.refused[1]}"
        refused_content = sim.exit_code == 0 and sim.refused is not None and sim.refused[0] in REPEATED_REFUSALS
        retry = retry and not refused_content and not self.gave_up and CLIENT_ERROR not in program_last_line(sim.output)
        sim.reason = f"{cause}; output ({sim.log}): {sim.output}" if sim.output else cause
        sim.failures += 1
        where = "" if sim.output else f" (log {sim.log})"
        if retry and sim.failures <= self._max_retries:
            logger.warning("simulation %d attempt %d: %s%s; relaunching", sim.id, attempt, sim.reason, where)
            self._launch(sim)
            return
        self._end(sim, State.FAILED)
        logger.error(
            "simulation %d failed %s: %s%s",
            sim.id,
            f"after {sim.attempts} attempts" if retry else f"at attempt {attempt}, not retried",
            sim.reason,
            where,
        )

    def _give_up_if_hopeless(self) -> None:
        """Launch nothing more when the first simulations to end all failed; the running ones may finish."""
        counts = self.counts()
        if self.gave_up or counts[State.DONE.value] or counts[State.FAILED.value] < self._give_up_after:
            return
        self.gave_up = f"the first {counts[State.FAILED.value]} simulations to end all failed"
        running = self._launcher.running()
        for sim in self.simulations:
            if sim.state is State.QUEUED and sim.id not in running:
                self._launcher.kill(sim.id)  # out of the queue
                sim.reason = f"not run: {self.gave_up}"
                self._end(sim, State.FAILED)
        logger.error(
            "stopping the study: %s (their reasons are above); fix the simulation and run again with --fresh",
            self.gave_up,
        )

    @property
    def over(self) -> bool:
        """Every simulation is done or failed and no job is left running."""
        return not self._counts[State.QUEUED] and not self._counts[State.RUNNING] and not self._launcher.running()

    def counts(self) -> dict[str, int]:
        return {state.value: count for state, count in self._counts.items()}

    def ending(self) -> int:
        """Running simulations whose process has ended but whose steps are not all counted yet (a round or two):
        their job slots are free, so running ones alone stay within ``job_limit``."""
        return sum(sim.exit_code is not None for sim in self._running.values())


def simulation_environment(
    options: LauncherConfig,
    endpoint: str,
    token: bytes,
    security: Security,
    simulation: int,
    attempt: int,
    parameters: np.ndarray,
    names: Sequence[str] = (),
) -> dict[str, str]:
    """What an attempt of ``simulation`` finds in its environment: where the server is, who it is, its parameters
    (after ``launcher.env``, which the launcher fills for each attempt)."""
    return {
        client.ENV_SERVER: endpoint,
        client.ENV_TOKEN: token.hex(),
        client.ENV_SIMULATION_ID: str(simulation),
        client.ENV_ATTEMPT: str(attempt),
        client.ENV_PARAMETERS: json.dumps(parameters.tolist()),
        client.ENV_PARAMETER_NAMES: json.dumps(list(names)),
        client.ENV_CLIENT_TIMEOUT: str(options.client_timeout),
        client.ENV_SEND_QUEUE_BYTES: str(options.send_queue_bytes),
        **security.client_environment(),
    }
