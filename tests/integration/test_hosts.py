"""Across hosts (docs/how-to/across-nodes.md#tested-across-hosts, issue 34): the test cluster itself, and a study
whose server and simulations run on different hosts of it, talking over its network (``hosts.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from hosts import Cluster, Host
from slurm_cluster import BatchJob, SlurmCluster
from support import (
    SIMULATIONS,
    STEPS,
    TOY_SIM,
    clean_environment,
    committed,
    paced_config,
    require_system_packages,
    server_command,
    skip_unless,
    wait_for,
)
from test_fault_tolerance import assert_every_step_once

# xdist_group: the clusters' tests share one worker, one after another, which starts them before the other tests
pytestmark = [pytest.mark.timeout(240), pytest.mark.xdist_group("clusters")]

LISTEN = """
import socket, sys
server = socket.create_server((sys.argv[1], 0))
print(server.getsockname()[1], flush=True)
while True:
    server.accept()[0].close()
"""
CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()"


def require_namespaces() -> None:
    skip_unless(
        os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("unshare") is not None,
        "needs root, iproute2's ip and unshare: the hosts are network and UTS namespaces",
    )


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    require_namespaces()
    with Cluster(3) as made:
        yield made


def run(command: list[str], timeout: float = 30, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    environment = env if env is not None else clean_environment()
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=environment)


def test_hosts_have_their_names_and_reach_each_other_until_one_is_cut_off(cluster: Cluster) -> None:
    node1, node2, _ = cluster.hosts
    assert run(cluster.on(node1, ["hostname"])).stdout.strip() == "node1"
    listener = subprocess.Popen(
        cluster.on(node2, [sys.executable, "-c", LISTEN, node2.address]), stdout=subprocess.PIPE, text=True
    )
    try:
        assert listener.stdout is not None
        connect = cluster.on(node1, [sys.executable, "-c", CONNECT, node2.address, listener.stdout.readline().strip()])
        assert run(connect).returncode == 0
        cluster.partition(node2)
        assert run(connect).returncode != 0
        cluster.heal(node2)
        assert run(connect).returncode == 0
    finally:
        listener.kill()
        listener.wait(timeout=10)


def test_leaving_the_cluster_removes_every_namespace_also_when_the_test_failed() -> None:
    require_namespaces()
    with pytest.raises(RuntimeError, match="the test failed"), Cluster(2) as made:
        assert len(made.namespaces()) == 3  # two hosts and the switch
        raise RuntimeError("the test failed")
    assert made.namespaces() == set()


def test_a_study_with_its_server_ranks_on_one_host_and_its_simulations_on_another(
    tmp_path: Path, cluster: Cluster
) -> None:
    """The server binds and advertises ``eth0``'s address (``server.interface``), never 127.0.0.1: the
    simulations, on another host, reach it only over the cluster's network."""
    node1, node2, _ = cluster.hosts
    output, ran_on = tmp_path / "output", tmp_path / "ran_on"
    config = paced_config(output)
    config["server"]["interface"] = "eth0"
    config["launcher"]["command"] = cluster.on(node2, simulation_command(ran_on))
    done = run(cluster.on(node1, server_command(tmp_path, config, 2)), timeout=180)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert f"handshake at tcp://{node1.address}:" in log
    assert [line.split()[0] for line in ran_on.read_text().splitlines()] == ["node2"] * SIMULATIONS
    assert_every_step_once(output, ranks=2)


def simulation_command(ran_on: Path, *options: str, step_delay: float = 0.05) -> list[str]:
    """toy_sim (with ``options``), after writing the host it runs on, its simulation and attempt to ``ran_on``."""
    where = f'echo "$(hostname) $MELISSA_SIMULATION_ID $MELISSA_ATTEMPT" >> {ran_on} && exec "$@"'
    toy = [sys.executable, TOY_SIM, "--steps", str(STEPS), "--step-delay", str(step_delay), *options]
    return ["sh", "-c", where, "sh", *toy]


