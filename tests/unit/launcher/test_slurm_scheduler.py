"""The Slurm scheduler against a scripted stand-in for its commands (the real Slurm: integration/test_slurm.py)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import time
from pathlib import Path

import pytest

from launcher import slurm
from launcher.schedulers import RUN_MARKER, SchedulerUnavailable
from launcher.slurm import (
    LOST,
    SlurmError,
    SlurmOptions,
    SlurmScheduler,
    SlurmUnavailable,
    SrunScheduler,
    job_environment,
    step_environment,
)
from melissa_dl.runtime.mpi import first_of_launch, keep_pmi_lines_short, launch_problem


class FakeSlurm:
    """Answers Slurm commands from ``states`` (job id -> squeue state) and ``ends`` (job id -> scontrol line)."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple[str, ...], dict[str, str] | None]] = []
        self.states: dict[str, str] = {}
        self.ends: dict[str, str] = {}
        self.next_id = 41
        self.failing: dict[str, str] = {}  # command -> the error it fails with, until removed

    def __call__(self, *argv: str, env: dict[str, str] | None = None) -> str:
        self.calls.append((argv, env))
        if argv[0] in self.failing:
            unreachable = any(words in self.failing[argv[0]] for words in slurm.UNREACHABLE)
            raise (SlurmUnavailable if unreachable else SlurmError)(self.failing[argv[0]])
        if argv[0] == "sbatch":
            self.next_id += 1
            self.states[str(self.next_id)] = "PENDING"
            return f"{self.next_id};cluster\n"
        if argv[0] == "squeue":
            return "".join(f"{job} {state}\n" for job, state in self.states.items())
        if argv[0] == "scancel":
            for job in argv[1:]:
                if self.states.pop(job, None) is not None:
                    self.ends[job] = "JobState=CANCELLED Reason=None ExitCode=0:15"
            return ""
        if "--test-only" in argv:
            return ""
        if argv[0] == "scontrol":
            if argv[-1] not in self.ends:
                raise SlurmError("scontrol show...: Invalid job id specified")
            return self.ends[argv[-1]]
        raise AssertionError(argv)

    def commands(self, name: str) -> list[tuple[str, ...]]:
        return [argv for argv, _ in self.calls if argv[0] == name]


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeSlurm:
    stand_in = FakeSlurm()
    monkeypatch.setattr(slurm, "_slurm", stand_in)
    monkeypatch.setattr(slurm, "POLL", 0.0)
    monkeypatch.setattr(slurm, "UNREACHABLE_POLL", 0.0)
    return stand_in


def scheduler(tmp_path: Path, ranks: int = 1, **options: object) -> SlurmScheduler:
    return SlurmScheduler(
        ["python", "sim.py", "--x", "a b"], tmp_path, ranks, SlurmOptions(**options).sbatch_options(), "melissa-out"
    )


def test_sbatch_gets_the_options_the_log_and_srun_pmi2_for_mpi_simulations(
    tmp_path: Path, fake: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RUN_MARKER, "run7")
    log = tmp_path / "simulations" / "simulation3.attempt1.log"
    log.parent.mkdir()
    job = scheduler(
        tmp_path, ranks=4, partition="short", time_limit="00:10:00", account="proj", sbatch_args=["--mem=1G"]
    ).start(3, 1, {"MELISSA_SIMULATION_ID": "3"}, log)
    assert (job.job_id, job.label) == ("42", "Slurm job 42")
    [argv] = fake.commands("sbatch")
    assert argv == (
        "sbatch",
        "--parsable",
        "--job-name=melissa-out-s3a1",
        f"--output={log}",
        "--open-mode=append",
        "--no-requeue",
        f"--chdir={tmp_path}",
        "--ntasks=4",
        "--partition=short",
        "--time=00:10:00",
        "--account=proj",
        "--mem=1G",
        "--comment=melissa_dl run run7",
        "--wrap",
        "exec srun --mpi=pmi2 --kill-on-bad-exit=1 -n 4 python sim.py --x 'a b'",
    )
    assert log.exists()


