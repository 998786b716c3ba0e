"""The command line: configuration errors and a rank dying end the job cleanly."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import MPIRUN, TOY_SIM, clean_environment, start, study_config

from melissa_dl.study.progress import rate

pytestmark = pytest.mark.timeout(120)

SERVER = [sys.executable, "-m", "melissa_dl"]


def write(tmp_path: Path, config: dict) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("ranks", [0, 2])
def test_a_misspelt_key_is_one_line_with_exit_code_2(tmp_path: Path, ranks: int) -> None:
    config = study_config(tmp_path / "out", ["true"], buffer={"capacty_samples": 5})
    launch = [MPIRUN, "-n", str(ranks)] if ranks else []
    done = subprocess.run(
        [*launch, *SERVER, write(tmp_path, config)], env=clean_environment(), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"melissa-server: {tmp_path / 'config.json'}: buffer.capacty_samples: unknown key "
        "(did you mean 'capacity_samples'?)"
    ]
    assert not (tmp_path / "out").exists()  # nothing started


def test_a_wrong_training_class_is_one_line_with_exit_code_2_before_any_simulation(tmp_path: Path) -> None:
    output = tmp_path / "out"
    config = study_config(output, [sys.executable, TOY_SIM])
    config["training"] = {"module": str(Path(__file__).parent / "tiny_module.py"), "class_name": "Tinny"}
    done = subprocess.run(
        [MPIRUN, "-n", "2", *SERVER, write(tmp_path, config)],
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [  # one line, from rank 0, before MPI started
        f"melissa-server: {tmp_path / 'config.json'}: training.class_name: tiny_module.py defines no "
        "TrainingModule subclass 'Tinny' (did you mean 'Tiny'?)"
    ]
    assert not (output / "simulations").exists()  # no simulation was started


@pytest.mark.parametrize("blocked", ["output_dir", "logs"])
@pytest.mark.parametrize("how", ["--check", "mpirun -n 2", "melissa-launcher -n 2"])
def test_an_output_folder_that_cannot_be_written_is_one_line_with_exit_code_2(
    tmp_path: Path, how: str, blocked: str
) -> None:
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
    command = {
        "--check": [*SERVER, "--check", config],
        "mpirun -n 2": [MPIRUN, "-n", "2", *SERVER, config],
        "melissa-launcher -n 2": [sys.executable, "-m", "melissa_dl.supervisor", config, "-n", "2"],
    }[how]
    done = subprocess.run(command, env=clean_environment(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    program = "melissa-launcher" if how.startswith("melissa-launcher") else "melissa-server"
    assert done.stderr.strip().splitlines() == [
        f"{program}: {config}: output_dir: cannot write {blocked_folder}: ENOTDIR (Not a directory)"
    ]
    assert done.stdout == ""
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(
        ["config.json", "file" if blocked == "output_dir" else "out", *(["logs"] if blocked == "logs" else [])]
    )


def test_check_prints_the_resolved_configuration(tmp_path: Path) -> None:
    config = study_config(tmp_path / "out", ["true"])
    done = subprocess.run([*SERVER, "--check", write(tmp_path, config)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    resolved = json.loads(done.stdout)
    assert resolved["buffer"]["pseudo_epochs"] == 1  # a default filled in
    assert resolved["study"]["simulations"] == 4
    assert done.stderr.strip().splitlines()[-1] == (  # the verdict: one line, beside the JSON
        f"melissa-server: {tmp_path / 'config.json'}: valid, 4 simulations of {config['study']['time_steps']} "
        f"steps, nothing trains, output in {tmp_path / 'out'}; nothing was started"
    )


def test_check_of_a_missing_file_names_it_once(tmp_path: Path) -> None:
    done = subprocess.run([*SERVER, "--check", "absent.json"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == ["melissa-server: absent.json: cannot read (No such file or directory)"]


def test_killing_one_server_rank_ends_the_job_and_its_simulations(tmp_path: Path) -> None:
    output = tmp_path / "out"
    config = study_config(
        output,
        [sys.executable, TOY_SIM, "--fail", "hang", "--fail-simulation", "0", "--fail-at", "2"],
        launcher={"simulation_timeout": 100},
        server={"log_level": {"launcher": "DEBUG"}},
    )  # the jobs' pids
    process = start([MPIRUN, "-n", "2", *SERVER, write(tmp_path, config)])
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
    simulation = int(
        re.search(r"simulation 0 attempt 0 started \(pid (\d+)", (output / "logs" / "rank0.log").read_text()).group(1)
    )
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


NO_MPI = (
    "import sys; from melissa_dl.cli import main; code = main(sys.argv[1:]); "
    "loaded = [m for m in ('mpi4py.MPI', 'melissa_dl.server', 'melissa_dl.train.trainer') if m in sys.modules]; "
    "assert not loaded, f'--check loaded {loaded}'; sys.exit(code)"
)


def check(tmp_path: Path, config: dict) -> subprocess.CompletedProcess:
    """``melissa-server --check``, asserting that it loaded neither MPI nor the server."""
    return subprocess.run(
        [sys.executable, "-c", NO_MPI, write(tmp_path, config), "--check"],
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )


BROKEN_MODULE = "import no_such_package\n"
RAISING_MODULE = """
from tiny_module import Tiny


