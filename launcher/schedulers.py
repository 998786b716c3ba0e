"""Start, poll and kill simulation processes on the server's node.

A scheduler only runs processes: the server decides what to start, when to
retry and what a return code means.

Every job runs in its own session (so its own process group): killing the
group reaches whatever the command spawned, e.g. a shell script's simulation
(mpirun is special, see :class:`MpirunScheduler`). On Linux the kernel also
signals the job when the server dies, so that a crashed server leaves no
orphan simulations behind.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, ClassVar, Protocol

KILL_GRACE = 2.0
"""Seconds a job gets between SIGTERM and SIGKILL to flush and clean up."""
RUN_MARKER = "MELISSA_SUPERVISOR_RUN"
"""Environment variable naming one run of a supervised server: its processes and jobs inherit it."""

_MPI_PREFIXES = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_", "MPICH_", "OMPI_", "I_MPI_", "PRTE_")
# Hydra (mpich's mpirun) sets these too; they describe the server's launch, not the child's.
_MPI_NAMES = frozenset({"MPI_LOCALNRANKS", "MPI_LOCALRANKID", "GFORTRAN_UNBUFFERED_PRECONNECTED"})

_PR_SET_PDEATHSIG = 1
# Resolved once in the parent so that the forked child does as little as possible.
_prctl = ctypes.CDLL(None).prctl if sys.platform == "linux" else None


class SchedulerUnavailable(OSError):
    """The scheduler cannot take an attempt now (its controller does not answer, say, while restarted): the
    launcher starts the attempt again later, not counted as one that failed."""


class LogUnwritable(RuntimeError):
    """A simulation's log cannot be opened: the output folder's fault (full, read-only), not the simulation's.

    Not an ``OSError``, so that the launcher does not count it as an attempt
    that could not start; the ``OSError`` is its ``__cause__``.
    """


SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "KEY", "CREDENTIAL", "AUTH")  # logged hidden if named
COMMAND_LINE = "melissa_dl: cd "  # how an attempt's log begins: its command (not the program's output)


def command_line(argv: Sequence[str], cwd: Path, extra: Mapping[str, str]) -> bytes:
    """An attempt's first log line: its command as a shell reruns it, from where, with the environment the
    launcher adds (a secret's value hidden)."""
    added = " ".join(
        f"{name}={shlex.quote('<hidden>' if any(word in name.upper() for word in SECRET_WORDS) else value)}"
        for name, value in extra.items()
    )
    env = f"env {added} " if added else ""
    return f"{COMMAND_LINE}{shlex.quote(str(cwd))} && {env}{shlex.join(argv)}\n".encode()


def open_log(path: Path) -> BinaryIO:
    """Open a simulation's log for appending, its folder made if needed; a failure is ``LogUnwritable``."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return open(path, "ab")
    except OSError as error:
        raise LogUnwritable(f"cannot open {path}: {error.strerror}") from error


@dataclass(frozen=True)
class JobTemplate:
    """What every simulation job of a study shares, whichever scheduler runs it (from a checked config)."""

    command: list[str]  # run from ``cwd``
    cwd: Path
    ranks: int = 1  # MPI ranks of each simulation
    options: Any = None  # the scheduler's own section of the config (its ``Options``), if it has one
    name: str = "melissa"  # of the study, in the jobs' names


def venv_mpirun() -> str:
    """The venv's ``mpirun`` (the server's MPI), or the first in ``PATH``."""
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    return mpirun if os.path.exists(mpirun) else "mpirun"


def child_environment(extra: dict[str, str]) -> dict[str, str]:
    """The server's environment without its MPI launch, the venv first in PATH, then ``extra``.

    A child inheriting the PMI/hydra variables of the server's own launch would
    attach its MPI_Init or its mpirun to the server's MPI job instead of
    starting its own. Putting the interpreter's directory first makes
    ``python`` and ``mpirun`` in a command resolve to the server's venv.
    """
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(_MPI_PREFIXES) and name not in _MPI_NAMES
    }
    bin_dir = os.path.dirname(sys.executable)
    path = env.get("PATH")
    env["PATH"] = f"{bin_dir}{os.pathsep}{path}" if path else bin_dir
    env.update(extra)
    return env


def missing_program(command: list[str], cwd: Path) -> str | None:
    """Why ``command`` cannot start from ``cwd`` with the simulations' ``PATH``; None when it can."""
    program = command[0]
    if os.sep in program:
        path = cwd / program
        if not path.is_file():
            return f"no file {path}"
        return None if os.access(path, os.X_OK) else f"{path} is not executable"
    if shutil.which(program, path=child_environment({})["PATH"]) is None:
        return f"no program '{program}' in PATH (the server's, its venv first)"
    return None