def test_one_rank_runs_the_command_itself_and_the_servers_job_is_not_inherited(
    tmp_path: Path, fake: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_CONF", "/etc/test/slurm.conf")
    monkeypatch.delenv(RUN_MARKER, raising=False)
    scheduler(tmp_path).start(0, 0, {"MELISSA_SIMULATION_ID": "0"}, tmp_path / "s.log")
    [(argv, env)] = [(argv, env) for argv, env in fake.calls if argv[0] == "sbatch"]
    assert argv[-1] == "exec python sim.py --x 'a b'" and not any(a.startswith("--comment") for a in argv)
    assert env is not None and "SLURM_JOB_ID" not in env
    assert env["SLURM_CONF"] == "/etc/test/slurm.conf" and env["MELISSA_SIMULATION_ID"] == "0"
    assert job_environment({})["SLURM_CONF"] == "/etc/test/slurm.conf"


def test_a_job_step_keeps_of_the_servers_slurm_variables_only_its_allocation(monkeypatch: pytest.MonkeyPatch) -> None:
    """srun would read the server step's node list and counts as the new step's options."""
    server_step = {
        "SLURM_JOB_ID": "7", "SLURM_JOBID": "7", "SLURM_CONF": "/etc/test/slurm.conf", "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "node[2-5]", "SLURM_STEP_NODELIST": "node[2-3]", "SLURM_NTASKS": "2",
    }  # fmt: skip
    for name, value in server_step.items():
        monkeypatch.setenv(name, value)
    slurm_variables = {k: v for k, v in step_environment({"MELISSA_SIMULATION_ID": "1"}).items() if "SLURM" in k}
    assert slurm_variables == {"SLURM_JOB_ID": "7", "SLURM_JOBID": "7", "SLURM_CONF": "/etc/test/slurm.conf"}
    assert SrunScheduler.environment({"A": "1"}) == step_environment({"A": "1"})


def test_an_answer_that_is_not_a_job_id_is_a_start_failure(
    tmp_path: Path, fake: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slurm, "_slurm", lambda *argv, env=None: "Submitted batch job 5\n")
    with pytest.raises(SlurmError, match="sbatch answered 'Submitted batch job 5', not a job id"):
        scheduler(tmp_path).start(0, 0, {}, tmp_path / "s.log")


@pytest.mark.parametrize(
    "shown, code",
    [
        ("JobState=COMPLETED Reason=None ExitCode=0:0", 0),
        ("JobState=FAILED Reason=NonZeroExitCode ExitCode=3:0", 3),
        ("JobState=CANCELLED Reason=None ExitCode=0:15", -15),
        ("JobState=CANCELLED Reason=None ExitCode=0:0", -15),  # cancelled while pending
        ("JobState=TIMEOUT Reason=TimeLimit ExitCode=0:15", -15),  # as Slurm 22.05 records a time limit
        ("JobState=NODE_FAIL Reason=None ExitCode=0:0", LOST),
        ("no such fields", LOST),
    ],
)
def test_the_exit_code_of_an_ended_job_comes_from_scontrol(
    tmp_path: Path, fake: FakeSlurm, shown: str, code: int
) -> None:
    """An end that Slurm decided (a node's failure, a time limit) is written at the end of the attempt's log, which
    the failure reason quotes; a job's own end is in its output already."""
    log = tmp_path / "s.log"
    job = scheduler(tmp_path).start(0, 0, {}, log)
    assert job.poll() is None and not job.started()
    fake.states[job.job_id] = "RUNNING"
    assert job.poll() is None and job.started()
    del fake.states[job.job_id]  # left squeue
    fake.ends[job.job_id] = f"JobId={job.job_id} JobName=x {shown} RunTime=00:00:01"
    assert job.poll() == code and job.started()
    state, exit_code = shown.partition(" ")[0].removeprefix("JobState="), shown.partition("ExitCode=")[2]
    note = f"slurm: job {job.job_id} ended {state}, exit code {exit_code}\n"
    command, _, after = log.read_text().partition("\n")
    assert command.startswith("melissa_dl: cd ") and "sbatch --parsable" in command  # the attempt's first line
    assert after == (note if state in ("TIMEOUT", "NODE_FAIL") else "")


def test_a_job_slurm_forgot_counts_as_lost(tmp_path: Path, fake: FakeSlurm) -> None:
    job = scheduler(tmp_path).start(0, 0, {}, tmp_path / "s.log")
    del fake.states[job.job_id]
    assert job.poll() == LOST


def test_one_squeue_call_per_poll_for_all_jobs(
    tmp_path: Path, fake: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(slurm, "POLL", 3600.0)
    runs = scheduler(tmp_path)
    jobs = [runs.start(sim, 0, {}, tmp_path / f"{sim}.log") for sim in range(5)]
    for _ in range(3):
        assert [job.poll() for job in jobs] == [None] * 5
    [squeue] = fake.commands("squeue")
    assert squeue[-1] == "--jobs=42,43,44,45,46"


def test_a_controller_that_does_not_answer_changes_nothing(tmp_path: Path, fake: FakeSlurm) -> None:
    job = scheduler(tmp_path).start(0, 0, {}, tmp_path / "s.log")
    fake.states[job.job_id] = "RUNNING"
    assert job.started()
    fake.failing = {
        "squeue": "squeue: error: slurm_load_jobs error: Socket timed out on send/recv operation",
        "scontrol": "scontrol: error: Socket timed out on send/recv operation",
        "scancel": "scancel: error: Socket timed out on send/recv operation",
    }
    assert job.poll() is None and job.started()
    del fake.states[job.job_id]
    fake.ends[job.job_id] = "JobState=FAILED ExitCode=2:0"
    job.terminate()  # not cancelled yet, and no exception
    assert job.poll() is None
    fake.failing = {}
    assert job.poll() == 2
    cancels = fake.commands("scancel")  # the failed ones, then the retry that worked
    assert len(cancels) >= 2 and set(cancels) == {("scancel", job.job_id)}


@pytest.mark.parametrize(
    "said, unavailable",
    [
        ("Batch job submission failed: Unable to contact slurm controller (connect failure)", True),
        ("slurm_load_jobs error: Socket timed out on send/recv operation", True),
        ("Batch job submission failed: Invalid partition name specified", False),
    ],
)
def test_a_controller_that_does_not_answer_is_told_from_a_refusal(said: str, unavailable: bool) -> None:
    """Only the first is waited out (the launcher starts the attempt later); a refusal fails the attempt."""
    with pytest.raises(SlurmError, match=re.escape(said)) as raised:
        slurm._slurm("sh", "-c", f"echo 'sh: error: {said}' >&2; exit 1")
    assert isinstance(raised.value, SchedulerUnavailable) is unavailable


@pytest.mark.parametrize(
    "ranks, nodes_left, launch",
    [
        (8, "4", ["-n", "8"]),
        (8, "2", ["--nodes=2", "-n", "4"]),  # two nodes lost: as many ranks a node as before, on the two left
        (8, "1", ["--nodes=1", "-n", "2"]),
        (6, "1", ["--nodes=1", "-n", "2"]),  # as many as the busiest node had: ceil(6 / 4)
        (2, "3", ["--nodes=2", "-n", "2"]),  # the nodes left can hold them all (the others ran simulations)
        (8, "", ["-n", "8"]),  # Slurm does not answer: as at the start
    ],
)
def test_the_server_restarts_in_an_allocation_that_lost_nodes_on_those_left(
    monkeypatch: pytest.MonkeyPatch, ranks: int, nodes_left: str, launch: list[str]
) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "4")

    def squeue(*argv: str, env: dict[str, str] | None = None) -> str:
        assert argv == ("squeue", "--noheader", "--format=%D", "--jobs=7")
        if not nodes_left:
            raise SlurmError("squeue: error: Socket timed out on send/recv operation")
        return f"{nodes_left}\n"

    monkeypatch.setattr(slurm, "_slurm", squeue)
    assert SlurmScheduler.server_launch(ranks) == ["srun", "--mpi=pmi2", "--kill-on-bad-exit=1", *launch]
    monkeypatch.delenv("SLURM_JOB_ID")
    assert SlurmScheduler.server_launch(ranks) is None


def test_an_unreachable_controller_is_asked_again_only_after_a_longer_pause(
    tmp_path: Path, fake: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each call waits for the controller (``MessageTimeout``), in the server's bookkeeping round."""
    monkeypatch.setattr(slurm, "UNREACHABLE_POLL", 0.5)
    job = scheduler(tmp_path).start(0, 0, {}, tmp_path / "s.log")
    fake.failing = {"squeue": "squeue: error: slurm_load_jobs error: Unable to contact slurm controller"}

    def slow(*argv: str, env: dict[str, str] | None = None) -> str:  # as long as the pause: it counts from the end
        time.sleep(0.6)
        return fake(*argv, env=env)

    monkeypatch.setattr(slurm, "_slurm", slow)
    assert job.poll() is None and job.poll() is None
    assert len(fake.commands("squeue")) == 1
    monkeypatch.setattr(slurm, "_slurm", fake)
    fake.failing = {}
    time.sleep(0.6)
    fake.states[job.job_id] = "RUNNING"
    assert job.poll() is None and job.started() and len(fake.commands("squeue")) >= 2


@pytest.mark.parametrize("submitted", [True, False])
def test_an_sbatch_that_got_no_answer_is_not_submitted_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, submitted: bool
) -> None:
    """A controller that timed out may have taken the job: before the attempt is submitted again, squeue is asked
    for a job of its name, which is followed if there is one."""
    calls: list[tuple[str, ...]] = []

    def controller(*argv: str, env: dict[str, str] | None = None) -> str:
        calls.append(argv)
        if argv[0] == "sbatch" and len(calls) == 1:
            raise SlurmUnavailable("sbatch: error: Batch job submission failed: Socket timed out on send/recv")
        if argv[0] == "squeue":
            return "77\n" if submitted else ""
        return "78;cluster\n"

    monkeypatch.setattr(slurm, "_slurm", controller)
    runs = scheduler(tmp_path)
    with pytest.raises(SchedulerUnavailable):
        runs.start(3, 1, {}, tmp_path / "s.log")
    assert runs.start(3, 1, {}, tmp_path / "s.log").job_id == ("77" if submitted else "78")
    assert calls[1] == ("squeue", "--me", "--noheader", "--states=all", "--name=melissa-out-s3a1", "--format=%i")
    assert [argv[0] for argv in calls] == ["sbatch", "squeue"] + ([] if submitted else ["sbatch"])
    runs.start(4, 0, {}, tmp_path / "t.log")
    assert calls[-1][0] == "sbatch"  # an sbatch that was answered: no question first


def test_a_cancel_that_failed_is_retried_at_the_next_refresh_of_any_job(tmp_path: Path, fake: FakeSlurm) -> None:
    runs = scheduler(tmp_path)
    doomed, other = (runs.start(sim, 0, {}, tmp_path / f"{sim}.log") for sim in range(2))
    fake.failing = {"scancel": "scancel: error: Socket timed out on send/recv operation"}
    doomed.kill()  # the launcher forgets it now
    fake.failing = {}
    assert other.poll() is None
    assert fake.commands("scancel")[-1] == ("scancel", doomed.job_id)
    assert doomed.job_id in fake.ends and other.job_id not in fake.ends


def test_a_slurm_command_that_cannot_even_start_is_a_slurm_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SlurmError, match=r"^squeue: \[Errno 2\] No such file or directory"):
        slurm._slurm("squeue")


