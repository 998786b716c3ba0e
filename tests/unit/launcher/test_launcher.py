"""Launcher and schedulers on real processes: limits, return codes, kills, MPI isolation."""

from __future__ import annotations

import errno
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from launcher import jobs
from launcher.jobs import NOT_EXECUTABLE, NOT_FOUND, START_FAILED, TAIL, Launcher, program_last_line
from launcher.placeholders import Placeholders
from launcher.schedulers import (
    KILL_GRACE,
    Job,
    LocalScheduler,
    MpirunScheduler,
    SchedulerUnavailable,
    child_environment,
)

pytestmark = pytest.mark.timeout(60)

MPIRUN = os.path.join(os.path.dirname(sys.executable), "mpirun")
REPO = Path(__file__).resolve().parents[3]
# What hydra sets in the server's environment when mpirun starts it.
FAKE_MPI_LAUNCH = {
    "PMI_FD": "9",
    "PMI_RANK": "0",
    "PMI_SIZE": "1",
    "PMI_HOSTNAME": "elsewhere",
    "HYDI_CONTROL_FD": "7",
    "MPI_LOCALNRANKS": "1",
    "MPI_LOCALRANKID": "0",
}
# One write(2) per line: mpirun's ranks share the log and must not interleave within a line.
PRINT_PID = "import os; os.write(1, f'pid {os.getpid()}\\n'.encode()); "
SLEEPER = PRINT_PID + "import time; time.sleep(60)"
RANK_SLEEPER = "from mpi4py import MPI; " + SLEEPER


def wait_for(condition: Callable[[], bool], timeout: float = 20.0) -> None:
    """Bounded wait: every test fails rather than hangs."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def poll_until(launcher: Launcher, count: int) -> list[tuple[int, int]]:
    ended: list[tuple[int, int]] = []

    def collect() -> bool:
        ended.extend(launcher.poll())
        return len(ended) >= count

    wait_for(collect)
    return ended


def log_of(tmp_path: Path, simulation_id: int, attempt: int = 0) -> Path:
    return tmp_path / "logs" / f"simulation{simulation_id}.attempt{attempt}.log"


def read_pids(log: Path, count: int) -> list[int]:
    """Wait until ``count`` processes printed their pid to ``log``."""
    pids: list[int] = []

    def printed() -> bool:
        pids[:] = [int(p) for p in re.findall(r"^pid (\d+)$", log.read_text(), re.MULTILINE)]
        return len(pids) >= count

    wait_for(lambda: log.exists() and printed())
    return pids


def alive(pid: int) -> bool:
    """Whether ``pid`` runs; a zombie awaiting an (orphan) reaper counts as dead."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):  # gone before or while its file was read
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def python_launcher(tmp_path: Path, code: str, job_limit: int = 4) -> Launcher:
    return Launcher(LocalScheduler([sys.executable, "-c", code], tmp_path), job_limit, tmp_path / "logs")


def test_job_limit_is_respected_in_fifo_order(tmp_path: Path) -> None:
    launcher = python_launcher(tmp_path, "import time; time.sleep(0.3)", job_limit=2)
    for simulation_id in range(5):
        launcher.submit(simulation_id, 0, {})
    assert launcher.queued() == [0, 1, 2, 3, 4] and launcher.running() == set()
    assert launcher.poll() == []
    assert launcher.running() == {0, 1} and launcher.queued() == [2, 3, 4]
    ended: list[tuple[int, int]] = []
    most = 0

    def collect() -> bool:
        nonlocal most
        ended.extend(launcher.poll())
        most = max(most, len(launcher.running()))
        return len(ended) == 5

    wait_for(collect)
    assert sorted(ended) == [(i, 0) for i in range(5)]
    assert most == 2
    assert launcher.running() == set() and launcher.queued() == []


