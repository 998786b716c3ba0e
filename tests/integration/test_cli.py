"""The command line: configuration errors and a rank dying end the job cleanly."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import MPIRUN, TOY_SIM, clean_environment, study_config

pytestmark = pytest.mark.timeout(120)

SERVER = [sys.executable, "-m", "melissa_dl.server"]


def write(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("ranks", [0, 2])
def test_a_misspelt_key_is_one_line_with_exit_code_2(tmp_path: Path, ranks: int) -> None:
    config = study_config(tmp_path / "out", ["true"], buffer={"capacty_samples": 5})
    launch = [MPIRUN, "-n", str(ranks)] if ranks else []
    done = subprocess.run([*launch, *SERVER, write(tmp_path, config)], env=clean_environment(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"melissa-server: {tmp_path / 'config.json'}: buffer.capacty_samples: unknown key (did you mean 'capacity_samples'?)"
    ]
    assert not (tmp_path / "out").exists()  # nothing started


def test_a_wrong_training_class_is_one_line_with_exit_code_2_before_any_simulation(tmp_path: Path) -> None:
    output = tmp_path / "out"
    config = study_config(output, [sys.executable, TOY_SIM])
    config["training"] = {"module": str(Path(__file__).parent / "tiny_module.py"), "class_name": "Tinny"}
    done = subprocess.run([MPIRUN, "-n", "2", *SERVER, write(tmp_path, config)], env=clean_environment(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if "ERROR" in line]
    assert len(errors) == 1 and "training.class_name: tiny_module.py defines no TrainingModule subclass 'Tinny'" in errors[0]
    assert "Traceback" not in done.stderr
    assert not (output / "simulations").exists()  # no simulation was started


@pytest.mark.parametrize("blocked", ["output_dir", "logs"])
@pytest.mark.parametrize("how", ["--check", "mpirun -n 2", "melissa-launcher -n 2"])
def test_an_output_folder_that_cannot_be_written_is_one_line_with_exit_code_2(tmp_path: Path, how: str,
                                                                              blocked: str) -> None:
    """A regular file where a folder goes: ENOTDIR (as root, the one refusal that needs no mount)."""
    if blocked == "output_dir":
        (tmp_path / "file").write_text("where the output folder's parent should be")
        output = blocked_folder = tmp_path / "file" / "out"
    else:
        output = tmp_path / "out"
        output.mkdir()
        (output / "logs").write_text("where the server's log folder should be")
        blocked_folder = output / "logs"
    config = write(tmp_path, study_config(output, ["true"]))
    command = {"--check": [*SERVER, "--check", config], "mpirun -n 2": [MPIRUN, "-n", "2", *SERVER, config],
               "melissa-launcher -n 2": [sys.executable, "-m", "launcher.supervisor", config, "-n", "2"]}[how]
    done = subprocess.run(command, env=clean_environment(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    program = "melissa-launcher" if how.startswith("melissa-launcher") else "melissa-server"
    assert done.stderr.strip().splitlines() == [
        f"{program}: {config}: output_dir: cannot write {blocked_folder}: ENOTDIR (Not a directory)"
    ]
    assert done.stdout == ""
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["config.json", "file" if blocked == "output_dir" else
                                                                  "out", *(["logs"] if blocked == "logs" else [])])


def test_check_prints_the_resolved_configuration(tmp_path: Path) -> None:
    config = study_config(tmp_path / "out", ["true"])
    done = subprocess.run([*SERVER, "--check", write(tmp_path, config)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    resolved = json.loads(done.stdout)
    assert resolved["buffer"]["pseudo_epochs"] == 1  # a default filled in
    assert resolved["study"]["simulations"] == 4


def test_killing_one_server_rank_ends_the_job_and_its_simulations(tmp_path: Path) -> None:
    output = tmp_path / "out"
    config = study_config(output, [sys.executable, TOY_SIM, "--fail", "hang", "--fail-simulation", "0",
                                   "--fail-at", "2"], launcher={"simulation_timeout": 100})
    process = subprocess.Popen([MPIRUN, "-n", "2", *SERVER, write(tmp_path, config)], env=clean_environment(),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    pids: dict[int, int] = {}
    while len(pids) < 2 or not (output / "simulations" / "simulation0.attempt0.log").exists():
        assert time.monotonic() < deadline, "the server did not start"
        for rank in (0, 1):
            log = output / "logs" / f"rank{rank}.log"
            found = re.search(r"pid (\d+)", log.read_text()) if log.exists() else None
            if found:
                pids[rank] = int(found.group(1))
        time.sleep(0.2)
    time.sleep(1.0)  # simulation 0 is now hanging after step 2
    simulation = int(re.search(r"simulation 0 attempt 0 started \(pid (\d+)",
                               (output / "logs" / "rank0.log").read_text()).group(1))
    os.kill(pids[1], signal.SIGKILL)
    log, _ = process.communicate(timeout=60)
    assert process.returncode != 0, log
    assert gone_within(simulation, 10.0)  # the hanging simulation did not outlive its server


def gone_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` ends (or is left a zombie) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
                return True
        except FileNotFoundError:
            return True
        time.sleep(0.1)
    return False
