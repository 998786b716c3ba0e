"""Slurm clusters for the tests: Debian's munged, slurmctld and slurmd on free ports.

On one node (this machine, over 127.0.0.1), or across the hosts of a
``hosts.Cluster``: slurmctld on the first host, one slurmd per other host,
each node named after its host and reached at its address; clients then run
on a host (``client``), since only the hosts share a network. Everything it
writes (munge key and socket, slurm.conf, state, per-node spool, pid and
log files through ``%n``) is in one folder; clients find it through
``SLURM_CONF``. munged's socket is a file, which every host reaches. The
daemons run as the current user, which must be root: slurmd starts jobs as
their owner.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
from pathlib import Path

from conftest import free_port
from hosts import Cluster, Host

READY_TIMEOUT = 60.0  # seconds for the node to come up idle


class SlurmCluster:
    """Start with :meth:`start`, use :attr:`env` for clients, end with :meth:`stop`."""

    def __init__(self, root: Path, hosts: Cluster | None = None) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.hosts = hosts
        self.controller: Host | None = hosts.hosts[0] if hosts is not None else None
        self.compute: list[Host] = hosts.hosts[1:] if hosts is not None else []
        self.nodes = [h.name for h in self.compute] or [socket.gethostname().split(".")[0]]
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._daemons: list[subprocess.Popen[bytes]] = []

    def client(self, argv: list[str]) -> list[str]:
        """``argv`` run where Slurm's clients reach the controller: on the controller's host, if on hosts."""
        return argv if self.hosts is None or self.controller is None else self.hosts.on(self.controller, argv)

    def start(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(mode=0o700)
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket_path = munge / "munge.sock"
        self._daemon(
            "munged",
            "--foreground",
            "--force",
            f"--key-file={key}",
            f"--socket={socket_path}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={self.root / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
        )
        self._wait(socket_path.exists, "munged's socket")
        for folder in ("state", *(f"spool/{node}" for node in self.nodes)):
            (self.root / folder).mkdir(parents=True)
        self.conf.write_text(self._slurm_conf(socket_path))
        if self.hosts is None:
            self._daemon("slurmctld", "-D", "-i", "-f", str(self.conf))
            self._daemon("slurmd", "-D", "-f", str(self.conf))
        else:
            assert self.controller is not None
            self._daemon(*self.hosts.on(self.controller, ["slurmctld", "-D", "-i", "-f", str(self.conf)]))
            for host in self.compute:
                self._daemon(*self.hosts.on(host, ["slurmd", "-D", "-N", host.name, "-f", str(self.conf)]))
        self._wait(lambda: self.states() == {"idle"}, "every node idle")

    def states(self) -> set[str]:
        """The states of the nodes, as sinfo lists them."""
        return set(self.run("sinfo", "--noheader", "--format=%T").split())

    def _slurm_conf(self, munge_socket: Path) -> str:
        root = self.root
        return "\n".join(
            [
                "ClusterName=melissatest",
                f"SlurmctldHost={self._controller()}",
                f"SlurmctldPort={free_port()}",
                f"SlurmdPort={free_port()}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={munge_socket}",
                f"StateSaveLocation={root / 'state'}",
                f"SlurmdSpoolDir={root / 'spool' / '%n'}",  # made by start(), one per node
                f"SlurmctldPidFile={root / 'slurmctld.pid'}",
                f"SlurmdPidFile={root / 'slurmd.%n.pid'}",
                f"SlurmctldLogFile={root / 'slurmctld.log'}",
                f"SlurmdLogFile={root / 'slurmd.%n.log'}",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/none",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "MpiDefault=none",
                "ReturnToService=2",
                "SchedulerParameters=sched_interval=1",
                "JobCompType=jobcomp/none",
                "AccountingStorageType=accounting_storage/none",
                "MinJobAge=60",
                # MPICH names its shared memory after the job id: a rank killed by a test leaves its segment in
                # /dev/shm, which the same job id on the next test cluster would attach to and fail in MPI_Init
                f"FirstJobId={random.SystemRandom().randrange(1000, 60_000_000)}",
                "KillWait=5",
                *self._nodes(),
                f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP "
                "OverSubscribe=FORCE",
                "",
            ]
        )

    def _controller(self) -> str:
        if self.controller is None:
            return f"{self.nodes[0]}(127.0.0.1)"
        return f"{self.controller.name}({self.controller.address})"

    def _nodes(self) -> list[str]:
        cpus = os.cpu_count()
        if not self.compute:
            return [f"NodeName={self.nodes[0]} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN"]
        return [f"NodeName={h.name} NodeAddr={h.address} CPUs={cpus} State=UNKNOWN" for h in self.compute]

    def _daemon(self, *argv: str) -> None:
        log = open(self.root / f"{argv[0]}.out", "wb")
        self._daemons.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env))
        log.close()

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if any(daemon.poll() is not None for daemon in self._daemons):
                break
            try:
                if ready():
                    return
            except subprocess.CalledProcessError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"test Slurm cluster: no {what} within {READY_TIMEOUT:.0f} s\n{self.logs()}")

    def run(self, *argv: str) -> str:
        """A Slurm client command against this cluster; its standard output."""
        return subprocess.run(
            self.client(list(argv)), env=self.env, capture_output=True, text=True, check=True, timeout=60
        ).stdout

    def logs(self) -> str:
        """The end of every daemon log, for a failure message."""
        tails = []
        for path in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out")):
            tails.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(tails)

    def stop(self) -> None:
        """Cancel what still runs, then stop the daemons this cluster started, by pid."""
        try:
            self.run("scancel", "--full", "--user", str(os.getuid()))
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            pass
        for daemon in reversed(self._daemons):
            daemon.terminate()
            try:
                daemon.wait(timeout=15)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
