"""Simulations as Slurm jobs: submitted with ``sbatch``, followed with ``squeue``/``scontrol``, ended by ``scancel``.

Why it works this way:

* One batch job per attempt. Slurm places it; inside it ``srun --mpi=pmi2``
  starts the simulation's ranks (the ``mpich`` wheel's MPI and Debian's MPICH
  both speak PMI-2 to ``srun``). The job's output file is the attempt's log.
* The jobs' states come from one ``squeue`` call per ``POLL`` seconds for all
  of them, not one call per job and round: the controller is shared by every
  user of the cluster. A job that has left ``squeue`` is looked up once with
  ``scontrol show job`` (finished jobs stay there ``MinJobAge`` seconds), for
  its exit code; ``sacct`` is not used, since accounting is often off.
* A pending job has not started: the study's timeout clock starts when Slurm
  runs it, so a busy queue fails nothing.
* A controller that does not answer (restarted, failed over) fails no
  attempt: ``SlurmUnavailable`` holds it in the launcher's queue, and squeue
  waits longer between two calls, each of which waits for the controller.
* ``--no-requeue``: a failed node's job ends ``NODE_FAIL`` and the study
  relaunches it as a new, counted attempt.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from signal import SIGTERM, SIGUSR1

from launcher.schedulers import (
    RUN_MARKER,
    JobTemplate,
    LogUnwritable,
    MpirunScheduler,
    Scheduler,
    SchedulerUnavailable,
    child_environment,
    command_line,
    open_log,
)

logger = logging.getLogger(__name__)

POLL = 1.0  # seconds between two squeue calls
UNREACHABLE_POLL = 10.0  # seconds between two while the controller does not answer: each call waits for it
LOST = 255  # exit code of a job that left Slurm's memory before its end was seen
COMMAND_TIMEOUT = 60  # seconds for one Slurm command: a controller that slow is down
UNKNOWN_JOB = "Invalid job id"  # what squeue and scontrol say of a job Slurm has forgotten (MinJobAge)
RUN_COMMENT = "melissa_dl run "  # + the supervised run's marker: the job comment cancel_run_jobs looks for
_RUNNING = frozenset({"RUNNING", "COMPLETING", "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING"})
_ENDED_BY_ITSELF = frozenset({"COMPLETED", "FAILED", "CANCELLED"})  # else Slurm ended it: NODE_FAIL, TIMEOUT, ...
_WAITING = frozenset({"PENDING", "CONFIGURING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"})


UNREACHABLE = ("Unable to contact slurm controller", "Socket timed out on send/recv", "backup controller in standby")
"""What Slurm's commands say when the controller does not answer (down, restarting, overloaded)."""


class SlurmError(OSError):
    """A Slurm command failed; the launcher counts the attempt as one that could not start."""


class SlurmUnavailable(SlurmError, SchedulerUnavailable):
    """Slurm's controller does not answer: an attempt is started again later, not counted."""


def _slurm(*argv: str, env: dict[str, str] | None = None) -> str:
    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise SlurmUnavailable(f"{argv[0]} did not answer within {COMMAND_TIMEOUT} s") from None
    except OSError as error:  # not started: no such program, no process left (EAGAIN)
        raise SlurmError(f"{argv[0]}: {error}") from None
    if done.returncode != 0:
        lines = (done.stderr or done.stdout).strip().splitlines()
        last = lines[-1] if lines else f"exit code {done.returncode}"
        message = last if last.startswith(argv[0]) else f"{argv[0]}: {last}"
        raise (SlurmUnavailable if any(words in message for words in UNREACHABLE) else SlurmError)(message)
    return done.stdout


def job_environment(extra: dict[str, str], keep: frozenset[str] = frozenset({"SLURM_CONF"})) -> dict[str, str]:
    """``child_environment`` without the server's own Slurm job (but the variables in ``keep``): a simulation's
    job gets its own."""
    return {
        name: value for name, value in child_environment(extra).items() if not name.startswith("SLURM_") or name in keep
    }