class StudyAcrossHosts:
    """A paced study under Slurm across hosts: slurmctld on node1, slurmd on the others. The server is a batch
    job on node2 and node3, one rank on each, started by ``srun --mpi=pmi2`` or (``supervised``) by
    ``melissa-launcher``; its simulations are kept off those two, as ``sbatch`` jobs (``slurm``) or as steps of
    the server's own allocation (``srun``: node2-node5, whose node2 and node3 the server's step fills). The
    allocation survives a node's loss (``--no-kill``).

    ``run(during)`` calls ``during`` once the job is submitted (to break something); ``recovery`` is then the
    seconds from ``broken_at`` to the moment ``during`` saw the study recover."""

    def __init__(
        self, tmp_path: Path, scheduler: str, *toy_options: str, step_delay: float = 0.05, supervised: bool = False
    ) -> None:
        self.tmp_path = tmp_path
        self.output, self.ran_on = tmp_path / "output", tmp_path / "ran_on"
        self.config = paced_config(self.output)
        self.config["server"]["interface"] = "eth0"
        self.config["launcher"].update(
            scheduler=scheduler,
            simulation_timeout=20,
            max_retries=2,
            command=simulation_command(self.ran_on, *toy_options, step_delay=step_delay),
        )
        if scheduler == "slurm":
            self.config["launcher"]["slurm"] = {"sbatch_args": ["--exclude=node2,node3"]}
        self.supervised = supervised
        nodes = ["--nodelist=node2,node3"] if scheduler == "slurm" else ["--nodes=4"]
        self.allocation = [*nodes, "--ntasks-per-node=1", "--no-kill"]
        self.hosts = Cluster(5)
        self.slurm: SlurmCluster
        self.log = ""
        self.broken_at = self.recovery = 0.0

    def run(self, during: Callable[[BatchJob], None] | None = None) -> None:
        require_namespaces()
        require_system_packages("slurm")
        path = self.tmp_path / "config.json"
        path.write_text(json.dumps(self.config))
        server = f"{sys.executable} -m melissa_dl.supervisor -n 2" if self.supervised else (
            f"srun --mpi=pmi2 -N 2 -n 2 {sys.executable} -m melissa_dl"
        )  # fmt: skip
        job_out = self.tmp_path / "job.out"
        with self.hosts:
            (self.tmp_path / "slurm").mkdir()
            self.slurm = SlurmCluster(self.tmp_path / "slurm", self.hosts)
            try:
                self.slurm.start()
                job = self.slurm.submit(
                    f"--output={job_out}", f"--chdir={self.tmp_path}", *self.allocation, "--wrap",
                    f"exec {server} {path}", env=clean_environment(),
                )  # fmt: skip
                if during is not None:
                    during(job)
                code = job.wait(timeout=200)
            finally:
                self.slurm.stop()
        self.log = job_out.read_text() if job_out.exists() else ""
        assert code == 0, self.log + self.slurm.logs()

    def host(self, name: str) -> Host:
        return next(host for host in self.hosts.hosts if host.name == name)

    def placed(self) -> list[tuple[str, int, int]]:
        """(host, simulation, attempt) of every attempt started so far, in start order."""
        lines = self.ran_on.read_text().splitlines() if self.ran_on.exists() else []
        return [(host, int(sim), int(attempt)) for host, sim, attempt in (line.split() for line in lines)]

    def samples_received(self) -> int:
        """As the server's latest status says (0 before its first)."""
        try:
            return int(json.loads((self.output / "status.json").read_text())["samples"]["received"])
        except FileNotFoundError:
            return 0

    def break_first_simulation_host(self, job: BatchJob, fault: Callable[[Host], None]) -> tuple[Host, int]:
        """Once a simulation has sent data, ``fault`` to its host; the host and the simulation."""
        wait_for(lambda: self.samples_received() >= 2, job, timeout=120)
        victim, simulation, _ = self.placed()[0]
        self.broken_at = time.monotonic()
        fault(self.host(victim))
        return self.host(victim), simulation

    def wait_for_relaunch(self, job: BatchJob, simulation: int) -> None:
        """Until the study relaunched ``simulation`` on another host: then it has recovered."""
        wait_for(lambda: any(sim == simulation and attempt > 0 for _, sim, attempt in self.placed()), job, 120)
        self.recovery = time.monotonic() - self.broken_at

    def report(self) -> dict:
        return json.loads((self.output / "report.json").read_text())

    def attempts(self) -> dict[int, int]:
        return {s["id"]: s["attempts"] for s in self.report()["per_simulation"]}

    def assert_exact(self, ranks: int = 2) -> None:
        """Every sample received and trained on once, every attempt accounted for, and the recovery said."""
        report = self.report()
        assert report["simulations"]["done"] == SIMULATIONS, report["simulations"]
        assert report["samples_received"] == report["samples_consumed"] == SIMULATIONS * STEPS
        assert report["training"]["samples_trained"] == SIMULATIONS * STEPS
        assert len(self.placed()) == sum(self.attempts().values()), self.placed()
        assert len(report["per_rank_samples"]) == ranks and all(n > 0 for n in report["per_rank_samples"])
        assert_every_step_once(self.output, ranks=ranks)
        if self.broken_at:
            print(f"RECOVERY {self.recovery:.1f} s, {report['samples_received']} samples once each")


@pytest.mark.parametrize("scheduler", ["slurm", "srun"])
def test_a_study_under_slurm_with_its_server_on_two_hosts_and_its_simulations_on_two_others(
    tmp_path: Path, scheduler: str
) -> None:
    """Simulation 1 crashes in its first attempt and is relaunched: its exit code came back through either
    scheduler; the simulations ran on node4 and node5 only."""
    study = StudyAcrossHosts(tmp_path, scheduler, "--fail", "crash", "--fail-simulation", "1")  # exits 1 at step 3
    study.run()
    assert f"handshake at tcp://{study.host('node2').address}:" in study.log  # rank 0
    assert study.attempts() == {s: 2 if s == 1 else 1 for s in range(SIMULATIONS)}
    assert {host for host, _, _ in study.placed()} <= {"node4", "node5"}
    study.assert_exact()