def test_job_options_that_sbatch_refuses_are_named(
    tmp_path: Path, fake: FakeSlurm, monkeypatch: pytest.MonkeyPatch
) -> None:
    runs = scheduler(tmp_path, partition="short", time_limit="ten minutes")
    assert runs.dry_run() is None
    [argv] = fake.commands("sbatch")
    assert "--test-only" in argv and "--partition=short" in argv and "--time=ten minutes" in argv
    fake.failing = {"sbatch": "sbatch: error: Invalid --time specification"}
    assert runs.dry_run() == "sbatch refuses the simulations' job options: sbatch: error: Invalid --time specification"
    down = "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)"

    def unreachable(*argv: str, env: dict[str, str] | None = None) -> str:
        raise SlurmUnavailable(down)

    monkeypatch.setattr(slurm, "_slurm", unreachable)
    assert runs.dry_run() == f"Slurm's controller does not answer: {down}"


def test_a_single_job_slurm_forgot_is_lost_not_a_squeue_failure(tmp_path: Path, fake: FakeSlurm) -> None:
    job = scheduler(tmp_path).start(0, 0, {}, tmp_path / "s.log")
    del fake.states[job.job_id]
    fake.failing = {"squeue": "squeue: slurm_load_jobs error: Invalid job id specified"}
    assert job.poll() == LOST


