"""Slurm clusters for the tests: Debian's munged, slurmctld and slurmd on free ports.

On one node (this machine, over 127.0.0.1), or across the hosts of a
``hosts.Cluster``: slurmctld on the first host, one slurmd per other host,
each node named after its host and reached at its address; clients then run
on a host (``client``), since only the hosts share a network. Everything it
writes (munge key and socket, slurm.conf, state, pid and
log files through ``%n``) is in one folder, but for slurmd's spools (in a
short folder under /tmp); clients find it through
``SLURM_CONF``. munged's socket is a file, which every host reaches. The
daemons run as the current user, which must be root: slurmd starts jobs as
their owner.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from hosts import Cluster, Host
from support import free_port

READY_TIMEOUT = 60.0  # seconds for the node to come up idle
ENDED = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "PREEMPTED", "DEADLINE"}
)
NODE_TIMEOUT = 5  # SlurmdTimeout across hosts: seconds before an unreachable node is declared down


class BatchJob:
    """A batch job of the test cluster, followed as a ``Popen`` is (``poll``, ``wait``, ``returncode``): its exit
    code, or 128 + the signal that ended it. Asked of scontrol every 0.3 s: ``sbatch --wait`` sleeps up to 32 s
    between two looks, longer than a test's study."""

    def __init__(self, cluster: SlurmCluster, job_id: str) -> None:
        self.id = job_id
        self.returncode: int | None = None
        self._cluster = cluster

    def poll(self) -> int | None:
        try:
            shown = self._cluster.run("scontrol", "--oneliner", "show", "job", self.id)
        except subprocess.CalledProcessError:  # a controller restarting
            return None
        state, code = re.search(r"\bJobState=(\S+)", shown), re.search(r"\bExitCode=(\d+):(\d+)", shown)
        if state is not None and code is not None and state.group(1) in ENDED:
            self.returncode = 128 + int(code.group(2)) if int(code.group(2)) else int(code.group(1))
        return self.returncode

    def __str__(self) -> str:
        """The job as scontrol shows it, the end of its output and the daemons' logs: for a failure message."""
        try:
            shown = self._cluster.run("scontrol", "--oneliner", "show", "job", self.id)
        except subprocess.CalledProcessError as error:
            return f"Slurm job {self.id}: {error}\n{self._cluster.logs()}"
        output = re.search(r"\bStdOut=(\S+)", shown)
        path = Path(output.group(1)) if output is not None else None
        tail = path.read_text(errors="replace").splitlines()[-60:] if path is not None and path.exists() else []
        return "\n".join([shown.strip(), f"--- {path}", *tail, self._cluster.logs()])

    def wait(self, timeout: float = 240) -> int:
        deadline = time.monotonic() + timeout
        while (code := self.poll()) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"still not ended after {timeout:.0f} s: {self}")
            time.sleep(0.3)
        return code


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
        # slurmd's step sockets live in its spool folder, and a socket's path may not pass 108 bytes: a folder of
        # its own under /tmp, whatever the depth of root (a parallel run's workers add one more level)
        self.spool = Path(tempfile.mkdtemp(prefix="mdl-slurmd-"))
        self._daemons: list[subprocess.Popen[bytes]] = []
        self._controller_process: subprocess.Popen[bytes]

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
        (self.root / "state").mkdir()
        for node in self.nodes:
            (self.spool / node).mkdir()
        self.conf.write_text(self._slurm_conf(socket_path))
        self.start_controller()
        if self.hosts is None:
            self._daemon("slurmd", "-D", "-f", str(self.conf))
        else:
            for host in self.compute:
                self._daemon(*self.hosts.on(host, ["slurmd", "-D", "-N", host.name, "-f", str(self.conf)]))
        self._wait(lambda: self.states() == {"idle"}, "every node idle")

    def start_controller(self) -> None:
        """slurmctld, which reads the state it saved when stopped (jobs, nodes) back."""
        self._controller_process = self._daemon(*self.client(["slurmctld", "-D", "-i", "-f", str(self.conf)]))

    def stop_controller(self) -> None:
        """Stop slurmctld as an administrator does (SIGTERM: it saves its state); the jobs run on."""
        self._controller_process.terminate()
        self._controller_process.wait(timeout=30)

    def submit(self, *job: str, env: dict[str, str] | None = None) -> BatchJob:
        """``sbatch`` of ``job`` (its options, then a script or ``--wrap``) with ``env`` exported to it."""
        return BatchJob(self, self.run("sbatch", "--parsable", *job, env=env).strip().split(";")[0])

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
                f"SlurmdSpoolDir={self.spool / '%n'}",  # made by start(), one per node
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
                # across hosts, a node that does not answer is down within seconds, as the tests of its loss need
                *([f"SlurmdTimeout={NODE_TIMEOUT}", "MessageTimeout=3"] if self.hosts is not None else []),
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

    def _daemon(self, *argv: str) -> subprocess.Popen[bytes]:
        with open(self.root / f"{argv[0]}.out", "ab") as log:
            self._daemons.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.env))
        return self._daemons[-1]

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

    def run(self, *argv: str, env: dict[str, str] | None = None) -> str:
        """A Slurm client command against this cluster (in ``env``, if given, with ``SLURM_CONF``); its output."""
        environment = self.env if env is None else {**env, "SLURM_CONF": str(self.conf)}
        return subprocess.run(
            self.client(list(argv)), env=environment, capture_output=True, text=True, check=True, timeout=60
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
        shutil.rmtree(self.spool, ignore_errors=True)