class Picky(Tiny):
    def __init__(self, hidden: int = 16) -> None:
        if hidden > 8:
            raise ValueError(f"hidden {hidden} is too large")
        super().__init__(hidden=hidden)
"""
UNSERVABLE_MODULE = """
import torch

from melissa_dl import TrainingModule


class Unservable(TrainingModule):
    prediction_inputs = {"x": ("float32", (2, -1))}

    def configure_optimizer(self):
        return torch.optim.SGD([torch.zeros(1, requires_grad=True)])

    def process(self, sample):
        return sample.fields["field"]

    def training_step(self, batch):
        return batch.sum()


class Unasked(Unservable):
    prediction_inputs = {}
"""


@pytest.mark.parametrize(
    "case, expected",
    [
        (
            "class",
            "training.class_name: tiny_module.py defines no TrainingModule subclass 'Tinny' (did you mean 'Tiny'?)",
        ),
        ("option", "training.options.hiden: not an option of Tiny (did you mean 'hidden'?)"),
        (
            "import",
            "training.module: importing {module} failed: ModuleNotFoundError: No module named 'no_such_package'",
        ),
        ("build", "training: building Picky(**training.options) failed: ValueError: hidden 16 is too large"),
        ("predict", "Unservable.prediction_inputs['x']: shape (2, -1) is not a tuple of fewer than 6 sizes > 0"),
        ("online", "serving.online: Unasked declares no prediction_inputs, so nothing can be asked of it"),
        ("command", "launcher.command[0]: no file {tmp_path}/no-such-solver"),
        ("program", "launcher.command[0]: no program 'no-such-solver' in PATH (the server's, its venv first)"),
    ],
)
def test_check_catches_what_a_run_would_meet_in_one_line_without_mpi(tmp_path: Path, case: str, expected: str) -> None:
    here = Path(__file__).parent
    module = tmp_path / "user_module.py"
    config = study_config(tmp_path / "out", [sys.executable, TOY_SIM])
    config["training"] = {"module": str(here / "tiny_module.py"), "class_name": "Tiny"}
    if case == "class":
        config["training"]["class_name"] = "Tinny"
    elif case == "option":
        config["training"]["options"] = {"hiden": 8}
    elif case == "import":
        module.write_text(BROKEN_MODULE)
        config["training"].update(module=str(module), class_name="Broken")
    elif case in ("build", "predict"):
        shutil.copy(here / "tiny_module.py", tmp_path)  # imported by the user's module, from its folder
        module.write_text(RAISING_MODULE if case == "build" else UNSERVABLE_MODULE)
        config["training"].update(module=str(module), class_name="Picky" if case == "build" else "Unservable")
    elif case == "online":
        module.write_text(UNSERVABLE_MODULE)
        config["training"].update(module=str(module), class_name="Unasked")
        config["serving"] = {"online": True}
    elif case == "command":
        config["launcher"]["command"] = ["./no-such-solver"]
    else:
        config["launcher"]["command"] = ["no-such-solver", "--steps", "3"]
    done = check(tmp_path, config)
    assert done.returncode == 2, done.stderr
    message = expected.format(module=module, tmp_path=tmp_path)
    assert done.stderr.strip().splitlines() == [f"melissa-server: {tmp_path / 'config.json'}: {message}"]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value", ["Infinity", "1e308", "0.0001"])
def test_check_refuses_a_client_timeout_the_clients_would_refuse_in_one_line(tmp_path: Path, value: str) -> None:
    """Every simulation would fail on it (the clients accept 0.001 to 1e6 seconds); ``Infinity``, which Python's
    json module writes and reads, too."""
    config = study_config(tmp_path / "out", [sys.executable, TOY_SIM], launcher={"client_timeout": float(value)})
    done = check(tmp_path, config)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"melissa-server: {tmp_path / 'config.json'}: launcher.client_timeout: must be between 0.001 and 1e+06"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("example", ["heat_pde", "node_features"])
def test_check_builds_the_examples_training_modules_without_mpi(tmp_path: Path, example: str) -> None:
    """node_features builds a ShardedEmbedding: on the meta device, with no MPI."""
    folder = Path(__file__).parents[2] / "examples" / example
    config = json.loads((folder / "config.json").read_text())
    config["training"]["module"] = str(folder / config["training"]["module"])
    config["launcher"]["command"] = [sys.executable, TOY_SIM]
    config["output_dir"] = str(tmp_path / "out")
    done = check(tmp_path, config)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["training"]["class_name"] == config["training"]["class_name"]


def test_status_shows_a_running_study_from_another_shell_and_then_its_end(tmp_path: Path) -> None:
    """``melissa-server --status OUTPUT_DIR`` reads what rank 0 rewrites every status interval (issue 13, item 3).
    Simulation 0 runs at once, the others wait for the file ``go``, touched once a running status with a time
    left was shown: the study cannot end first, however long each ``--status`` takes on a busy machine."""
    output, go = tmp_path / "out", tmp_path / "go"
    simulation = [sys.executable, TOY_SIM, "--step-delay", "0.3", "--go", str(go), "--go-now", "0"]
    config = study_config(output, simulation, server={"status_interval": 0.5})
    status = [*SERVER, "--status", str(output)]
    early = subprocess.run(status, capture_output=True, text=True, timeout=60)
    assert early.returncode == 2 and "no status in" in early.stderr, early  # nothing started yet
    process = start([MPIRUN, "-n", "2", *SERVER, write(tmp_path, config)])
    try:
        deadline, shown = time.monotonic() + 120, ""
        while "running" not in shown.split("\n", 1)[0] or "left" not in shown:  # a time left needs some progress
            assert time.monotonic() < deadline and process.poll() is None, "no running status was shown"
            time.sleep(0.2)
            shown = subprocess.run(status, capture_output=True, text=True, timeout=60).stdout
        go.touch()
        assert re.search(r"\d+% done, \d+ s elapsed, about \d+ s left", shown), shown
        assert re.search(r"simulations \d done, \d running, \d ending, \d queued, 0 failed of 4", shown), shown
        assert re.search(r"samples \d+ received of 40, \d+ consumed", shown), shown
        log, _ = process.communicate(timeout=90)
    finally:
        process.kill()
    assert process.returncode == 0, log
    final = subprocess.run(status, capture_output=True, text=True, timeout=60)
    assert final.returncode == 0 and "finished" in final.stdout.split("\n", 1)[0], final
    assert (
        "100% done" in final.stdout
        and "simulations 4 done, 0 running, 0 ending, 0 queued, 0 failed of 4" in final.stdout
    )
    report = json.loads((output / "report.json").read_text())
    assert f"report {output / 'report.json'}" in final.stdout, final.stdout  # and the report's own rate
    assert f"| {rate(report['throughput_MB_per_s'])} |" in final.stdout, final.stdout
    history = [json.loads(line) for line in (output / "progress.jsonl").read_text().splitlines()]
    assert len(history) >= 2 and history[-1]["state"] == "finished"
    assert [h["samples"]["received"] for h in history] == sorted(h["samples"]["received"] for h in history)


@pytest.mark.parametrize(
    "broken, expected",
    [
        (
            [],
            ["steps: 10 arrived (0 to 9)", "field 'field': float32[4, 8], min 0, max 9, mean 4.5", "no problem found"],
        ),
        (
            ["--nan-at", "3"],
            [
                "steps: 3 arrived (0 to 2)",
                "problem: frames refused: simulation 0, step 3, field 'field', client rank 0: NaN or infinite values",
                "problem: 3 steps arrived, study.time_steps is 10",
            ],
        ),
        (
            ["--fail", "crash", "--fail-simulation", "0"],
            ["exit code 1", "problem: exit code 1; output: toy_sim: crashing on purpose at step 3"],
        ),
    ],
)
def test_try_simulation_runs_one_and_says_what_arrived_and_what_is_wrong(
    tmp_path: Path, broken: list[str], expected: list[str]
) -> None:
    """The quickest way to debug a simulation's instrumentation (issue 13, item 6): no MPI, no study."""
    config = study_config(tmp_path / "out", [sys.executable, TOY_SIM, *broken])
    done = subprocess.run(
        [*SERVER, "--try-simulation", write(tmp_path, config), "--parameters", "0.5", "0.25"],
        capture_output=True,
        text=True,
        timeout=90,
        env=clean_environment(),
    )
    assert done.returncode == (1 if broken else 0), done.stdout + done.stderr
    assert done.stdout.startswith("simulation 0 with parameters [0.5, 0.25]: exit code"), done.stdout
    for line in expected:
        assert line in done.stdout, done.stdout
    assert not (tmp_path / "out" / "report.json").exists()  # nothing of a study was written


def test_each_try_has_its_own_log_which_begins_with_the_command(tmp_path: Path) -> None:
    config = write(tmp_path, study_config(tmp_path / "out", [sys.executable, TOY_SIM]))
    for n in (1, 2):
        done = subprocess.run(
            [*SERVER, "--try-simulation", config], capture_output=True, text=True, timeout=90, env=clean_environment()
        )
        log = tmp_path / "out" / "try-simulation" / str(n) / "simulation0.attempt0.log"
        assert done.returncode == 0 and f"log {log}" in done.stdout, done.stdout + done.stderr
        first, *rest = log.read_text().splitlines()
        assert first.startswith(f"melissa_dl: cd {tmp_path} && env MELISSA_SERVER=") and TOY_SIM in first
        assert not any(line.startswith("melissa_dl: cd ") for line in rest)  # one try's


def test_serve_of_a_folder_without_a_study_is_one_line_and_exit_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [*SERVER, "--serve", str(tmp_path / "nothing")], env=clean_environment(), capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"melissa-server: --serve: {tmp_path / 'nothing' / 'config.json'}: missing (a study writes it at its end: "
        "is this a study's output folder?)"
    ]
    assert not (tmp_path / "nothing").exists()  # nothing written where no study is
