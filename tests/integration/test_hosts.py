"""Across hosts (DESIGN §3, issue 34): the test cluster itself, and a study whose server and simulations run on
different hosts of it, talking over its network (``hosts.py``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    SIMULATIONS,
    STEPS,
    TOY_SIM,
    clean_environment,
    paced_config,
    require_system_packages,
    server_command,
    skip_unless,
)
from hosts import Cluster
from slurm_cluster import SlurmCluster
from test_fault_tolerance import assert_every_step_once

pytestmark = pytest.mark.timeout(240)

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
    assert ran_on.read_text().split() == ["node2"] * SIMULATIONS
    assert_every_step_once(output, ranks=2)


def simulation_command(ran_on: Path, *options: str) -> list[str]:
    """toy_sim (with ``options``), after writing the name of the host it runs on to ``ran_on``."""
    where = f'hostname >> {ran_on} && exec "$@"'
    toy = [sys.executable, TOY_SIM, "--steps", str(STEPS), "--step-delay", "0.05", *options]
    return ["sh", "-c", where, "sh", *toy]


@pytest.mark.parametrize("scheduler", ["slurm", "srun"])
def test_a_study_under_slurm_with_its_server_on_two_hosts_and_its_simulations_on_two_others(
    tmp_path: Path, scheduler: str
) -> None:
    """Slurm across five hosts (slurmctld on node1, slurmd on node2-node5). The server is ``srun --mpi=pmi2``
    with one rank on node2 and one on node3; its simulations are kept off those two, as ``sbatch`` jobs
    (``slurm``) or as steps of the server's own four-node allocation (``srun``). Simulation 1 crashes in its
    first attempt and is relaunched: its exit code came back through either scheduler."""
    require_namespaces()
    require_system_packages("slurm")
    output, ran_on = tmp_path / "output", tmp_path / "ran_on"
    config = paced_config(output)
    config["server"]["interface"] = "eth0"
    failing = ["--fail", "crash", "--fail-simulation", "1"]  # its first attempt exits 1 at step 3
    config["launcher"].update(
        scheduler=scheduler, simulation_timeout=20, max_retries=2, command=simulation_command(ran_on, *failing)
    )
    config["launcher"][scheduler] = {f"{'sbatch' if scheduler == 'slurm' else 'srun'}_args": ["--exclude=node2,node3"]}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    server = f"exec srun --mpi=pmi2 -N 2 -n 2 {sys.executable} -m melissa_dl {path}"
    allocation = ["--nodelist=node2,node3", "--ntasks=2"] if scheduler == "slurm" else ["--nodes=4"]
    with Cluster(5) as hosts:
        (tmp_path / "slurm").mkdir()
        slurm = SlurmCluster(tmp_path / "slurm", hosts)
        try:
            slurm.start()
            job = ["sbatch", "--wait", f"--output={tmp_path / 'job.out'}", f"--chdir={tmp_path}", *allocation]
            done = run(
                slurm.client([*job, "--wrap", server]), 200, {**clean_environment(), "SLURM_CONF": str(slurm.conf)}
            )
        finally:
            slurm.stop()
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert done.returncode == 0, done.stderr + log + slurm.logs()
    assert f"handshake at tcp://{hosts.hosts[1].address}:" in log  # rank 0, on node2
    placed = ran_on.read_text().split()
    report = json.loads((output / "report.json").read_text())
    attempts = {s["id"]: s["attempts"] for s in report["per_simulation"]}
    assert len(placed) == sum(attempts.values()) and set(placed) <= {"node4", "node5"}, placed
    assert attempts == {s: 2 if s == 1 else 1 for s in range(SIMULATIONS)}, attempts
    assert len(report["per_rank_samples"]) == 2 and all(n > 0 for n in report["per_rank_samples"])
    assert_every_step_once(output, ranks=2)