def test_only_the_jobs_that_ended_are_polled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a thousand running jobs, polling each of them at every look cost rank 0 1.5 ms a look, 100 looks a
    second; their exit descriptors (pidfds) tell which ended."""
    polled: list[int] = []
    poll = Job.poll
    monkeypatch.setattr(Job, "poll", lambda job: polled.append(job.simulation_id) or poll(job))
    launcher = Launcher(LocalScheduler(["sh", "-c", "exec sleep $NAP"], tmp_path), 8, tmp_path / "logs")
    for simulation_id in range(8):
        launcher.submit(simulation_id, 0, {"NAP": "0" if simulation_id == 7 else "60"})
    try:
        assert poll_until(launcher, 1) == [(7, 0)]
        assert set(polled) == {7}
    finally:
        launcher.shutdown()


def test_the_servers_calls_do_not_wait_for_a_start_and_a_job_killed_while_it_starts_is_stopped(tmp_path: Path) -> None:
    """A wave of a thousand starts held the launcher's lock for seconds, and rank 0's round with it."""
    entered, release = threading.Event(), threading.Event()
    started: list[Job] = []

    class SlowStart(LocalScheduler):
        def start(self, *args: Any) -> Job:
            entered.set()
            release.wait(10)
            started.append(super().start(*args))
            return started[0]

    launcher = Launcher(SlowStart([sys.executable, "-c", SLEEPER], tmp_path), 2, tmp_path / "logs")
    launcher.start_thread()
    try:
        launcher.submit(0, 0, {})
        assert entered.wait(10)
        answers: list[object] = []
        caller = threading.Thread(target=lambda: answers.extend([launcher.queued(), launcher.running()]))
        caller.start()
        caller.join(5)
        assert answers == [[0], set()]  # answered while the start is under way: still queued, not yet running
        launcher.kill(0)
        release.set()
        wait_for(lambda: bool(started))
        wait_for(lambda: not alive(started[0].pid))  # maybe before it could print a line: its pid is the job's
        assert launcher.poll() == [] and launcher.running() == set()
    finally:
        release.set()
        launcher.shutdown()


def test_exit_code_output_cwd_and_env_reach_the_server(tmp_path: Path) -> None:
    code = (
        "import os, sys; print('out', os.getcwd()); print('err', os.environ['MELISSA_X'], file=sys.stderr); sys.exit(3)"
    )
    work = tmp_path / "work"
    work.mkdir()
    launcher = Launcher(LocalScheduler([sys.executable, "-c", code], work), 1, tmp_path / "logs")
    launcher.submit(7, 2, {"MELISSA_X": "hello"})
    assert poll_until(launcher, 1) == [(7, 3)]
    text = log_of(tmp_path, 7, attempt=2).read_text()
    assert f"out {work}" in text and "err hello" in text


def test_unstartable_command_is_reported_as_failed(tmp_path: Path) -> None:
    scheduler = LocalScheduler([str(tmp_path / "no-such-simulation")], tmp_path)
    launcher = Launcher(scheduler, 1, tmp_path / "logs")
    launcher.submit(0, 0, {})
    assert poll_until(launcher, 1) == [(0, NOT_FOUND)]  # at once without setpriv, when setpriv has tried with it
    assert launcher.running() == set()
    assert "No such file or directory" in launcher.output_tail(0, 0)
    assert str(tmp_path / "no-such-simulation") in launcher.output_tail(0, 0)


ERROR = "melissa_send('pressure'): ClientError: field 'pressure' was not declared by melissa_init (declared: 'field')"
SRUN_END = [  # what a 2-rank job's output ended with, on the test Slurm cluster, after rank 0 exited 1
    "srun: error: vm: task 0: Exited with exit code 1",
    "srun: launch/slurm: _step_signal: Terminating StepId=57896933.0",
    "slurmstepd-vm: error: *** STEP 57896933.0 ON vm CANCELLED AT 2026-11-29T16:37:20 ***",
    "srun: error: vm: task 1: Terminated",
    "srun: Force Terminated StepId=57896933.0",
]
HYDRA_END = [  # MPICH's mpirun, after a rank killed by a signal
    "",
    "=" * 83,
    "=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
    "=   PID 21709 RUNNING AT vm",
    "=   EXIT CODE: 9",
    "=   CLEANING UP REMAINING PROCESSES",
    "=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES",
    "=" * 83,
    "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)",
    "This typically refers to a problem with your application.",
    "Please see the FAQ page for debugging suggestions",
]


@pytest.mark.parametrize("ending", [SRUN_END, HYDRA_END], ids=["srun", "mpirun"])
def test_the_tail_keeps_the_programs_last_line_whole_before_what_the_launcher_wrote(
    tmp_path: Path, ending: list[str]
) -> None:
    """However long the launcher's lines, the program's last line (the one a ClientError is judged on) is whole
    in the tail, and it is the program's last line whatever comes after it."""
    launcher = Launcher(LocalScheduler(["true"], tmp_path), 1, tmp_path / "logs")
    log = log_of(tmp_path, 3, attempt=1)
    log.parent.mkdir()
    log.write_text("\n".join(["x" * 500, f"step {TAIL}", ERROR, ERROR, *ending]) + "\n")
    tail = launcher.output_tail(3, 1)
    launched = [line for line in ending if line.strip()]
    assert tail.endswith(" | ".join([ERROR, *launched])), tail
    program = tail.removesuffix(" | ".join(["", *launched]))
    assert program == f"step {TAIL} | {ERROR} | {ERROR}"  # whole lines, as many as TAIL characters hold
    assert len(program) <= TAIL < len(f"{'x' * 500} | {program}")
    assert program_last_line(tail) == ERROR
    assert program_last_line(" | ".join(launched)) == ""
    assert program_last_line("toy_sim: crashing | slurm: job 12 ended NODE_FAIL, exit code 0:0") == "toy_sim: crashing"