def test_kill_cancels_once_and_waits_for_the_end(tmp_path: Path, fake: FakeSlurm) -> None:
    job = scheduler(tmp_path).start(0, 0, {}, tmp_path / "s.log")
    fake.states[job.job_id] = "RUNNING"
    job.kill()
    assert fake.commands("scancel") == [("scancel", job.job_id)]
    assert job.poll() == -15
    job.terminate()
    job.kill()
    assert len(fake.commands("scancel")) == 1


def test_srun_without_pmi2_is_named_as_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    assert "srun --mpi=pmi2 -n 4 melissa-server CONFIG" in launch_problem(1)
    assert launch_problem(4) is None
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS")
    assert launch_problem(1) is None


@pytest.mark.parametrize(
    "environment, netmod",
    [
        ({"SLURM_MPI_TYPE": "pmi2", "PMI_FD": "11"}, "ofi"),  # srun --mpi=pmi2: UCX's PMI lines overflow Slurm's
        ({"SLURM_MPI_TYPE": "pmi2", "PMI_FD": "11", "MPIR_CVAR_CH4_NETMOD": "ucx"}, "ucx"),  # the user's choice
        ({"SLURM_MPI_TYPE": "pmi2", "PMI_FD": "11", "MPICH_CH4_NETMOD": "ucx"}, None),  # the same, by its alias
        ({"SLURM_MPI_TYPE": "pmix", "PMI_FD": "11"}, None),  # another PMI plugin
        ({"PMI_FD": "11"}, None),  # mpirun's hydra reads whole lines
        ({"SLURM_MPI_TYPE": "pmi2"}, None),  # not a task of an MPI step
    ],
)
def test_under_srun_pmi2_the_mpich_wheel_uses_ofi_unless_the_user_chose(
    monkeypatch: pytest.MonkeyPatch, environment: dict[str, str], netmod: str | None
) -> None:
    monkeypatch.setattr(os, "environ", dict(environment))  # restored after the test, with what was set in it
    chose = keep_pmi_lines_short()
    assert os.environ.get("MPIR_CVAR_CH4_NETMOD") == netmod
    assert chose == (netmod == "ofi")


def test_without_the_mpich_wheel_the_netmod_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A site's MPICH built without OFI would refuse the name in MPI_Init."""

    def absent(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(os, "environ", {"SLURM_MPI_TYPE": "pmi2", "PMI_FD": "11"})
    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    assert not keep_pmi_lines_short()
    assert "MPIR_CVAR_CH4_NETMOD" not in os.environ


@pytest.mark.parametrize(
    "environment, first",
    [
        ({}, True),
        ({"PMI_RANK": "1"}, False),
        ({"PMI_RANK": "0"}, True),
        ({"OMPI_COMM_WORLD_RANK": "2"}, False),
        ({"SLURM_PROCID": "1"}, False),
        ({"SLURM_PROCID": "0"}, True),
    ],
)
def test_the_first_rank_of_a_launch_is_known_before_mpi(
    monkeypatch: pytest.MonkeyPatch, environment: dict, first: bool
) -> None:
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert first_of_launch() is first
