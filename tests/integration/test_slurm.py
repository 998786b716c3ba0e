"""Studies on a real one-node Slurm cluster (slurm_cluster.py): simulations as sbatch jobs, the server under srun."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from slurm_cluster import BatchJob, SlurmCluster
from support import (
    HERE,
    SIMULATIONS,
    STEPS,
    TOY_SIM,
    clean_environment,
    committed,
    paced_config,
    require_system_packages,
    run_server,
    server_command,
    skip_unless,
    start,
    study_config,
    wait_for,
)
from test_example_configs import check
from test_fault_tolerance import assert_every_step_once, assert_stopped_after_a_final_checkpoint

from melissa_dl.runtime.status import EXIT_FAILED_SIMULATIONS, EXIT_STOPPED

# xdist_group: the clusters' tests share one worker, one after another, which starts them before the other tests
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("clusters")]

EXAMPLE = HERE.parent.parent / "examples" / "heat_pde"
JOB = "melissa-output"  # the simulations' job names: melissa-<output folder name>-s<id>a<attempt>


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    require_system_packages("slurm")
    skip_unless(os.geteuid() == 0, "the test Slurm cluster needs root: slurmd starts jobs as their owner")
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def slurm_conf(slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command of these tests, and what it starts, talks to the test cluster."""
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))


class QueueWatch:
    """Lists the queue's simulation jobs every 0.2 s while a study runs."""

    def __init__(self, cluster: SlurmCluster) -> None:
        self.most = 0  # simulation jobs listed at once, pending or running
        self.running: set[str] = set()  # names of the jobs seen running
        self.error: Exception | None = None
        self._cluster = cluster
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        try:
            while not self._done.wait(0.2):
                listed = [
                    line.split() for line in self._cluster.run("squeue", "--noheader", "--format=%j %T").splitlines()
                ]
                jobs = [(name, state) for name, state in listed if name.startswith(JOB)]
                self.most = max(self.most, len(jobs))
                self.running.update(name for name, state in jobs if state == "RUNNING")
        except Exception as error:  # a watch with a gap would prove nothing: stop() says so
            self.error = error

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        assert self.error is None, f"squeue failed while watching: {self.error!r}"


def slurm_study(output: Path, command: list[str], **launcher: Any) -> dict[str, Any]:
    return study_config(output, command, launcher={"scheduler": "slurm", "simulation_timeout": 60, **launcher})


def sbatch(slurm: SlurmCluster, tmp_path: Path, *job: str, env: dict[str, str]) -> BatchJob:
    """``job`` (a script and its arguments, or ``--wrap``) submitted, its output in tmp_path/job.out."""
    return slurm.submit(f"--output={tmp_path / 'job.out'}", f"--chdir={tmp_path}", *job, env=env)


def venv_environment() -> dict[str, str]:
    """As after ``source .venv/bin/activate``: what the example batch script expects (sbatch passes it on)."""
    env = clean_environment()
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def report(output: Path) -> dict[str, Any]:
    return json.loads((output / "report.json").read_text())


def test_the_heat_study_runs_with_its_server_under_srun_in_an_allocation(
    tmp_path: Path, output: Path, slurm: SlurmCluster
) -> None:
    steps, simulations = 20, 4
    config = json.loads((EXAMPLE / "config_slurm.json").read_text())
    config["output_dir"] = str(output)
    config["study"].update(simulations=simulations, time_steps=steps, validation={"simulations": 1, "seed": 1})
    config["server"].update(status_interval=1.0)
    config["buffer"].update(per_server_watermark=8)
    assert (config["launcher"]["scheduler"], config["launcher"]["client_ranks"]) == ("slurm", 2)
    config["launcher"].update(
        command=[sys.executable, str(EXAMPLE / "heat.py"), "--mpi", "--nx", "16", "--ny", "16", "--steps", str(steps)],
        job_limit=2,
    )
    config["training"]["module"] = str(EXAMPLE / "surrogate.py")
    config["training"]["options"].update(nx=16, ny=16, steps=steps, hidden=32, depth=1)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    server = [sys.executable, "-m", "melissa_dl", str(path)]
    job = sbatch(
        slurm,
        tmp_path,
        "--ntasks=2",
        "--wrap",
        f"exec srun --mpi=pmi2 -n 2 {' '.join(server)}",
        env=clean_environment(),
    )
    code = job.wait(timeout=240)
    log = (tmp_path / "job.out").read_text()
    assert code == 0, log
    result = report(output)
    assert result["simulations"]["done"] == simulations + 1  # and the held-out one, run as a Slurm job too
    assert result["held_out"] == {"simulations": 1, "samples": steps}
    assert result["samples_received"] == (simulations + 1) * steps == result["samples_expected"]
    assert result["rejected"] == {}
    assert all(count > 0 for count in result["per_rank_samples"]) and len(result["per_rank_samples"]) == 2
    assert all(s["attempts"] == 1 for s in result["per_simulation"])  # and each was 2 ranks: hellos say so


