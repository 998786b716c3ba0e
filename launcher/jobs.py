"""Bounded, first-in first-out execution of simulation attempts for rank 0.

The server submits attempts and polls for the ones that ended; the launcher
only keeps at most ``job_limit`` of them running. Jobs die with the thread
that started them (see :mod:`launcher.schedulers`), so one long-lived thread
starts them all: the caller of :meth:`Launcher.poll`, or the launcher's own
thread (:meth:`Launcher.start_thread`), which the server uses so that a slot
freed by a simulation is taken again at once rather than at the ranks' next
bookkeeping round, which a validation, a checkpoint or the building of a
held-out set can delay by seconds.
"""

from __future__ import annotations

import errno
import heapq
import logging
import math
import re
import select
import threading
import time
from collections.abc import Mapping
from pathlib import Path

from launcher.placeholders import Placeholders
from launcher.schedulers import (
    COMMAND_LINE,
    KILL_GRACE,
    RunningJob,
    SchedulerUnavailable,
    Starter,
    open_log,
)

logger = logging.getLogger(__name__)

NOT_FOUND, NOT_EXECUTABLE = 127, 126
"""Return codes of an attempt whose program does not exist or cannot run, as a shell gives: a relaunch fails
the same way."""
NOT_RUNNABLE = (NOT_EXECUTABLE, NOT_FOUND)
START_FAILED = 125
"""Return code of an attempt that could not start for another reason (no memory, a process limit, a scheduler
that refused it): a relaunch may succeed."""
TAIL = 300
"""Characters of the end of the program's own output that go into an attempt's failure reason."""
LAUNCHER_LINE = re.compile(
    r"srun: |slurmstepd(-\S+)?: |slurm: job \S+ ended |\[(mpiexec|proxy:\S*)@|=+$|=   "
    r"|YOUR APPLICATION TERMINATED WITH THE EXIT STRING|This typically refers to a problem with your application"
    r"|Please see the FAQ page"
)
"""A line that ``srun``, ``slurmstepd``, MPICH's ``mpirun`` or the Slurm scheduler here wrote into a job's output
after the program's own: ``srun: error: node1: task 0: Exited with exit code 1``, hydra's banner for a rank killed
by a signal, ``slurm: job 1234 ended NODE_FAIL``."""
REFILL = 0.01
"""Seconds between two looks of the launcher's thread at its jobs (a submit wakes it at once)."""
UNAVAILABLE_RETRY = 2.0
"""Seconds before an attempt that the scheduler could not take (:class:`SchedulerUnavailable`) is tried again."""
UNAVAILABLE_LIMIT = 1800.0
"""Seconds in a row a scheduler may be unavailable before an attempt it cannot take fails (counted, as any start
that failed): a controller restarted or failed over is back well within them; one that is not, a study cannot
wait for."""


def program_last_line(tail: str) -> str:
    """The last line the program itself wrote, of an output tail (:meth:`Launcher.output_tail`)."""
    return next((line for line in reversed(tail.split(" | ")) if not LAUNCHER_LINE.match(line)), "")


def _last_lines(lines: list[str], limit: int) -> str:
    """The last whole ``lines`` that ``limit`` characters hold, joined by `` | ``; a last line longer than that,
    its end from a word's start."""
    kept: list[str] = []
    size = 0
    for line in reversed(lines):
        if kept and size + len(" | ") + len(line) > limit:
            break
        if len(line) > limit:
            end = line[-(limit - len("... ")) :]
            line = "... " + end[end.find(" ") + 1 :] if " " in end else end
        kept.append(line)
        size += len(line) + (len(" | ") if len(kept) > 1 else 0)
    return " | ".join(reversed(kept))