def test_a_simulation_host_lost_mid_study_its_simulations_are_relaunched_on_another(tmp_path: Path) -> None:
    """Every process on the host killed and its link down: Slurm declares the node down and its jobs NODE_FAIL
    (``SlurmdTimeout``); the study relaunches them, where Slurm places them, on the host left."""
    study = StudyAcrossHosts(tmp_path, "slurm", step_delay=0.3)
    lost: list[tuple[Host, int]] = []

    def lose_a_simulation_host(job: BatchJob) -> None:
        lost.append(study.break_first_simulation_host(job, study.hosts.lose))
        study.wait_for_relaunch(job, lost[0][1])

    study.run(during=lose_a_simulation_host)
    [(host, simulation)] = lost
    relaunched = [(where, sim) for where, sim, attempt in study.placed() if attempt > 0]
    assert relaunched and all(where != host.name for where, _ in relaunched), study.placed()
    failure = study.report()["per_simulation"][simulation]["reason"]
    assert failure.startswith("exit code 255") and "ended NODE_FAIL" in failure, failure
    study.assert_exact()


def test_a_simulation_host_cut_off_longer_than_the_client_timeout_then_back_changes_nothing_twice(
    tmp_path: Path,
) -> None:
    """Its simulation gives up (``client_timeout``) while Slurm declares the node down; once the study relaunched
    it elsewhere, the link comes back and the node rejoins (``ReturnToService``). No hang, and nothing of the
    old attempt is counted or trained on twice."""
    study = StudyAcrossHosts(tmp_path, "slurm", step_delay=0.3)
    client_timeout = 3.0
    study.config["launcher"]["client_timeout"] = client_timeout
    cut: list[tuple[Host, int]] = []

    def cut_off_and_heal(job: BatchJob) -> None:
        cut.append(study.break_first_simulation_host(job, study.hosts.partition))
        study.wait_for_relaunch(job, cut[0][1])
        wait_for(lambda: time.monotonic() - study.broken_at > client_timeout + 1, job)
        study.hosts.heal(cut[0][0])
        rejoined = time.monotonic() + 60  # ReturnToService=2: down for not answering, back once it does
        while "down" in (state := study.slurm.run("sinfo", "--noheader", "--format=%T", f"--nodes={cut[0][0].name}")):
            assert time.monotonic() < rejoined, f"{cut[0][0].name} still {state.strip()} after the heal"
            time.sleep(0.3)

    study.run(during=cut_off_and_heal)
    [(host, simulation)] = cut
    assert study.attempts()[simulation] >= 2
    study.assert_exact()


def test_the_launcher_rides_over_a_restart_of_slurmctld(tmp_path: Path) -> None:
    """slurmctld stopped while simulations run: their jobs' ends cannot be read (squeue fails), so the study
    frees the slots of those whose data is all in after ``simulation_timeout`` (scancel fails too, and is tried
    again), and the next attempts' sbatch fails: they wait, uncounted, until slurmctld, started again from its
    saved state, answers."""
    study = StudyAcrossHosts(tmp_path, "slurm", step_delay=0.3)
    study.config["launcher"]["simulation_timeout"] = 8

    def restart_slurmctld(job: BatchJob) -> None:
        wait_for(lambda: study.samples_received() >= 2, job, timeout=120)
        started = len(study.placed())
        study.broken_at = time.monotonic()
        study.slurm.stop_controller()
        wait_for(lambda: "not started yet" in (study.output / "logs" / "rank0.log").read_text(), job, 90)
        study.slurm.start_controller()
        study.broken_at = time.monotonic()  # recovery: from slurmctld's return to the next attempt's start
        wait_for(lambda: len(study.placed()) > started, job, timeout=120)
        study.recovery = time.monotonic() - study.broken_at

    study.run(during=restart_slurmctld)
    assert "Unable to contact slurm controller" in study.log
    assert study.attempts() == dict.fromkeys(range(SIMULATIONS), 1)
    study.assert_exact()


def test_a_server_host_lost_the_launcher_resumes_the_study_on_the_host_left(tmp_path: Path) -> None:
    """melissa-launcher in the allocation runs the server on node2 and node3; node3 dies: Slurm takes it out of
    the allocation, the server's step ends, and the launcher restarts the server from its last checkpoint on one
    rank, on node2 (elastic K)."""
    study = StudyAcrossHosts(tmp_path, "slurm", step_delay=0.3, supervised=True)
    study.config["launcher"].update(server_timeout=60.0, max_server_restarts=2)

    def lose_a_server_host(job: BatchJob) -> None:
        wait_for(lambda: committed(study.output) and study.samples_received() >= 4, job, timeout=120)
        study.broken_at = time.monotonic()
        study.hosts.lose(study.host("node3"))
        rank0 = study.output / "logs" / "rank0.log"
        wait_for(lambda: "resuming from checkpoint" in rank0.read_text(), job, timeout=120)
        study.recovery = time.monotonic() - study.broken_at

    study.run(during=lose_a_server_host)
    assert "the server runs on 1 ranks instead of 2" in study.log
    assert "restarting it from its checkpoints (restart 1 of 2)" in study.log
    study.assert_exact(ranks=1)