def test_srun_without_pmi2_is_refused_naming_the_fix(tmp_path: Path, output: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(slurm_study(output, [sys.executable, TOY_SIM])))
    done = subprocess.run(
        ["srun", "-n", "2", sys.executable, "-m", "melissa_dl", str(path)],
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("melissa-server:")]
    assert lines == [
        "melissa-server: srun started 2 tasks but MPI sees one rank in each: start the server with "
        "`srun --mpi=pmi2 -n 2 melissa-server CONFIG` (the mpich wheel's MPI needs srun's pmi2 plugin)"
    ], done.stderr
    assert not (output / "checkpoints").exists()


def test_the_queue_never_holds_more_simulations_than_job_limit(
    tmp_path: Path, output: Path, slurm: SlurmCluster
) -> None:
    config = slurm_study(output, [sys.executable, TOY_SIM, "--step-delay", "0.05"], job_limit=2)
    config["study"]["simulations"] = 6
    watch = QueueWatch(slurm)
    run = run_server(tmp_path, config, ranks=1, timeout=240)
    watch.stop()
    assert run.code == 0, run.log
    assert run.report is not None and run.report["samples_received"] == 6 * 10
    assert watch.most == 2, "job_limit 2: two jobs at once, never more"
    assert watch.running, "squeue never showed a simulation running"


def test_a_simulation_cancelled_with_scancel_is_relaunched_and_the_study_completes(
    tmp_path: Path, output: Path, slurm: SlurmCluster
) -> None:
    config = slurm_study(output, [sys.executable, TOY_SIM, "--step-delay", "0.5"], job_limit=4, max_retries=1)
    server = start(server_command(tmp_path, config, 1))
    watch = QueueWatch(slurm)
    wait_for(lambda: f"{JOB}-s1a0" in watch.running, server)
    slurm.run("scancel", f"--name={JOB}-s1a0")
    log, _ = server.communicate(timeout=240)
    watch.stop()
    assert server.returncode == 0, log
    result = report(output)
    assert result["samples_received"] == 4 * 10 == result["samples_expected"]
    cancelled = result["per_simulation"][1]
    assert cancelled["attempts"] == 2 and cancelled["reason"].startswith("exit code -"), cancelled
    assert "CANCELLED" in cancelled["reason"], cancelled  # slurmstepd's line, from the job's output tail


def test_a_simulation_that_always_fails_is_reported_with_its_exit_code_and_output(tmp_path: Path, output: Path) -> None:
    command = [sys.executable, TOY_SIM, "--fail", "crash", "--fail-simulation", "1", "--fail-attempts", "99"]
    run = run_server(tmp_path, slurm_study(output, command, max_retries=1), ranks=1, timeout=240)
    assert run.code == 3, run.log
    assert run.report is not None
    failed = run.report["per_simulation"][1]
    assert (failed["state"], failed["attempts"]) == ("failed", 2)
    assert failed["reason"] == (
        f"exit code 1; output ({output / 'simulations' / 'simulation1.attempt1.log'}): "
        "toy_sim: crashing on purpose at step 3"
    ), failed
    assert run.report["simulations"]["done"] == 3


def test_a_client_error_on_two_ranks_is_not_relaunched_whatever_srun_writes_after_it(
    tmp_path: Path, output: Path
) -> None:
    """srun writes its own lines after the program's (``srun: error: vm: task 0: Exited with exit code 1``): the
    ClientError is judged on the program's last line, and the reason names both."""
    failing = ["--fail", "client-error", "--fail-simulation", "1", "--fail-attempts", "9"]
    command = [sys.executable, TOY_SIM, "--mpi", *failing]
    run = run_server(tmp_path, slurm_study(output, command, max_retries=1, client_ranks=2), ranks=1, timeout=240)
    assert run.code == EXIT_FAILED_SIMULATIONS, run.log
    assert run.report is not None
    failed = run.report["per_simulation"][1]
    assert (failed["state"], failed["attempts"]) == ("failed", 1), failed
    assert re.search(
        r"ClientError: field 'undeclared' was not declared \(declared: \['field'\]\)( \| [^|]*)* \| srun: error: ",
        failed["reason"],
    ), failed
    assert run.report["simulations"]["done"] == 3


def test_the_example_slurm_config_passes_the_check_against_the_cluster(tmp_path: Path, slurm: SlurmCluster) -> None:
    done = check(EXAMPLE / "config_slurm.json", tmp_path)  # sbatch --test-only of its job options included
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["launcher"]["scheduler"] == "slurm"