def step_environment(extra: dict[str, str]) -> dict[str, str]:
    """``child_environment`` with, of the server's Slurm variables, only its allocation: ``srun`` reads the rest
    (the server step's node list, node and task counts) as options of the new step, and after a node's loss
    refuses a step asked for on nodes the allocation no longer has."""
    return job_environment(extra, frozenset({"SLURM_CONF", "SLURM_JOB_ID", "SLURM_JOBID"}))


class SlurmJob:
    """One attempt's batch job."""

    exit_fd = None  # polled: Slurm tells of the ends of all jobs at once (squeue)

    def __init__(self, scheduler: SlurmScheduler, simulation_id: int, attempt: int, job_id: str) -> None:
        self.simulation_id = simulation_id
        self.attempt = attempt
        self.job_id = job_id
        self._scheduler = scheduler
        self._cancelled = False

    @property
    def label(self) -> str:
        return f"Slurm job {self.job_id}"

    def poll(self) -> int | None:
        """The exit code (negative: ended by that signal, e.g. cancelled), or None while pending or running."""
        return self._scheduler.exit_code(self.job_id)

    def started(self, fresh: bool = False) -> bool:
        return self._scheduler.started(self.job_id, fresh)

    def terminate(self) -> None:
        if not self._cancelled and self.poll() is None:
            self._cancelled = True
            self._scheduler.cancel(self.job_id)

    def kill(self, deadline: float | None = None) -> None:
        """Cancel the job. Nothing to wait for: Slurm sends SIGTERM, then SIGKILL after its ``KillWait``."""
        self.terminate()

    def finish_kill(self, deadline: float) -> bool:
        self.terminate()
        return True


@dataclass
class SlurmOptions:
    """Options of each simulation's job (scheduler `slurm`)."""

    partition: str | None = field(
        default=None, metadata={"doc": "`sbatch --partition` of each simulation's job (default: Slurm's)."}
    )
    time_limit: str | None = field(
        default=None, metadata={"doc": '`sbatch --time` of each simulation\'s job, e.g. `"00:30:00"`.'}
    )
    account: str | None = field(default=None, metadata={"doc": "`sbatch --account` of each simulation's job."})
    sbatch_args: list[str] = field(
        default_factory=list,
        metadata={"doc": 'More `sbatch` arguments of each simulation\'s job, e.g. `["--mem=4G", "--qos=short"]`.'},
    )

    def sbatch_options(self) -> list[str]:
        """These options as ``sbatch`` arguments."""
        return [
            *([f"--partition={self.partition}"] if self.partition else []),
            *([f"--time={self.time_limit}"] if self.time_limit else []),
            *([f"--account={self.account}"] if self.account else []),
            *self.sbatch_args,
        ]