class Slots:
    """The job slots 0 to ``job_limit`` - 1: an attempt takes the lowest free one when it starts and holds it
    until its job is reaped, a killed job until it is dead (``{slot}`` of ``launcher.placeholders``)."""

    def __init__(self, count: int) -> None:
        self._free = list(range(count))  # a heap
        self._held: dict[int, int] = {}  # id() of a job -> its slot (the job is referenced while it holds one)

    def take(self) -> int:
        return heapq.heappop(self._free)

    def give_back(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def hold(self, job: RunningJob, slot: int) -> None:
        self._held[id(job)] = slot

    def release(self, job: RunningJob) -> None:
        if (slot := self._held.pop(id(job), None)) is not None:
            self.give_back(slot)


class Launcher:
    """Runs submitted attempts through ``scheduler``, at most ``job_limit`` at a time; its methods may be called
    from any thread.

    With ``placeholders`` (``launcher.command`` and ``launcher.env``), each attempt runs the command and gets the
    extra environment filled for it; without, the scheduler's own command.
    """

    def __init__(
        self, scheduler: Starter, job_limit: int, log_dir: Path, placeholders: Placeholders | None = None
    ) -> None:
        self._scheduler = scheduler
        self._job_limit = job_limit
        self._log_dir = log_dir
        self._placeholders = placeholders
        self._slots = Slots(job_limit)
        # simulation -> (attempt, env, parameters by name), in start order: a dict, so that studies of 10^5
        # simulations queue in O(1)
        self._queue: dict[int, tuple[int, dict[str, str], Mapping[str, float]]] = {}
        self._jobs: dict[int, RunningJob] = {}
        self._starting: int | None = None  # the simulation whose job is being started, outside the lock
        self._cancelled = False  # that one was killed meanwhile
        self._exits: dict[int, int] = {}  # a job's exit_fd -> its simulation
        self._polled: set[int] = set()  # simulations whose job has no exit_fd: polled at every look
        self._exit_poll = select.epoll() if hasattr(select, "epoll") else None
        self._ended: list[tuple[int, int]] = []  # (simulation, return code) of jobs reaped, until poll reports them
        self._dying: list[tuple[RunningJob, float]] = []  # killed jobs, and when they get SIGKILL
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False  # shut down: nothing starts any more
        self._finished = False  # the scheduler closed too: the thread ends
        self._hold_until = 0.0  # no start before then: the scheduler was unavailable
        self._unavailable_since: float | None = None  # since when the scheduler takes no attempt
        self._unavailable_said = -math.inf  # when the launcher last said so

    def start_thread(self) -> None:
        """From now on the launcher's own thread starts and reaps the jobs, every :data:`REFILL` seconds and at
        each submit; :meth:`poll` only reports. It lives until :meth:`shutdown`, as the jobs it starts do."""
        self._thread = threading.Thread(target=self._refill_until_shutdown, name="launcher", daemon=True)
        self._thread.start()

    def _refill_until_shutdown(self) -> None:
        while True:
            self._wake.wait(REFILL)
            self._wake.clear()
            with self._lock:
                if self._finished:
                    return
            self._reap_and_start()

    def submit(
        self, simulation_id: int, attempt: int, env: dict[str, str], parameters: Mapping[str, float] | None = None
    ) -> None:
        """Queue an attempt, started when a slot is free.

        ``env`` is added to the child's environment, after ``launcher.env``;
        ``parameters`` (by name) fill the placeholders. A simulation has at
        most one attempt running or queued: the server retries only after it
        saw the previous attempt end.
        """
        with self._lock:
            assert simulation_id not in self._jobs and simulation_id not in self._queue, simulation_id
            self._queue[simulation_id] = (attempt, env, parameters or {})
        self._wake.set()

    def poll(self) -> list[tuple[int, int]]:
        """Report ``(simulation_id, returncode)`` of jobs ended since the last call; without the launcher's thread,
        reap the jobs and fill free slots first.

        An attempt that cannot even be started (e.g. its command does not
        exist, sbatch refuses it) is reported here too, with
        :data:`NOT_FOUND`, :data:`NOT_EXECUTABLE` or :data:`START_FAILED`, so that the server handles it like any other
        failed attempt; the error is written to its log, so that its failure
        reason says why.
        """
        if self._thread is None:
            self._reap_and_start()
        with self._lock:
            ended, self._ended = self._ended, []
            return ended

    def _reap_and_start(self) -> None:
        """Reap the jobs that ended, then start queued ones into the free slots, each outside the lock: a wave
        of starts (a fork and exec each, writing the log's first line) must not hold up the server's calls."""
        with self._lock:
            self._reap()
        while (picked := self._next_to_start()) is not None:
            simulation_id, attempt, env, parameters, slot = picked
            log_path = self.log_path(simulation_id, attempt)
            job: RunningJob | None = None
            error: OSError | None = None
            try:
                job = self._start(simulation_id, attempt, env, parameters, slot, log_path)
                self._unavailable_since = None
            except SchedulerUnavailable as unavailable:
                if self._wait_for_scheduler(simulation_id, attempt, unavailable):
                    self._hold(simulation_id, attempt, env, parameters, slot)
                    return
                error = unavailable
            except OSError as failure:
                error = failure
            if error is not None:
                logger.error("simulation %d attempt %d could not start: %s", simulation_id, attempt, error)
                with open_log(log_path) as log:
                    log.write(f"could not start: {error}\n".encode())
            with self._lock:
                self._starting = None
                if job is None:
                    self._slots.give_back(slot)
                    if not self._cancelled:
                        self._ended.append((simulation_id, _start_failure_code(error)))  # type: ignore[arg-type]
                else:
                    self._slots.hold(job, slot)
                    if self._cancelled or self._closed:  # killed, or the launcher shut down, while it started
                        job.terminate()
                        self._dying.append((job, time.monotonic() + KILL_GRACE))
                    else:
                        self._register(simulation_id, job, log_path)
                self._cancelled = False
            if self._closed:
                self._finish_dying_now()

    def _start(
        self,
        simulation_id: int,
        attempt: int,
        env: dict[str, str],
        parameters: Mapping[str, float],
        slot: int,
        log_path: Path,
    ) -> RunningJob:
        """Start an attempt in ``slot``: its command and ``launcher.env`` filled, if the launcher has them (a
        command without placeholders is left to the scheduler, as a scheduler written before them expects)."""
        if self._placeholders is None:
            return self._scheduler.start(simulation_id, attempt, env, log_path)
        command, extra = self._placeholders.fill(simulation_id, attempt, slot, parameters)
        if command == self._placeholders.command:
            return self._scheduler.start(simulation_id, attempt, {**extra, **env}, log_path)
        return self._scheduler.start(simulation_id, attempt, {**extra, **env}, log_path, command)

    def _wait_for_scheduler(self, simulation_id: int, attempt: int, unavailable: OSError) -> bool:
        """Whether to wait for a scheduler that cannot take attempts now: until it has been so for
        :data:`UNAVAILABLE_LIMIT` seconds in a row; said once a minute."""
        now = time.monotonic()
        if self._unavailable_since is None:
            self._unavailable_since, self._unavailable_said = now, -math.inf
        if now - self._unavailable_since > UNAVAILABLE_LIMIT:
            return False
        if now - self._unavailable_said >= 60:
            self._unavailable_said = now
            logger.warning(
                "simulation %d attempt %d not started yet, trying again every %.0f s (for %.0f s more at most): %s",
                simulation_id,
                attempt,
                UNAVAILABLE_RETRY,
                UNAVAILABLE_LIMIT - (now - self._unavailable_since),
                unavailable,
            )
        return True

    def _hold(
        self, simulation_id: int, attempt: int, env: dict[str, str], parameters: Mapping[str, float], slot: int
    ) -> None:
        """Put an attempt the scheduler could not take back at the head of the queue, and start nothing for
        :data:`UNAVAILABLE_RETRY` seconds (unless it was killed meanwhile)."""
        with self._lock:
            self._starting = None
            self._slots.give_back(slot)
            if not self._cancelled and not self._closed:
                self._queue = {simulation_id: (attempt, env, parameters), **self._queue}
                self._hold_until = time.monotonic() + UNAVAILABLE_RETRY
            self._cancelled = False

    def _reap(self) -> None:
        dying, self._dying = self._dying, []
        for job, deadline in dying:
            if job.finish_kill(deadline):
                self._slots.release(job)
            else:
                self._dying.append((job, deadline))
        for simulation_id in self._maybe_ended():
            job = self._jobs[simulation_id]
            code = job.poll()
            if code is not None:
                self._forget(simulation_id)
                self._slots.release(job)
                self._ended.append((simulation_id, code))
                logger.debug("simulation %d attempt %d ended with code %d", simulation_id, job.attempt, code)

    def _next_to_start(self) -> tuple[int, int, dict[str, str], Mapping[str, float], int] | None:
        """Take the next queued attempt and the lowest free slot, if one is free; it is ``_starting`` until
        registered."""
        with self._lock:
            if self._closed or not self._queue or len(self._jobs) + len(self._dying) >= self._job_limit:
                return None
            if time.monotonic() < self._hold_until:
                return None
            simulation_id = next(iter(self._queue))
            attempt, env, parameters = self._queue.pop(simulation_id)
            self._starting = simulation_id
            return simulation_id, attempt, env, parameters, self._slots.take()

    def _register(self, simulation_id: int, job: RunningJob, log_path: Path) -> None:
        self._jobs[simulation_id] = job
        if job.exit_fd is not None and self._exit_poll is not None:
            self._exit_poll.register(job.exit_fd, select.EPOLLIN)
            self._exits[job.exit_fd] = simulation_id
        else:
            self._polled.add(simulation_id)
        logger.debug(  # at INFO, each simulation's "done" (or its failure) is enough: a line costs the server
            "simulation %d attempt %d started (%s, log %s)",
            simulation_id,
            job.attempt,
            job.label,
            log_path,
        )

    def _finish_dying_now(self) -> None:
        """After a shutdown: a job that started meanwhile is killed like the others."""
        with self._lock:
            dying, self._dying = self._dying, []
        for job, deadline in dying:
            job.kill(deadline)

    def _maybe_ended(self) -> list[int]:
        """The jobs whose exit descriptor says they ended, and those without one (polled every time)."""
        if not self._exits or self._exit_poll is None:  # descriptors are followed only where epoll exists
            return list(self._polled)
        return [self._exits[fd] for fd, _ in self._exit_poll.poll(0) if fd in self._exits] + list(self._polled)

    def _forget(self, simulation_id: int) -> RunningJob | None:
        """Take a job out of the running ones (its exit descriptor is closed when it is reaped)."""
        job = self._jobs.pop(simulation_id, None)
        self._polled.discard(simulation_id)
        if job is not None and job.exit_fd is not None:
            self._exits.pop(job.exit_fd, None)
        return job

    def log_path(self, simulation_id: int, attempt: int) -> Path:
        return self._log_dir / f"simulation{simulation_id}.attempt{attempt}.log"

    def output_tail(self, simulation_id: int, attempt: int) -> str:
        """The last lines of an attempt's output, joined by `` | ``, '' if none: the program's own (its error,
        usually; :data:`TAIL` characters at most), then those srun, slurmstepd or mpirun wrote about its end
        (:data:`LAUNCHER_LINE`), whole, however long the program's were."""
        try:
            with open(self.log_path(simulation_id, attempt), "rb") as log:
                start = log.seek(max(0, log.seek(0, 2) - 8 * TAIL))
                text = log.read().decode(errors="replace")
                if start:  # begun mid-line: that part of a line (the command's, maybe) is no line of the program's
                    text = text.partition("\n")[2]
        except OSError:
            return ""
        program: list[str] = []
        launchers: list[str] = []
        for line in filter(None, (line.strip() for line in text.splitlines())):
            if not line.startswith(COMMAND_LINE):
                (launchers if LAUNCHER_LINE.match(line) else program).append(line)
        tail = _last_lines(program, TAIL)
        return " | ".join(([tail] if tail else []) + launchers)

    def kill(self, simulation_id: int) -> None:
        """Kill the simulation's running job or drop it from the queue; poll will not report it.

        Returns at once: the job gets SIGTERM now, and the next looks at the jobs SIGKILL its group once the
        leader exited or after :data:`KILL_GRACE` seconds; until then its slot stays taken. Does nothing if
        the simulation has neither, e.g. its end was already reported.
        """
        with self._lock:
            if simulation_id == self._starting:
                self._cancelled = True
            job = self._forget(simulation_id)
            if job is not None:
                job.terminate()
                self._dying.append((job, time.monotonic() + KILL_GRACE))
                logger.info("simulation %d attempt %d killed", simulation_id, job.attempt)
            self._queue.pop(simulation_id, None)
            self._ended = [(sid, code) for sid, code in self._ended if sid != simulation_id]

    def drop_unstarted(self, simulation_id: int) -> None:
        """Kill the simulation's attempt if it has not started (queued here, or pending at Slurm, asked afresh);
        one that runs ends by itself."""
        with self._lock:
            job = self._jobs.get(simulation_id)
            if job is None or not job.started(fresh=True):
                self.kill(simulation_id)

    def running(self) -> set[int]:
        """Simulations whose job has started (a Slurm job may wait in the queue) and whose end has not been
        reported: a job reaped since the last poll still counts, so that its end is seen before it is gone."""
        with self._lock:
            return {sid for sid, job in self._jobs.items() if job.started()} | {sid for sid, _ in self._ended}

    def queued(self) -> list[int]:
        """Simulations waiting for a slot, in start order, the one being started first: it is neither queued nor
        running for those milliseconds, and a study counting what is ahead would draw one simulation too many."""
        with self._lock:
            return [*([] if self._starting is None else [self._starting]), *self._queue]

    def finish(self) -> None:
        """The study will submit nothing more: the scheduler may let go of what it keeps between attempts
        (persistent workers are told the study is over), without waiting: rank 0's round calls it."""
        self._scheduler.finish()

    def shutdown(self) -> None:
        """Kill every running job, forget the queue and end the launcher's thread.

        All jobs get SIGTERM first and share one grace period, so shutdown
        takes at most one grace however many jobs ignore SIGTERM. The thread
        ends last: the jobs it started would get their death signal with it,
        without that grace.
        """
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._exits.clear()
            self._polled.clear()
            self._queue.clear()
            for job in jobs:
                job.terminate()
            deadline = time.monotonic() + KILL_GRACE
            for job, dying_deadline in [(job, deadline) for job in jobs] + self._dying:
                job.kill(dying_deadline)
                self._slots.release(job)
            self._dying.clear()
        if jobs:
            logger.info("killed %d running simulations", len(jobs))
        self._scheduler.close()  # before the thread ends: the processes it started die with it
        with self._lock:
            self._finished = True
        if self._thread is not None:
            self._wake.set()
            self._thread.join()


def _start_failure_code(error: OSError) -> int:
    if isinstance(error, FileNotFoundError):
        return NOT_FOUND
    if isinstance(error, PermissionError) or error.errno == errno.ENOEXEC:
        return NOT_EXECUTABLE
    return START_FAILED