@pytest.mark.parametrize(
    "slurm_options, refusal",
    [
        ({"partition": "nowhere"}, "Invalid partition name specified"),
        ({"time_limit": "ten minutes"}, "sbatch: error: Invalid --time specification"),
    ],
)
def test_job_options_that_sbatch_refuses_are_one_line_with_exit_code_2(
    tmp_path: Path, output: Path, slurm_options: dict, refusal: str, slurm: SlurmCluster
) -> None:
    config = slurm_study(output, [sys.executable, TOY_SIM], slurm=slurm_options)
    for command in (server_command(tmp_path, config, 1, "--check"), server_command(tmp_path, config, 2)):
        done = subprocess.run(command, env=clean_environment(), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2, done.stderr
        [line] = done.stderr.strip().splitlines()
        assert line.startswith(
            f"melissa-server: {tmp_path / 'config.json'}: launcher.slurm: sbatch refuses the simulations' job options: "
        ) and line.endswith(refusal), line
    assert not output.exists() and slurm.run("squeue", "--noheader") == ""


def test_the_example_batch_script_restarts_a_server_rank_killed_with_kill_9(
    tmp_path: Path, output: Path, slurm: SlurmCluster
) -> None:
    """examples/heat_pde/study.sbatch: melissa-launcher in the allocation, on a paced study of 2-rank servers."""
    config = paced_config(output, server_timeout=30.0, max_server_restarts=2, scheduler="slurm")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    job = sbatch(slurm, tmp_path, str(EXAMPLE / "study.sbatch"), str(path), env=venv_environment())
    wait_for(lambda: committed(output), job, timeout=240)
    pid = int(re.search(r"server rank 1 of 2, pid (\d+)", (output / "logs" / "rank1.log").read_text()).group(1))
    os.kill(pid, signal.SIGKILL)
    code = job.wait(timeout=240)
    log = (tmp_path / "job.out").read_text()
    assert code == 0, log
    assert "restarting it from its checkpoints (restart 1 of 2)" in log
    assert "cancelled the Slurm jobs of the ended server's simulations" in log
    assert "resuming from checkpoint" in (output / "logs" / "rank0.log").read_text()
    result = report(output)
    assert result["simulations"]["done"] == SIMULATIONS
    assert result["samples_received"] == SIMULATIONS * STEPS == result["samples_expected"]
    assert slurm.run("squeue", "--noheader").strip() == "", "a job of the study outlived it"


@pytest.mark.parametrize("how", ["every rank, twice", "the batch script"])
def test_a_stop_of_the_example_batch_job_checkpoints_and_the_study_resumes(
    tmp_path: Path, output: Path, slurm: SlurmCluster, how: str
) -> None:
    """examples/heat_pde/study.sbatch stopped with SIGTERM from ``scancel``: on every server rank at once (its
    steps' tasks), twice 100 ms apart, or once on the batch script alone, as ``#SBATCH --signal=B:TERM@120`` does
    before a time limit (the supervisor passes it on through srun as SIGUSR1: srun answers SIGTERM by killing its
    tasks). One graceful stop: the job exits 75 after a final checkpoint; submitted again, the study resumes to its
    end, every step once."""
    config = paced_config(output, server_timeout=30.0, max_server_restarts=2, scheduler="slurm")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    job = sbatch(slurm, tmp_path, str(EXAMPLE / "study.sbatch"), str(path), env=venv_environment())
    wait_for(lambda: committed(output), job, timeout=240)
    scancel = ["scancel", "--signal=TERM", *(["--batch"] if how == "the batch script" else []), job.id]
    slurm.run(*scancel)
    if how.endswith("twice"):  # the stop's copy: one stop still
        time.sleep(0.1)
        slurm.run(*scancel)
    code = job.wait(timeout=120)
    log = (tmp_path / "job.out").read_text()
    assert code == EXIT_STOPPED, log
    assert_stopped_after_a_final_checkpoint(
        log, output, signal.SIGUSR1 if how == "the batch script" else signal.SIGTERM
    )
    assert "server stopped on request (its exit code 75)" in log, log
    assert not (output / "report.json").exists()
    job = sbatch(slurm, tmp_path, str(EXAMPLE / "study.sbatch"), str(path), env=venv_environment())
    assert job.wait(timeout=240) == 0, (tmp_path / "job.out").read_text()
    assert "resuming from checkpoint" in (output / "logs" / "rank0.log").read_text()
    result = report(output)
    assert result["simulations"]["done"] == SIMULATIONS
    assert result["samples_received"] == SIMULATIONS * STEPS == result["samples_expected"]
    assert_every_step_once(output, ranks=2)
    assert slurm.run("squeue", "--noheader").strip() == "", "a job of the study outlived it"