class SlurmScheduler(Scheduler):
    """Runs ``command`` on ``ranks`` ranks as one Slurm job per attempt."""

    summary = "one `sbatch` job per simulation attempt, running `srun --mpi=pmi2 -n client_ranks command`"
    runs_mpi = True
    Options = SlurmOptions
    server_stop_signal = SIGUSR1  # srun answers SIGTERM (and a second SIGINT within a second) with SIGKILL to its
    # tasks, and passes SIGUSR1 on to them as it comes (src/srun/srun_job.c, _srun_signal_mgr)

    def __init__(self, command: list[str], cwd: Path, ranks: int, sbatch_options: list[str], study_name: str) -> None:
        self._command = list(command)
        self._cwd = cwd
        self._ranks = ranks
        self._sbatch_options = list(sbatch_options)
        self._name = study_name
        self._states: dict[str, str] = {}  # job id -> squeue state, of the jobs not known to have ended
        self._ended: dict[str, int] = {}  # job id -> exit code
        self._logs: dict[str, Path] = {}  # job id -> its attempt's log, until its end is known
        self._unanswered: set[str] = set()  # names of the jobs whose sbatch got no answer
        self._uncancelled: set[str] = set()  # jobs whose scancel failed: tried again at each refresh
        self._polled = -POLL

    @classmethod
    def from_job(cls, job: JobTemplate) -> Scheduler:
        options = job.options if job.options is not None else SlurmOptions()
        return cls(job.command, job.cwd, job.ranks, options.sbatch_options(), job.name)

    @classmethod
    def server_launch(cls, ranks: int) -> list[str] | None:
        """Inside an allocation (a batch job, salloc): ``srun --mpi=pmi2 -n K`` on its nodes; ``--kill-on-bad-exit``:
        a rank that dies ends the others, as mpirun does.

        An allocation that lost nodes (``sbatch --no-kill``: Slurm takes a failed node out of the job) gets at
        most as many ranks a node as its busiest node had at the start (``ceil(K / nodes)``), on the nodes it
        has left, and never more than K: the server resumes its checkpoint with fewer ranks (elastic K) rather
        than wait for nodes that will not come back.
        """
        if not inside_allocation():
            return None
        launch = ["srun", "--mpi=pmi2", "--kill-on-bad-exit=1"]
        at_start, left = int(os.environ.get("SLURM_JOB_NUM_NODES", "0")), allocation_size()
        if left is None or not 0 < left < at_start:
            return [*launch, "-n", str(ranks)]
        fewer = min(ranks, -(-ranks // at_start) * left)
        if fewer < ranks:
            logger.warning(
                "the allocation has %d of its %d nodes left: the server runs on %d ranks instead of %d",
                left,
                at_start,
                fewer,
                ranks,
            )
        return [*launch, f"--nodes={min(left, fewer)}", "-n", str(fewer)]

    @classmethod
    def end_run(cls, marker: str) -> None:
        """Cancel this user's jobs of one supervised server run (a dead server's simulations, on whatever node)."""
        listed = _slurm("squeue", "--me", "--noheader", "--format=%i %k")
        jobs = [
            job_id
            for job_id, _, comment in (line.strip().partition(" ") for line in listed.splitlines())
            if comment == f"{RUN_COMMENT}{marker}"
        ]
        if jobs:
            _slurm("scancel", *jobs)
            logger.info("cancelled the Slurm jobs of the ended server's simulations: %s", " ".join(jobs))

    def start(
        self, simulation_id: int, attempt: int, env: dict[str, str], log_path: Path, command: list[str] | None = None
    ) -> SlurmJob:
        run = shlex.join(self._command if command is None else command)
        if self._ranks > 1:  # a rank that dies ends the others, as under mpirun
            run = f"srun --mpi=pmi2 --kill-on-bad-exit=1 -n {self._ranks} {run}"
        marker = os.environ.get(RUN_MARKER)  # set when a supervisor runs this server
        name = f"{self._name}-s{simulation_id}a{attempt}"
        argv = [
            "sbatch",
            "--parsable",
            f"--job-name={name}",
            f"--output={log_path}",
            "--open-mode=append",
            # a node's failure ends the attempt (NODE_FAIL) and the study relaunches it, counted: Slurm's own
            # requeue would run the same attempt again behind the study's back
            "--no-requeue",
            *self._options_argv(),
            *([f"--comment={RUN_COMMENT}{marker}"] if marker else []),
            "--wrap",
            f"exec {run}",
        ]
        job_id = self._submitted_unanswered(name)
        if job_id is None:
            with open_log(log_path) as log:  # the folder made and writable before Slurm appends to it
                log.write(command_line(argv, Path.cwd(), env))
            try:
                job_id = _slurm(*argv, env=job_environment(env)).strip().split(";")[0]
            except SlurmUnavailable:
                self._unanswered.add(name)
                raise
        if not job_id.isdigit():
            raise SlurmError(f"sbatch answered {job_id!r}, not a job id")
        self._states[job_id] = "PENDING"
        self._logs[job_id] = log_path
        return SlurmJob(self, simulation_id, attempt, job_id)

    def _submitted_unanswered(self, name: str) -> str | None:
        """The id of the job ``name`` if an sbatch of it got no answer but submitted it all the same (a controller
        that timed out may have); asked of squeue before that attempt is submitted again, so that it runs once."""
        if name not in self._unanswered:
            return None
        listed = _slurm("squeue", "--me", "--noheader", "--states=all", f"--name={name}", "--format=%i").split()
        self._unanswered.discard(name)
        if listed:
            logger.warning(
                "Slurm job %s (%s) was submitted after all, by an sbatch that got no answer", listed[0], name
            )
        return listed[0] if listed else None

    def _options_argv(self) -> list[str]:
        return [f"--chdir={self._cwd}", f"--ntasks={self._ranks}", *self._sbatch_options]

    def dry_run(self) -> str | None:
        """What sbatch says against the simulations' job options, if anything (``--test-only``: nothing is
        submitted): a partition that does not exist or a malformed time limit is a config error, found at start."""
        try:
            _slurm(
                "sbatch",
                "--test-only",
                f"--output={os.devnull}",
                *self._options_argv(),
                "--wrap",
                "true",
                env=job_environment({}),
            )
        except SlurmUnavailable as error:  # at start, a study cannot wait for Slurm: it says so
            return f"Slurm's controller does not answer: {error}"
        except SlurmError as error:
            return f"sbatch refuses the simulations' job options: {error}"
        return None

    def started(self, job_id: str, fresh: bool = False) -> bool:
        self._refresh(force=fresh)
        return job_id in self._ended or self._states.get(job_id) in _RUNNING

    def cancel(self, job_id: str) -> None:
        self._uncancelled.add(job_id)
        self._cancel_pending()

    def _cancel_pending(self) -> None:
        """scancel the jobs not yet cancelled; a failure (a busy controller) is tried again at the next refresh."""
        try:
            _slurm("scancel", *sorted(self._uncancelled))
        except SlurmError as error:
            logger.warning("Slurm jobs %s not cancelled yet: %s", " ".join(sorted(self._uncancelled)), error)
            return
        self._uncancelled.clear()

    def exit_code(self, job_id: str, fresh: bool = False) -> int | None:
        if job_id not in self._ended:
            self._refresh(force=fresh)
        return self._ended.get(job_id)

    def _refresh(self, force: bool = False) -> None:
        """One squeue call for every job not known to have ended; each one it no longer lists is looked up."""
        if not (self._states or self._uncancelled) or (not force and time.monotonic() - self._polled < POLL):
            return
        self._polled = time.monotonic()
        if self._uncancelled:
            self._cancel_pending()
        if not self._states:
            return
        try:
            listed = _slurm(
                "squeue", "--noheader", "--states=all", "--format=%i %T", f"--jobs={','.join(self._states)}"
            )
        except SlurmError as error:
            if UNKNOWN_JOB not in str(error):  # a busy or restarting controller: the states stand until the next try
                if isinstance(error, SlurmUnavailable):  # each call waits MessageTimeout, in the server's round
                    self._polled = time.monotonic() + UNREACHABLE_POLL - POLL
                logger.warning("job states not refreshed: %s", error)
                return
            listed = ""  # squeue asked for one job only, and Slurm has forgotten it
        states = dict(line.split() for line in listed.splitlines() if line.strip())
        for job_id in list(self._states):
            state = states.get(job_id, "")
            if state in _RUNNING or state in _WAITING:
                self._states[job_id] = state
            else:  # ended, or gone from squeue
                code = self._final_exit_code(job_id)
                if code is not None:
                    del self._states[job_id]
                    del self._logs[job_id]
                    self._ended[job_id] = code

    def _note(self, job_id: str, line: str) -> None:
        """``line`` at the end of the job's log, which goes into the attempt's failure reason."""
        try:
            with open_log(self._logs[job_id]) as log:
                log.write(f"{line}\n".encode())
        except (LogUnwritable, OSError) as error:  # a full disk fails the write or its flush at close
            logger.warning("%s (not written: %s)", line, error)

    def _final_exit_code(self, job_id: str) -> int | None:
        """From ``scontrol show job``: the code, or minus the signal that ended the job; None if it has not ended."""
        try:
            shown = _slurm("scontrol", "--oneliner", "show", "job", job_id)
        except SlurmError as error:
            if UNKNOWN_JOB not in str(error):
                logger.warning("Slurm job %s: end not read (%s); trying again", job_id, error)
                return None
            logger.warning("Slurm job %s: no record of its end (%s); counted as exit code %d", job_id, error, LOST)
            return LOST
        state = re.search(r"\bJobState=(\S+)", shown)
        code = re.search(r"\bExitCode=(\d+):(\d+)", shown)
        if state is None or code is None:
            return LOST
        if state.group(1) in _RUNNING or state.group(1) in _WAITING:
            return None
        if state.group(1) not in _ENDED_BY_ITSELF:  # its output cannot say why: the end of its log says it
            self._note(job_id, f"slurm: job {job_id} ended {state.group(1)}, exit code {code.group(1)}:{code.group(2)}")
        status, signal = int(code.group(1)), int(code.group(2))
        if signal or status or state.group(1) == "COMPLETED":
            return -signal if signal else status
        if state.group(1) == "CANCELLED":  # before it ran, or its signal not recorded
            return -int(SIGTERM)
        logger.warning("Slurm job %s ended %s with exit code 0; counted as exit code %d", job_id, state.group(1), LOST)
        return LOST


@dataclass
class SrunOptions:
    """Options of each simulation's job step (scheduler `srun`)."""

    srun_args: list[str] = field(
        default_factory=list,
        metadata={"doc": 'More `srun` arguments of each simulation\'s step, e.g. `["--nodes=1", "--gpus=1"]`.'},
    )


class SrunScheduler(MpirunScheduler):
    """Runs each attempt as a job step of the server's own allocation: ``srun --exclusive -n ranks command``.

    No batch job per simulation, which sites cap: Slurm places each step on
    the allocation's free CPUs (a step waits for some if none are), and
    ``--exclusive`` keeps two steps off the same CPUs. ``srun`` is the
    attempt's process: its exit code is the attempt's (the largest of its
    tasks'), and SIGTERM to it, as the launcher sends at a timeout or a cancel,
    makes srun kill its tasks; hence SIGTERM, not SIGKILL, when the server dies.
    Outside an allocation each step would get one of its own.
    """

    summary = "one `srun --exclusive` job step per simulation attempt, in the server's own allocation"
    runs_here = False  # Slurm gives each step CPUs of its own: none of the server's step's
    Options = SrunOptions
    server_stop_signal = SlurmScheduler.server_stop_signal  # the same server launch

    @classmethod
    def from_job(cls, job: JobTemplate) -> Scheduler:
        options = job.options if job.options is not None else SrunOptions()
        # --nodes: a step of one node per rank at most (the step's environment names no node count)
        step = ["--exclusive", "--mpi=pmi2", f"--nodes=1-{job.ranks}", f"--job-name={job.name}", *options.srun_args]
        return cls(job.command, job.cwd, job.ranks, "srun", step)

    def __init__(
        self, command: list[str], cwd: Path, ranks: int, srun: str = "srun", step: list[str] | None = None
    ) -> None:
        super().__init__(command, cwd, ranks, srun, step or [])

    environment = staticmethod(step_environment)

    @classmethod
    def server_launch(cls, ranks: int) -> list[str] | None:
        return SlurmScheduler.server_launch(ranks)


def inside_allocation() -> bool:
    """Whether this process runs inside a Slurm allocation (a batch job or salloc)."""
    return "SLURM_JOB_ID" in os.environ


def allocation_size() -> int | None:
    """The nodes this process's allocation has now, as Slurm says (None if it does not answer)."""
    try:
        listed = _slurm("squeue", "--noheader", "--format=%D", f"--jobs={os.environ['SLURM_JOB_ID']}")
    except SlurmError as error:
        logger.warning("the allocation's nodes not known (%s): taken as all there", error)
        return None
    return int(listed.split()[0]) if listed.split() and listed.split()[0].isdigit() else None