class RunningJob(Protocol):
    """What the launcher needs of a started attempt, whatever runs it (a process, a Slurm job)."""

    simulation_id: int
    attempt: int

    @property
    def label(self) -> str: ...

    def poll(self) -> int | None: ...

    def started(self, fresh: bool = False) -> bool: ...

    def terminate(self) -> None: ...

    def finish_kill(self, deadline: float) -> bool: ...

    def kill(self, deadline: float | None = None) -> None: ...

    @property
    def exit_fd(self) -> int | None:
        """A descriptor that becomes readable when the job ends, or None: then it must be polled."""


class Starter(Protocol):
    """What the launcher starts attempts with: a :class:`Scheduler`, or persistent workers
    (:class:`launcher.workers.WorkerScheduler`) that one of them starts."""

    def start(
        self, simulation_id: int, attempt: int, env: dict[str, str], log_path: Path, command: list[str] | None = None
    ) -> RunningJob: ...

    def finish(self) -> None:
        """The study will submit nothing more: let go, without waiting, of what is kept between attempts."""

    def close(self) -> None:
        """The launcher shuts down (its running attempts are killed already): end what is kept between them."""


class Job:
    """A started simulation process and its process group.

    Its ``exit_fd`` (a pidfd, Linux 5.3 and later) lets the launcher look only at the jobs that ended instead of
    polling a thousand running ones a hundred times a second.
    """

    def __init__(self, simulation_id: int, attempt: int, process: subprocess.Popen[bytes]) -> None:
        self.simulation_id = simulation_id
        self.attempt = attempt
        self._process = process
        self._exit_fd = _pidfd(process.pid)

    @property
    def exit_fd(self) -> int | None:
        return self._exit_fd

    def _reaped(self) -> None:
        if self._exit_fd is not None:
            os.close(self._exit_fd)  # also leaves every epoll it was in
            self._exit_fd = None

    @property
    def pid(self) -> int:
        """Also the process group id, since the job runs in its own session."""
        return self._process.pid

    @property
    def label(self) -> str:
        return f"pid {self.pid}"

    def started(self, fresh: bool = False) -> bool:
        return True

    def poll(self) -> int | None:
        """The return code (negative: killed by that signal), or None while running."""
        code = self._process.poll()
        if code is not None:
            self._reaped()
        return code

    def terminate(self) -> None:
        """Ask the whole group to stop; :meth:`kill` finishes the job."""
        if self._process.returncode is None:
            self._signal_group(signal.SIGTERM)

    def kill(self, deadline: float | None = None) -> None:
        """Stop the whole group and reap the job; does nothing once the job is reaped.

        The leader gets until ``deadline`` (``time.monotonic()``, default
        :data:`KILL_GRACE` from now) to exit after SIGTERM; then the group gets
        SIGKILL, which also takes care of children that outlived the leader.
        The leader is reaped only after that SIGKILL: while it is an unreaped
        zombie its pid cannot be reused, so the group signal cannot hit an
        unrelated process.
        """
        self.terminate()
        deadline = time.monotonic() + KILL_GRACE if deadline is None else deadline
        while not self.finish_kill(deadline):
            time.sleep(0.01)

    def finish_kill(self, deadline: float) -> bool:
        """After :meth:`terminate`, without waiting: once the leader exited or ``deadline`` passed, SIGKILL the
        group and reap the leader (True); False while the leader may still be shutting down."""
        if self._process.returncode is not None:
            self._reaped()
            return True
        if not self._leader_exited() and time.monotonic() < deadline:
            return False
        self._signal_group(signal.SIGKILL)
        self._process.wait()
        self._reaped()
        return True

    def _leader_exited(self) -> bool:
        """Whether the leader exited, without reaping it (see :meth:`kill`)."""
        flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return os.waitid(os.P_PID, self._process.pid, flags) is not None

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self._process.pid, sig)
        except ProcessLookupError:
            pass  # the whole group has already exited