def test_a_command_line_longer_than_what_the_tail_reads_is_not_quoted_as_the_programs(tmp_path: Path) -> None:
    launcher = Launcher(LocalScheduler(["true"], tmp_path), 1, tmp_path / "logs")
    log = log_of(tmp_path, 0)
    log.parent.mkdir()
    log.write_text(f"melissa_dl: cd /x && env P='{'1.0, ' * 1000}' sim\nValueError: grid too coarse\n")
    assert launcher.output_tail(0, 0) == "ValueError: grid too coarse"


def test_a_program_line_longer_than_the_tail_keeps_its_end_from_a_words_start(tmp_path: Path) -> None:
    launcher = Launcher(LocalScheduler(["true"], tmp_path), 1, tmp_path / "logs")
    log = log_of(tmp_path, 0)
    log.parent.mkdir()
    words = " ".join(f"word{i}" for i in range(200))
    log.write_text(f"before\n{words}\n")
    tail = launcher.output_tail(0, 0)
    assert tail.startswith("... word") and words.endswith(tail.removeprefix("... ")) and len(tail) <= TAIL


def test_each_attempts_log_begins_with_its_command_and_environment_which_its_tail_leaves_out(tmp_path: Path) -> None:
    """To rerun one attempt by hand (issue 57, item 3): where, what it adds to the environment (the token
    hidden), the command; the failure reason quotes the program only."""
    code = "import sys; print('failing', file=sys.stderr); sys.exit(1)"
    launcher = Launcher(LocalScheduler([sys.executable, "-c", code], tmp_path), 1, tmp_path / "logs")
    secrets = {"MELISSA_TOKEN": "abcdef", "MELISSA_CURVE_SECRET_KEY": "k", "WANDB_API_KEY": "w", "DB_PASSWD": "p"}
    launcher.submit(4, 1, {"MELISSA_SIMULATION_ID": "4", **secrets, "NOTE": "two words"})
    assert poll_until(launcher, 1) == [(4, 1)]
    first = log_of(tmp_path, 4, attempt=1).read_text().splitlines()[0]
    hidden = " ".join(f"{name}='<hidden>'" for name in secrets)
    assert first == (
        f"melissa_dl: cd {tmp_path} && env MELISSA_SIMULATION_ID=4 {hidden} NOTE='two words' "
        f"{shlex.join([sys.executable, '-c', code])}"
    )
    assert launcher.output_tail(4, 1) == "failing"


