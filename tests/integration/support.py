"""What the integration tests share, beside their fixtures (``conftest.py``): running whole studies as subprocesses
(`mpirun -n K melissa-server config`), their configurations, waits on processes and free ports. A test module imports
it as ``from support import ...``; so do the helper modules beside it (``slurm_cluster.py``)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import pytest

HERE = Path(__file__).parent
BIN = Path(sys.executable).parent
MPIRUN = str(BIN / "mpirun")
TOY_SIM = str(HERE / "toy_sim.py")
ROOT = HERE.parent.parent


def skip_unless(ready: bool, reason: str) -> None:
    """Skip with ``reason`` unless ``ready``; under ``CI=true`` nothing may be skipped: the test fails instead."""
    if not ready:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def require_system_packages(group: str) -> None:
    """Skip, with the command that installs them, unless the Debian packages of ``group`` are here."""
    script = HERE.parent.parent / "scripts" / "system-packages"
    missing = subprocess.run([str(script), "check", group], capture_output=True, text=True, check=True).stdout.strip()
    skip_unless(
        not missing, f"needs the Debian packages {missing}: run `scripts/system-packages install {group}` as root"
    )


def free_port() -> int:
    """A port nothing is bound to, below the kernel's ephemeral range: a daemon that binds it seconds later (a
    Slurm cluster's) still finds it free. A port of that range (``bind`` to 0) could meanwhile become any
    connection's own end; a parallel run's other studies make thousands, and slurmd was once refused its port."""
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    below = range(max(1024, ephemeral_low // 2), ephemeral_low)  # empty where that range starts at 1024
    for port in random.SystemRandom().sample(below, min(100, len(below))):  # not the seeded generator: workers differ
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:  # taken
                continue
            return port
    with socket.socket() as probe:  # no room below, or none of 100 tries free: the kernel's pick
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def clean_environment() -> dict[str, str]:
    """The test's environment without an enclosing MPI launch's variables."""
    prefixes = ("PMI_", "PMIX_", "HYDRA_", "HYDI_", "MPIR_", "OMPI_", "I_MPI_")
    return {k: v for k, v in os.environ.items() if not k.startswith(prefixes)}


def study_config(output: Path, command: list[str], **sections: dict[str, Any]) -> dict[str, Any]:
    """A small valid study; ``sections`` override keys section by section. No PNGs at its end (``plots``): about
    a second of rank 0 in each of the suite's studies; the tests that look at them turn them on."""
    config: dict[str, Any] = {
        "output_dir": str(output),
        "plots": False,
        "study": {
            "fields": ["field"],
            "parameters": [{"name": "a", "low": 0.0, "high": 1.0}, {"name": "b", "low": 0.0, "high": 1.0}],
            "simulations": 4,
            "time_steps": 10,
            "seed": 1,
        },
        "server": {"status_interval": 1.0, "control_interval": 0.1},
        "buffer": {"kind": "fifo", "capacity_samples": 100, "per_server_watermark": 1},
        "launcher": {
            "command": command,
            "job_limit": 2,
            "simulation_timeout": 20,
            "max_retries": 1,
            "client_timeout": 30,
        },
    }
    for name, values in sections.items():
        config.setdefault(name, {}).update(values)
    return config


@dataclass
class Run:
    code: int
    log: str
    report: dict[str, Any] | None


def persistent_config(output: Path, command: list[str], scheduler: str, simulations: int, steps: int) -> dict:
    """A study run by persistent workers (``launcher.persistent``), serial or, under ``mpirun``, of 2 ranks (the
    worker's command then gets ``--mpi``)."""
    mpi = scheduler == "mpirun"
    return study_config(
        output,
        [*command, *(["--mpi"] if mpi else [])],
        study={"simulations": simulations, "time_steps": steps},
        launcher={"persistent": True, "scheduler": scheduler, "client_ranks": 2 if mpi else 1},
    )


def server_command(tmp_path: Path, config: dict[str, Any], ranks: int, *args: str) -> list[str]:
    """``mpirun -n ranks melissa-server config.json args`` with ``config`` written to ``tmp_path``."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return [MPIRUN, "-n", str(ranks), sys.executable, "-m", "melissa_dl", str(path), *args]


def run_server(tmp_path: Path, config: dict[str, Any], ranks: int, timeout: float = 120, *args: str) -> Run:
    """Run the server on ``config`` under mpirun and return its exit code, log and report."""
    command = server_command(tmp_path, config, ranks, *args)
    done = subprocess.run(command, env=clean_environment(), capture_output=True, text=True, timeout=timeout)
    report_path = Path(config["output_dir"]) / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    return Run(done.returncode, done.stdout + done.stderr, report)


def session_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This test session's temporary folder, the same for every worker of a parallel run (pytest-xdist's workers
    each have a folder of their own inside it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


SIMULATIONS, STEPS = 6, 12  # of paced_config


def paced_config(output: Path, class_name: str = "Tiny", job_limit: int = 2, **launcher: Any) -> dict:
    """A study of 6 simulations x 12 steps of 0.05 s, trained with a checkpoint every 2 batches."""
    module, options = (
        ("tiny_module.py", {})
        if class_name == "Tiny"
        else ("table_module.py", {"simulations": SIMULATIONS, "steps": STEPS})
    )
    return study_config(
        output,
        [sys.executable, TOY_SIM, "--steps", str(STEPS), "--step-delay", "0.05"],
        study={"simulations": SIMULATIONS, "time_steps": STEPS},
        buffer={"kind": "fifo", "capacity_samples": 1000},
        launcher={"job_limit": job_limit, **launcher},
        training={
            "module": str(HERE / module),
            "class_name": class_name,
            "options": options,
            "batch_size": 4,
            "nb_batches_update": 1000,
            "log_interval": 1,
            "device": "cpu",
            "seed": 3,
        },
        checkpoint={"interval": 2},
    )


class Running(Protocol):
    """A process, or a batch job, followed as ``Popen`` follows a process."""

    returncode: int | None

    def poll(self) -> int | None: ...


def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> bool:
    """Whether ``condition`` came true within ``timeout`` seconds: long, since only a failure waits it out."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def wait_for(condition: Callable[[], bool], process: Running, timeout: float = 120) -> None:
    """Wait until ``condition`` holds; fail at once if ``process`` exits before it does."""

    def held() -> bool:
        if condition():
            return True
        assert process.poll() is None, f"exited with {process.returncode} before the condition held: {process}"
        return False

    assert wait_until(held, timeout), f"condition not met in {timeout:.0f} s: {process}"


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process descended from it (Linux /proc), parents first: the children of each of its threads
    (rank 0's launcher thread starts the simulations)."""
    tree = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children = (task / "children").read_text().split()
        except OSError:  # gone
            continue
        for child in children:
            tree += process_tree(int(child))
    return tree


def signal_every_process(pid: int, sig: int) -> None:
    """``sig`` to ``pid`` and each of its descendants, taken together first, as ``scancel`` or a batch system's time
    limit signals every process of a job (not only the one at its top)."""
    for each in process_tree(pid):
        try:
            os.kill(each, sig)
        except ProcessLookupError:
            pass


def committed(output: Path) -> bool:
    return (output / "checkpoints" / "LATEST").exists()


def start(command: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        command, env=clean_environment(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