class Scheduler(ABC):
    """Starts one simulation attempt as a :class:`Job`.

    A new scheduler is one module with a subclass of this and one line in
    ``melissa_dl/config/registry.py``'s ``SCHEDULERS``; its options, if it has any, are its own
    section of the config, ``launcher.<name>``.
    """

    summary: ClassVar[str]
    """What it runs, for the reference of ``launcher.scheduler``."""
    runs_mpi: ClassVar[bool] = False
    """Whether it runs a simulation on several MPI ranks (``launcher.client_ranks``)."""
    runs_here: ClassVar[bool] = False
    """Whether its simulations run on the launcher's host (server rank 0's) and share its cores with the server's
    ranks there, which then train on fewer threads (``training.threads``)."""
    Options: ClassVar[type | None] = None
    """A dataclass of its own options (each field documented in ``metadata["doc"]``), or None."""

    @classmethod
    @abstractmethod
    def from_job(cls, job: JobTemplate) -> Scheduler:
        """The scheduler running ``job``'s simulations (``job.options``: an instance of ``Options``)."""

    def dry_run(self) -> str | None:
        """Why the simulations' jobs would be refused, found without running any (``--check``); None if nothing
        says so."""
        return None

    def finish(self) -> None:  # noqa: B027 (a scheduler's jobs are all the launcher's: nothing is kept)
        """The study will submit nothing more."""

    def close(self) -> None:  # noqa: B027 (a scheduler's jobs are all the launcher's: it killed them)
        """The launcher shuts down: its running attempts are killed already."""

    server_stop_signal: ClassVar[signal.Signals | None] = None
    """The signal that passes a stop on to what ``server_launch`` starts (None: the one received)."""

    @classmethod
    def server_launch(cls, ranks: int) -> list[str] | None:
        """The command prefix that starts the server's ``ranks`` ranks when this process runs inside one of this
        scheduler's allocations; None outside one."""
        return None

    @classmethod
    def end_run(cls, marker: str) -> None:  # noqa: B027 (most schedulers leave nothing: their jobs are processes)
        """End what a supervised run's simulations left with this scheduler that outlives their processes (batch
        jobs on other nodes); ``marker``: the run's ``RUN_MARKER``. An ``OSError`` says it could not."""

    @abstractmethod
    def start(
        self, simulation_id: int, attempt: int, env: dict[str, str], log_path: Path, command: list[str] | None = None
    ) -> RunningJob:
        """Start the attempt with ``env`` added to its environment (:func:`child_environment`, or what the
        scheduler makes of it); output goes to ``log_path``. ``command``: this attempt's (``launcher.command``
        with its placeholders filled), instead of the scheduler's."""


class LocalScheduler(Scheduler):
    """Runs ``command`` directly; the kernel SIGKILLs it if the server dies.

    SIGKILL cannot be ignored, but it only reaches the direct child: whatever
    the command spawns outlives a dead server unless the command handles that.
    """

    summary = "one subprocess per simulation"
    runs_here = True
    _death_signal = signal.SIGKILL

    def __init__(self, command: list[str], cwd: Path, launch: Sequence[str] = ()) -> None:
        self._command = list(command)
        self._launch = list(launch)  # what runs the command (mpirun, srun), if anything does
        self._cwd = cwd

    @classmethod
    def from_job(cls, job: JobTemplate) -> Scheduler:
        return cls(job.command, job.cwd)

    def start(
        self, simulation_id: int, attempt: int, env: dict[str, str], log_path: Path, command: list[str] | None = None
    ) -> Job:
        argv = [*self._launch, *(self._command if command is None else command)]
        header = command_line(argv, self._cwd, env)
        process = _spawn(argv, self._cwd, self.environment(env), log_path, self._death_signal, header)
        return Job(simulation_id, attempt, process)

    @staticmethod
    def environment(extra: dict[str, str]) -> dict[str, str]:
        """The attempt's environment: :func:`child_environment`."""
        return child_environment(extra)


