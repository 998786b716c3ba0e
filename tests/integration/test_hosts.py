"""Across hosts (DESIGN §3, issue 34): the test cluster itself, and a study whose server and simulations run on
different hosts of it, talking over its network (``hosts.py``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import SIMULATIONS, STEPS, TOY_SIM, clean_environment, paced_config, server_command, skip_unless
from hosts import Cluster
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


def run(command: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=clean_environment())


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
    where = f'hostname >> {ran_on} && exec "$@"'
    config["launcher"]["command"] = cluster.on(
        node2, ["sh", "-c", where, "sh", sys.executable, TOY_SIM, "--steps", str(STEPS), "--step-delay", "0.05"]
    )
    done = run(cluster.on(node1, server_command(tmp_path, config, 2)), timeout=180)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert f"handshake at tcp://{node1.address}:" in log
    assert ran_on.read_text().split() == ["node2"] * SIMULATIONS
    assert_every_step_once(output, ranks=2)