def test_a_program_that_cannot_run_and_one_that_could_not_start_get_distinct_codes(tmp_path: Path) -> None:
    """A shell's 126 for a file that is not executable (a relaunch fails the same way); START_FAILED for a start
    that may succeed later (here: a fork refused)."""
    program = tmp_path / "simulation.sh"
    program.write_text("#!/bin/sh\n")
    launcher = Launcher(LocalScheduler([str(program)], tmp_path), 1, tmp_path / "logs")
    launcher.submit(0, 0, {})
    assert poll_until(launcher, 1) == [(0, NOT_EXECUTABLE)]

    class Refused(LocalScheduler):
        def start(self, *args: Any) -> Any:
            raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")

    launcher = Launcher(Refused(["true"], tmp_path), 1, tmp_path / "logs")
    launcher.submit(1, 0, {})
    assert launcher.poll() == [(1, START_FAILED)]


def test_an_attempt_the_scheduler_cannot_take_now_waits_at_the_head_of_the_queue_uncounted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A controller restarting (``SchedulerUnavailable``): nothing is reported, nothing starts before the retry,
    and the attempt starts first once the scheduler answers."""
    monkeypatch.setattr(jobs, "UNAVAILABLE_RETRY", 2.0)
    answers = [False]

    class Restarting(LocalScheduler):
        def start(self, *args: Any) -> Any:
            if not answers[0]:
                raise SchedulerUnavailable("sbatch: error: Unable to contact slurm controller (connect failure)")
            return super().start(*args)

    launcher = Launcher(Restarting([sys.executable, "-c", "pass"], tmp_path), 1, tmp_path / "logs")
    launcher.submit(0, 0, {})
    launcher.submit(1, 0, {})
    assert launcher.poll() == [] and launcher.queued() == [0, 1]
    answers[0] = True
    assert launcher.poll() == [] and launcher.queued() == [0, 1]  # held: the retry is not due yet
    assert sorted(poll_until(launcher, 2)) == [(0, 0), (1, 0)]
    assert not log_of(tmp_path, 0).read_text().startswith("could not start")

    answers[0] = False
    launcher.submit(3, 0, {})
    assert launcher.poll() == [] and launcher.queued() == [3]
    launcher.kill(3)  # while it waits: gone, never started, never reported
    answers[0] = True
    time.sleep(2.1)
    assert launcher.poll() == [] and launcher.queued() == [] and not log_of(tmp_path, 3).exists()

    monkeypatch.setattr(jobs, "UNAVAILABLE_LIMIT", 0.0)  # unavailable for longer than the launcher waits
    answers[0] = False
    launcher.submit(2, 0, {})
    assert poll_until(launcher, 1) == [(2, START_FAILED)]
    assert log_of(tmp_path, 2).read_text().startswith("could not start: sbatch: error: Unable to contact")


def test_kill_stops_job_without_grace_and_poll_does_not_report_it(tmp_path: Path) -> None:
    launcher = python_launcher(tmp_path, SLEEPER)
    launcher.submit(0, 0, {})
    launcher.poll()
    [pid] = read_pids(log_of(tmp_path, 0), 1)
    launcher.kill(0)
    assert launcher.running() == set()
    wait_for(lambda: launcher.poll() == [] and not alive(pid))
    time.sleep(0.2)
    assert launcher.poll() == []
    launcher.kill(0)  # idempotent


def test_kill_returns_at_once_and_polls_sigkill_a_job_ignoring_sigterm_after_the_grace(tmp_path: Path) -> None:
    code = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + SLEEPER
    launcher = python_launcher(tmp_path, code, job_limit=1)
    launcher.submit(0, 0, {})
    launcher.submit(1, 0, {})
    launcher.poll()
    [pid] = read_pids(log_of(tmp_path, 0), 1)
    started = time.monotonic()
    launcher.kill(0)
    assert time.monotonic() - started < 0.5  # the round that kills does not wait for the job
    assert launcher.poll() == [] and alive(pid) and launcher.queued() == [1]  # its slot stays taken
    wait_for(lambda: launcher.poll() == [] and not alive(pid), timeout=KILL_GRACE + 10)
    assert time.monotonic() - started >= KILL_GRACE
    assert launcher.running() == {1} and launcher.queued() == []  # the slot went to the next one
    launcher.shutdown()


def test_kill_reaches_grandchildren(tmp_path: Path) -> None:
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {SLEEPER!r}]); time.sleep(60)"
    launcher = python_launcher(tmp_path, code)
    launcher.submit(0, 0, {})
    launcher.poll()
    [grandchild] = read_pids(log_of(tmp_path, 0), 1)
    launcher.kill(0)
    wait_for(lambda: launcher.poll() == [] and not alive(grandchild))


def test_kill_escalates_to_sigkill_and_is_idempotent(tmp_path: Path) -> None:
    code = "import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN); " + SLEEPER
    log = tmp_path / "deep" / "log.txt"
    job = LocalScheduler([sys.executable, "-c", code], tmp_path).start(4, 1, {}, log)
    assert (job.simulation_id, job.attempt) == (4, 1)
    read_pids(log, 1)
    started = time.monotonic()
    job.kill()
    assert KILL_GRACE <= time.monotonic() - started < KILL_GRACE + 5
    assert job.poll() == -signal.SIGKILL
    job.kill()
    assert job.poll() == -signal.SIGKILL


def test_killed_job_that_already_exited_is_not_reported(tmp_path: Path) -> None:
    launcher = python_launcher(tmp_path, "print('done', flush=True)")
    launcher.submit(0, 0, {})
    launcher.poll()
    wait_for(lambda: "done" in log_of(tmp_path, 0).read_text())
    time.sleep(0.2)
    launcher.kill(0)
    assert launcher.poll() == [] and launcher.running() == set()


def test_kill_drops_queued_job(tmp_path: Path) -> None:
    launcher = python_launcher(tmp_path, SLEEPER, job_limit=1)
    launcher.submit(0, 0, {})
    launcher.submit(1, 0, {})
    launcher.poll()
    assert launcher.queued() == [1]
    launcher.kill(1)
    launcher.kill(99)
    assert launcher.queued() == [] and launcher.running() == {0}
    launcher.kill(0)
    assert launcher.poll() == []
    assert not log_of(tmp_path, 1).exists()


def test_shutdown_kills_all_jobs_within_one_grace(tmp_path: Path) -> None:
    code = (
        "import os, signal; os.environ.get('IGNORE_TERM') and signal.signal(signal.SIGTERM, signal.SIG_IGN); " + SLEEPER
    )
    launcher = python_launcher(tmp_path, code, job_limit=3)
    for simulation_id in range(4):
        launcher.submit(simulation_id, 0, {"IGNORE_TERM": "1"} if simulation_id < 2 else {})
    launcher.poll()
    pids = [read_pids(log_of(tmp_path, i), 1)[0] for i in range(3)]
    started = time.monotonic()
    launcher.shutdown()
    assert time.monotonic() - started < 2 * KILL_GRACE
    assert not any(alive(pid) for pid in pids)
    assert launcher.running() == set() and launcher.queued() == []
    assert launcher.poll() == []


def test_its_own_thread_refills_freed_slots_between_polls_and_a_poll_reports_what_ended(tmp_path: Path) -> None:
    launcher = python_launcher(tmp_path, PRINT_PID + "import time; time.sleep(0.2)", job_limit=1)
    launcher.start_thread()
    try:
        for simulation_id in range(3):
            launcher.submit(simulation_id, 0, {})
        # one slot: the third could start only once the thread had reaped the first two, with no poll
        pids = [read_pids(log_of(tmp_path, i), 1)[0] for i in range(3)]
        wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in pids))  # reaped: a zombie keeps its entry
        assert launcher.queued() == [] and launcher.running() == {0, 1, 2}  # ended, until a poll reports it
        assert sorted(launcher.poll()) == [(0, 0), (1, 0), (2, 0)]
        assert launcher.running() == set() and launcher.poll() == []
    finally:
        launcher.shutdown()


def test_with_its_own_thread_a_job_reaped_but_not_reported_is_not_reported_once_killed(tmp_path: Path) -> None:
    launcher = python_launcher(tmp_path, PRINT_PID)
    launcher.start_thread()
    try:
        launcher.submit(0, 0, {})
        [pid] = read_pids(log_of(tmp_path, 0), 1)
        wait_for(lambda: not Path(f"/proc/{pid}").exists())  # reaped (a zombie keeps its entry): by the thread
        assert launcher.running() == {0}
        launcher.kill(0)
        assert launcher.poll() == [] and launcher.running() == set()
    finally:
        launcher.shutdown()


def test_shutdown_kills_the_threads_jobs_with_their_grace_and_ends_the_thread(tmp_path: Path) -> None:
    code = (  # the handler first: a SIGTERM between the pid's print and the handler would kill it silently
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: (print('term', flush=True), "
        "sys.exit(0))); " + PRINT_PID + "time.sleep(60)"
    )
    launcher = python_launcher(tmp_path, code, job_limit=2)
    launcher.start_thread()
    for simulation_id in range(3):
        launcher.submit(simulation_id, 0, {})
    pids = [read_pids(log_of(tmp_path, i), 1)[0] for i in range(2)]
    launcher.shutdown()
    assert not any(alive(pid) for pid in pids)
    assert all("term" in log_of(tmp_path, i).read_text() for i in range(2))  # SIGTERM first, not the death signal
    assert not log_of(tmp_path, 2).exists()
    assert not [t for t in threading.enumerate() if t.name == "launcher"]


def test_child_environment_strips_mpi_launch_and_prefers_venv(monkeypatch: pytest.MonkeyPatch) -> None:
    stripped = {
        **FAKE_MPI_LAUNCH,
        "PMIX_RANK": "0",
        "HYDRA_HOST_FILE": "h",
        "MPIR_CVAR_X": "1",
        "MPICH_INTERFACE_HOSTNAME": "h",
        "OMPI_COMM_WORLD_RANK": "0",
        "I_MPI_PIN": "1",
        "GFORTRAN_UNBUFFERED_PRECONNECTED": "y",
    }
    for name, value in {**stripped, "KEEP_ME": "yes", "OVERRIDE_ME": "old"}.items():
        monkeypatch.setenv(name, value)
    env = child_environment({"OVERRIDE_ME": "new", "ADDED": "1"})
    assert not set(stripped) & set(env)
    assert env["KEEP_ME"] == "yes" and env["OVERRIDE_ME"] == "new" and env["ADDED"] == "1"
    path = env["PATH"].split(os.pathsep)
    assert path[0] == os.path.dirname(sys.executable)
    assert path[1:] == os.environ["PATH"].split(os.pathsep)
    assert os.environ["PMI_FD"] == "9"  # the server's own environment is untouched


def test_child_mpi_init_ignores_the_servers_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in FAKE_MPI_LAUNCH.items():
        monkeypatch.setenv(name, value)
    code = "import sys; from mpi4py import MPI; print('size', MPI.COMM_WORLD.size, sys.prefix)"
    launcher = Launcher(LocalScheduler(["python", "-c", code], tmp_path), 1, tmp_path / "logs")
    launcher.submit(0, 0, {})
    assert poll_until(launcher, 1) == [(0, 0)]
    assert f"size 1 {sys.prefix}" in log_of(tmp_path, 0).read_text()


@pytest.mark.parametrize("server_launched_by_mpirun", [False, True])
def test_mpirun_runs_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server_launched_by_mpirun: bool
) -> None:
    if server_launched_by_mpirun:
        for name, value in FAKE_MPI_LAUNCH.items():
            monkeypatch.setenv(name, value)
    code = (
        "import os; from mpi4py import MPI; c = MPI.COMM_WORLD; os.write(1, f'rank {c.rank} of {c.size}\\n'.encode())"
    )
    scheduler = MpirunScheduler(["python", "-c", code], tmp_path, ranks=2, mpirun=MPIRUN)
    launcher = Launcher(scheduler, 1, tmp_path / "logs")
    launcher.submit(0, 0, {})
    assert poll_until(launcher, 1) == [(0, 0)]
    text = log_of(tmp_path, 0).read_text()
    assert "rank 0 of 2" in text and "rank 1 of 2" in text


def test_kill_of_mpirun_job_stops_its_ranks(tmp_path: Path) -> None:
    scheduler = MpirunScheduler(["python", "-c", RANK_SLEEPER], tmp_path, ranks=2, mpirun=MPIRUN)
    launcher = Launcher(scheduler, 1, tmp_path / "logs")
    launcher.submit(0, 0, {})
    launcher.poll()
    ranks = read_pids(log_of(tmp_path, 0), 2)
    launcher.kill(0)
    wait_for(lambda: launcher.poll() == [] and not any(alive(pid) for pid in ranks))


@pytest.mark.skipif(sys.platform != "linux", reason="parent-death signal is Linux only")
@pytest.mark.parametrize("ranks", [None, 2])
def test_jobs_die_with_the_server(tmp_path: Path, ranks: int | None) -> None:
    server_code = (
        "import time; from pathlib import Path; from launcher.schedulers import *; "
        f"c, p = ['python', '-c', {RANK_SLEEPER!r}], Path({str(tmp_path)!r}); "
        f"s = LocalScheduler(c, p) if {ranks is None} else MpirunScheduler(c, p, {ranks}, {MPIRUN!r}); "
        "s.start(0, 0, {}, p / 'job.log'); time.sleep(60)"
    )
    server = subprocess.Popen(["python", "-c", server_code], env=child_environment({"PYTHONPATH": str(REPO)}))
    try:
        job_pids = read_pids(tmp_path / "job.log", ranks or 1)
    finally:
        server.kill()
        server.wait()
    wait_for(lambda: not any(alive(pid) for pid in job_pids))


def test_each_attempt_takes_the_lowest_free_slot_and_a_killed_one_keeps_it_until_dead(tmp_path: Path) -> None:
    """``{slot}`` in the command and the environment: slots 0 and 1 of job_limit 2; simulation 2 gets slot 0
    only once simulation 0, killed while ignoring SIGTERM, is dead."""
    code = (
        "import os, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('slot', sys.argv[1], os.environ['SLOT'], flush=True); time.sleep(60)"
    )
    launcher = Launcher(
        LocalScheduler(["unused"], tmp_path),
        2,
        tmp_path / "logs",
        Placeholders([sys.executable, "-c", code, "{slot}"], {"SLOT": "{slot}"}),
    )
    for simulation_id in range(3):
        launcher.submit(simulation_id, 0, {})
    launcher.poll()

    def printed(simulation_id: int) -> str:
        """What the program wrote: the log after its first line, the command."""
        log = log_of(tmp_path, simulation_id)
        return log.read_text().partition("\n")[2] if log.exists() else ""

    wait_for(lambda: [printed(0), printed(1)] == ["slot 0 0\n", "slot 1 1\n"])
    assert launcher.queued() == [2]
    killed = time.monotonic()
    launcher.kill(0)
    wait_for(lambda: launcher.poll() == [] and printed(2) == "slot 0 0\n")
    assert time.monotonic() - killed >= KILL_GRACE  # the slot was held through the grace
    launcher.shutdown()