class MpirunScheduler(LocalScheduler):
    """Runs ``command`` on ``ranks`` ranks through ``mpirun``.

    Hydra puts its proxy and every rank in a session of their own, so group
    signals reach mpirun only and it is mpirun that stops the ranks: on
    SIGTERM it kills them, whereas a SIGKILLed mpirun leaves them running.
    That is why the kernel sends mpirun SIGTERM, not SIGKILL, if the server
    dies, and why :meth:`Job.kill` tries SIGTERM first.
    """

    summary = "`mpirun -n client_ranks command`"
    runs_mpi = True
    _death_signal = signal.SIGTERM

    def __init__(
        self, command: list[str], cwd: Path, ranks: int, mpirun: str = "mpirun", options: Sequence[str] = ()
    ) -> None:
        super().__init__(command, cwd, [mpirun, "-n", str(ranks), *options])

    @classmethod
    def from_job(cls, job: JobTemplate) -> Scheduler:
        return cls(job.command, job.cwd, job.ranks, venv_mpirun())


def _spawn(
    argv: list[str], cwd: Path, env: dict[str, str], log_path: Path, death_signal: signal.Signals, header: bytes
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in environment ``env`` and a new session, stdin closed, stdout and stderr to ``log_path``
    after ``header``, to receive ``death_signal`` when the server dies.

    Where ``setpriv`` can (util-linux 2.33 and later), it sets the death signal
    in the child and execs the command, so that Python starts the child with
    vfork (which a preexec_fn rules out): from a server holding 0.8 GiB,
    0.19 ms of the server's time and 1.05 ms of CPU in all a start, against
    about 8 ms for the full fork a preexec_fn needs (a third of the launcher
    thread's time at 40 starts a second, in ``bench/scale.py``). Unlike the
    preexec_fn, it cannot see a server that died before the signal was set.
    """
    setpriv = _setpriv()
    if setpriv is not None:
        argv, preexec = [setpriv, f"--pdeathsig={death_signal.name.removeprefix('SIG')}", "--", *argv], None
    else:
        preexec = die_with_parent(death_signal)
    with open_log(log_path) as log:  # append: a restarted server may launch an attempt number again
        log.write(header)
        log.flush()  # before the child writes after it
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=preexec,
        )


def _pidfd(pid: int) -> int | None:
    """A pidfd of ``pid``, or None where the system has none."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux, or a kernel before 5.3
        return None


@functools.cache
def _setpriv() -> str | None:
    """The ``setpriv`` that sets a child's death signal, if this machine has one (Linux only)."""
    path = shutil.which("setpriv") if sys.platform == "linux" else None
    if path is None:
        return None
    usage = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=10).stdout
    return path if "--pdeathsig" in usage else None


def die_with_parent(death_signal: signal.Signals) -> Callable[[], None] | None:
    """A preexec_fn making the kernel send ``death_signal`` to the child when the server dies.

    Linux sends it when the *thread* that forked the child exits, so jobs must
    be started from a thread that lives as long as the server (rank 0's main
    loop). The parent check closes the race of a server dying before prctl ran.
    The preexec_fn only calls a pre-resolved C function, which keeps the
    fork-without-exec window of a threaded server as small as it can be.
    """
    if _prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        _prctl(_PR_SET_PDEATHSIG, int(death_signal))
        if os.getppid() != parent:
            os.kill(os.getpid(), death_signal)

    return preexec
