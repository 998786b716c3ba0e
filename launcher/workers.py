"""Persistent simulation workers (``launcher.persistent``): processes that run simulation after simulation.

A code that compiles (JAX, numba, Kokkos), loads a mesh or creates a CUDA
context pays that once per worker instead of once per simulation. The
launcher sees no difference: each attempt it starts is handed to an idle
worker, which the scheduler underneath starts (or starts again) as it would
start a simulation; the worker asks rank 0's handshake service for its next
simulation (``Client.simulations``, ``melissa_dl_next``), streams it, and
asks again, which ends that attempt with code 0. A worker that dies ends the
attempt it holds with its exit code, so that the study relaunches it as any
other; the next attempt handed to that slot starts a new worker. Killing an
attempt kills its worker. At the end (:meth:`WorkerScheduler.close`) the
workers are told the study is over, and those that do not exit are killed.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.placeholders import Placeholders
from launcher.schedulers import KILL_GRACE, RunningJob, Scheduler

logger = logging.getLogger(__name__)

ENV_WORKER = "MELISSA_WORKER"
"""A worker's slot and start, ``"3:0"``: what it asks for its next simulation with (a process of an earlier
start of the slot is told the study is over)."""
ASK_SOON, ASK_AGAIN = 0.005, 0.2
"""Seconds an idle worker waits before it asks again: ``ASK_SOON`` at first (its next simulation is usually
being handed to it), doubling up to ``ASK_AGAIN`` (the handshake service answers at once, so waiting is the
worker's)."""


@dataclass(eq=False)
class Worker:
    """One slot's worker process, restarted when it died, and the attempt handed to it."""

    slot: int
    starts: int = 0  # processes started for this slot so far
    job: RunningJob | None = None  # its process, as the scheduler underneath runs it
    env: dict[str, str] = field(default_factory=dict)  # the environment it was started with
    attempt: WorkerAttempt | None = None  # handed to it and not finished
    dying: bool = False  # its process is being killed with the attempt it held
    waits: int = 0  # "wait" answers since it was last handed an attempt

    @property
    def idle(self) -> bool:
        return self.attempt is None and not self.dying


class WorkerAttempt:
    """An attempt handed to a worker: the launcher's view of it (a :class:`~launcher.schedulers.RunningJob`)."""

    exit_fd = None  # polled: a worker's next question is no descriptor

    def __init__(self, pool: WorkerScheduler, worker: Worker, simulation_id: int, attempt: int, env: dict[str, str]):
        self.simulation_id, self.attempt = simulation_id, attempt
        self.env = env
        self.taken = False  # the worker asked for it
        self.finished = False  # and asked again since: it is over, whatever the study makes of it
        self._pool, self._worker = pool, worker

    @property
    def label(self) -> str:
        job = self._worker.job
        return f"worker {self._worker.slot} ({job.label if job is not None else 'not started'})"

    def started(self, fresh: bool = False) -> bool:
        job = self._worker.job
        return self.finished or job is None or job.started(fresh)

    def poll(self) -> int | None:
        with self._pool.lock:
            if self.finished:
                return 0
            job = self._worker.job
            code = job.poll() if job is not None else None
            if code is not None:
                self._worker.job, self._worker.attempt = None, None
            return code

    def terminate(self) -> None:
        """Kill the worker with the attempt it holds (one it already finished leaves the worker alone)."""
        with self._pool.lock:
            if self.finished or self._worker.job is None:
                return
            self._worker.dying = True
            self._worker.job.terminate()

    def finish_kill(self, deadline: float) -> bool:
        with self._pool.lock:
            job = self._worker.job
            if not self._worker.dying or job is None:
                return True
            if not job.finish_kill(deadline):
                return False
            self._worker.job, self._worker.attempt, self._worker.dying = None, None, False
            return True

    def kill(self, deadline: float | None = None) -> None:
        self.terminate()
        deadline = time.monotonic() + KILL_GRACE if deadline is None else deadline
        while not self.finish_kill(deadline):
            time.sleep(0.01)


class WorkerScheduler:
    """Hands the launcher's attempts to persistent workers, which ``inner`` starts (as a
    :class:`~launcher.schedulers.Starter`); the handshake service asks it what a worker runs next
    (:meth:`next_for`)."""

    def __init__(self, inner: Scheduler, placeholders: Placeholders) -> None:
        self._inner = inner
        self._placeholders = placeholders
        self._workers: list[Worker] = []
        self._over = False
        self.lock = threading.RLock()  # the launcher's thread starts and polls, the handshake's asks

    def start(
        self, simulation_id: int, attempt: int, env: dict[str, str], log_path: Path, command: list[str] | None = None
    ) -> RunningJob:
        """Hand the attempt to an idle worker, started first if it has no live process (outside the lock: a
        fork, or an sbatch, must not hold up the handshake service); ``log_path`` becomes a link to that worker's
        log, whose end is the attempt's failure reason."""
        worker_command: list[str] = []
        with self.lock:
            worker = next((w for w in self._workers if w.idle), None)
            if worker is None:
                worker = Worker(len(self._workers))
                self._workers.append(worker)
            restart = worker.job is None or worker.job.poll() is not None
            if restart:  # its start number is taken now, so that the process's questions match it
                worker.job, worker.starts = None, worker.starts + 1
                worker_command, extra = self._placeholders.fill_slot(worker.slot)
                worker.env = {**extra, **env, ENV_WORKER: f"{worker.slot}:{worker.starts - 1}"}
            log = _worker_log(log_path.parent, worker.slot, worker.starts - 1)
            handed = worker.attempt = WorkerAttempt(self, worker, simulation_id, attempt, env)  # reserves it
        try:
            _link(log_path, log)
            job = (
                self._inner.start(worker.slot, worker.starts - 1, worker.env, log, worker_command) if restart else None
            )
        except BaseException:
            with self.lock:
                worker.attempt = None
            raise
        if job is not None:
            with self.lock:
                worker.job = job
            logger.debug("worker %d started (%s, log %s)", worker.slot, job.label, log)
        return handed

    def next_for(self, worker: str, last: str | None = None) -> dict[str, Any]:
        """The answer to a worker asking for its next simulation (``worker``: its ``MELISSA_WORKER``; ``last``:
        ``"simulation:attempt"`` of the last one it was told, if any): the environment of the attempt handed to
        it (what differs from its own), ``over``, or ``wait`` seconds.

        Asking after the attempt it took ends that attempt. Asking again with an older ``last`` means our answer
        was lost with its connection: it gets the same answer. A process of an earlier start of its slot is
        told ``over``.
        """
        slot, _, start = worker.partition(":")
        with self.lock:
            found = self._workers[int(slot)] if slot.isdigit() and int(slot) < len(self._workers) else None
            if found is None or found.dying or start != str(found.starts - 1) or self._over:
                return {"over": True}
            handed = found.attempt
            if handed is not None and handed.taken and last == f"{handed.simulation_id}:{handed.attempt}":
                handed.finished, found.attempt, handed = True, None, None
            if handed is None:
                found.waits += 1
                return {"wait": min(ASK_AGAIN, ASK_SOON * 2 ** (found.waits - 1))}
            handed.taken, found.waits = True, 0
            return {"env": {name: value for name, value in handed.env.items() if found.env.get(name) != value}}

    def finish(self) -> None:
        """The study is over: the workers are told so when they next ask (and then exit)."""
        with self.lock:
            self._over = True

    def close(self) -> None:
        """The launcher shuts down: the workers are told the study is over, and those still alive after
        :data:`KILL_GRACE` seconds are killed (once: a later call finds none)."""
        self.finish()
        with self.lock:
            jobs = [w.job for w in self._workers if w.job is not None]
            for worker in self._workers:
                worker.job = None
        deadline = time.monotonic() + KILL_GRACE
        while any(job.poll() is None for job in jobs) and time.monotonic() < deadline:
            time.sleep(ASK_SOON)
        for job in jobs:
            job.kill(deadline)
        self._inner.close()


def _worker_log(log_dir: Path, slot: int, start: int) -> Path:
    return log_dir / f"worker{slot}.start{start}.log"


def _link(path: Path, target: Path) -> None:
    """``path`` becomes a link to ``target`` (its name alone: both are in the same folder, made if needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    path.symlink_to(target.name)
