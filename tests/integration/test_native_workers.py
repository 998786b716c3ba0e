"""Persistent workers in C and Fortran (``launcher.persistent``, melissa_dl_next): the C worker c_worker.c and the
Fortran worker f_worker.f90 in real studies, and the C worker against a scripted handshake service."""

from __future__ import annotations

import contextlib
import re
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import MPIRUN, clean_environment, persistent_config, run_server, study_config
from test_native import data_sockets, recording
from test_studies import assert_clean_study, assert_every_step_once

from melissa_dl.ingest.handshake import HandshakeServer

pytestmark = pytest.mark.timeout(240)

SIMULATIONS, STEPS, COUNT = 8, 10, 8
SIMULATION_LINE = re.compile(r"^simulation (\d+) attempt (\d+) rank (\d+) parameters:(.*)$", re.MULTILINE)


def records(folder: Path) -> str:
    """What every worker process wrote to its own file (``--record``): counted there, not in the workers' logs,
    where mpirun forwards the ranks' stdout (a rank's line once never reached the log under load)."""
    return "".join(record.read_text() for record in sorted(folder.glob("worker*.txt")))


def worker_pids(folder: Path) -> list[int]:
    """The pid every worker process recorded at its start ("worker PID")."""
    return [int(pid) for pid in re.findall(r"^worker (\d+)$", records(folder), re.MULTILINE)]


def handed(folder: Path) -> Counter[tuple[int, int, int]]:
    """How often each (simulation, attempt, rank) was handed to a worker, from the workers' records."""
    return Counter((int(s), int(a), int(r)) for s, a, r, _ in SIMULATION_LINE.findall(records(folder)))


def parameters_handed(folder: Path) -> dict[int, list[float]]:
    """The parameters each simulation's rank 0 recorded."""
    return {
        int(s): [float(v) for v in values.split()]
        for s, _, r, values in SIMULATION_LINE.findall(records(folder))
        if r == "0"
    }


def assert_samples(samples: Path, simulations: int, steps: int, ranks: int, count: int, dtype: type) -> None:
    """Every step of every simulation recorded once, rank r's slice of value 1000 s + t + r / 2."""
    assert sorted(path.name for path in samples.iterdir()) == sorted(
        f"{s}_{t}.npz" for s in range(simulations) for t in range(steps)
    )
    for s in range(simulations):
        for t in range(steps):
            field = np.load(samples / f"{s}_{t}.npz")["field"]
            assert field.dtype == dtype
            expected = [1000 * s + t + r / 2 for r in range(ranks) for _ in range(count)]
            assert field.tolist() == expected, (s, t)


@pytest.mark.parametrize("scheduler", ["local", "mpirun"])
def test_c_workers_run_every_simulation_once_and_a_dead_one_is_replaced(
    tmp_path: Path, output: Path, native: Path, scheduler: str
) -> None:
    """2 server ranks; a serial worker (MPI_COMM_NULL, no MPI_Init) or a 2-rank MPI worker; simulation 3's first
    attempt kills its worker: the study relaunches it, a new worker takes the slot."""
    ranks = 2 if scheduler == "mpirun" else 1
    folder = tmp_path / "records"
    folder.mkdir()
    command = [str(native / "c_worker"), "--steps", str(STEPS), "--count", str(COUNT), "--crash-simulation", "3"]
    command += ["--record", str(folder)]
    config = persistent_config(output, command, scheduler, SIMULATIONS, STEPS)
    config["training"] = recording(tmp_path / "samples")
    run = run_server(tmp_path, config, ranks=2, timeout=180)
    assert run.code == 0, run.log
    assert run.report is not None
    assert_every_step_once(run.report, SIMULATIONS, STEPS)
    assert [s["attempts"] for s in run.report["per_simulation"]] == [1, 1, 1, 2, 1, 1, 1, 1]
    assert "c_worker: crashing on purpose at step 3" in run.report["per_simulation"][3]["reason"]
    assert_samples(tmp_path / "samples", SIMULATIONS, STEPS, ranks, COUNT, np.float32)
    # job_limit 2 workers and the one that replaced the dead one, each on every rank: fewer than the simulations
    pids = worker_pids(folder)
    assert len(pids) == len(set(pids)) == 3 * ranks
    attempts = [(s, 0) for s in range(SIMULATIONS)] + [(3, 1)]
    assert handed(folder) == Counter((s, a, r) for s, a in attempts for r in range(ranks))
    sampled = {s["id"]: list(s["parameters"].values()) for s in run.report["per_simulation"]}
    assert parameters_handed(folder) == sampled  # MELISSA_PARAMETERS of each, applied with setenv
    recorded = records(folder)
    for s, _ in attempts:  # between init and finalize, melissa_dl_next refuses
        assert (
            f"next while declared: 3 melissa_dl_next: simulation {s} is declared and not finalized: "
            "call melissa_dl_finalize first more 0\n"
        ) in recorded
    attempt_log = output / "simulations" / "simulation0.attempt0.log"
    assert attempt_log.is_symlink() and "simulation 0 attempt 0 rank 0" in attempt_log.read_text()


def test_a_fortran_worker_runs_a_study(tmp_path: Path, output: Path, native: Path) -> None:
    simulations, steps = 4, 6
    folder = tmp_path / "records"
    folder.mkdir()
    config = study_config(
        output,
        [str(native / "f_worker"), str(steps), str(folder)],
        study={"simulations": simulations, "time_steps": steps},
        launcher={"persistent": True, "scheduler": "mpirun", "client_ranks": 2},
    )
    config["training"] = recording(tmp_path / "samples")
    run = run_server(tmp_path, config, ranks=2, timeout=180)
    assert_clean_study(run, simulations, steps)
    assert run.report is not None
    assert [s["attempts"] for s in run.report["per_simulation"]] == [1] * simulations
    assert_samples(tmp_path / "samples", simulations, steps, 2, 6, np.float64)
    pids = worker_pids(folder)
    assert len(pids) == len(set(pids)) == 2 * 2  # job_limit 2 workers of 2 ranks each
    assert handed(folder) == Counter((s, 0, r) for s in range(simulations) for r in range(2))
    sampled = {s["id"]: list(s["parameters"].values()) for s in run.report["per_simulation"]}
    assert parameters_handed(folder) == sampled


def test_without_persistent_workers_the_c_worker_streams_its_one_simulation(
    tmp_path: Path, output: Path, native: Path
) -> None:
    """The same loop, under a study without launcher.persistent: each process runs its environment's simulation."""
    config = study_config(output, [str(native / "c_worker"), "--steps", str(STEPS)])
    assert_clean_study(run_server(tmp_path, config, ranks=2), 4, STEPS)
    for s in range(4):
        log = (output / "simulations" / f"simulation{s}.attempt0.log").read_text()
        assert [(int(m[0]), int(m[1]), int(m[2])) for m in SIMULATION_LINE.findall(log)] == [(s, 0, 0)]
        assert log.endswith("after the end: 0 more 0\nover\n")


# -- against a scripted handshake service ----------------------------------------------------------------


@contextlib.contextmanager
def scripted_service(
    answers: list[dict[str, Any]] | None,
) -> Iterator[tuple[dict[str, str], HandshakeServer, list[tuple[str, str | None]]]]:
    """A handshake service (of simulation 3, MELISSA_PARAMETERS [0.5]) that answers a worker as the launcher's
    worker scheduler would, ``answers`` in order (None: a study without persistent workers); the environment of
    worker "0:0", the service, and who asked, saying what it was last told."""
    asked: list[tuple[str, str | None]] = []

    def next_for(worker: str, last: str | None) -> dict[str, Any]:
        asked.append((worker, last))
        assert answers is not None
        return answers[len(asked) - 1]

    with data_sockets(b"secret", bind=False, next_work=None if answers is None else next_for) as (environ, _, service):
        yield {**environ, "MELISSA_WORKER": "0:0"}, service, asked


def run_worker(native: Path, environ: dict[str, str], mpi: bool, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(native / "c_worker"), "--dry", *args]
    if mpi:
        command = [MPIRUN, "-n", "2", *command, "--mpi"]
    return subprocess.run(command, env={**clean_environment(), **environ}, capture_output=True, text=True, timeout=60)


ANSWERS = [
    {"wait": 0.05},
    {"env": {"MELISSA_SIMULATION_ID": "5", "MELISSA_PARAMETERS": "[1.5, 2.5]", "MELISSA_MARK": "x"}},
    {"wait": 0},
    {"env": {"MELISSA_ATTEMPT": "1"}},  # on top of the worker's own environment, not of simulation 5's
    {"over": True},
]


@pytest.mark.parametrize("mpi", [False, True])
def test_the_c_worker_runs_what_the_service_hands_it_until_it_is_over(native: Path, mpi: bool) -> None:
    with scripted_service(ANSWERS) as (environ, handshake, asked):
        done = run_worker(native, environ, mpi, "--show", "MELISSA_MARK")
    assert done.returncode == 0, done.stdout + done.stderr
    # rank 0 asked, until over, saying which simulation it was last told; once over, melissa_dl_next asks no more
    assert asked == [("0:0", None), ("0:0", None), ("0:0", "5:0"), ("0:0", "5:0"), ("0:0", "3:1")]
    ranks = range(2 if mpi else 1)
    said = [line for line in done.stdout.splitlines() if not line.startswith("worker ")]
    expected = [
        *[f"simulation 5 attempt 0 rank {r} parameters: 1.5 2.5\nMELISSA_MARK=x" for r in ranks],
        *[f"simulation 3 attempt 1 rank {r} parameters: 0.5\nMELISSA_MARK unset" for r in ranks],
        *["after the end: 0 more 0\nover" for _ in ranks],
    ]
    assert sorted(said) == sorted("\n".join(expected).splitlines())
    assert done.stdout.count("worker ") == len(ranks)
    assert handshake.rejections.counts() == {}


def test_without_melissa_worker_the_c_worker_runs_its_environments_simulation_only(native: Path) -> None:
    with scripted_service(ANSWERS) as (environ, _, asked):
        del environ["MELISSA_WORKER"]
        done = run_worker(native, environ, False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert asked == []
    assert done.stdout.splitlines()[1:] == [
        "simulation 3 attempt 0 rank 0 parameters: 0.5",
        "after the end: 0 more 0",
        "over",
    ]


@pytest.mark.parametrize(
    "case, code, message",
    [
        ("off", 7, "worker 0:0: handshake: a worker asked for a simulation, but launcher.persistent is off"),
        ("unknown answer", 9, "worker 0:0: the handshake service answered something else than {env}, {wait} or {over}"),
        (
            "bad variable",
            9,
            "worker 0:0: the handshake service handed the variable 'A=B', which is not a name with a string value",
        ),
        ("no server", 8, "no handshake answer from tcp://127.0.0.1:9 within 0.5 s"),
        (
            "wrong token",
            7,
            "worker 0:0: tcp://127.0.0.1:PORT: credentials refused (ZAP status 400): this "
            "simulation's credentials (MELISSA_SECURITY=token) are not the server's (a stale environment, or another "
            "study's server?)",
        ),
    ],
)
@pytest.mark.parametrize("mpi", [False, True])
def test_what_melissa_dl_next_says_when_it_fails_every_rank_says(
    native: Path, mpi: bool, case: str, code: int, message: str
) -> None:
    answers = None if case == "off" else [{"bogus": 1}] if case == "unknown answer" else [{"env": {"A=B": "1"}}]
    with scripted_service(answers) as (environ, _, _):
        environ = {
            **environ,
            **{
                "no server": {"MELISSA_SERVER": "tcp://127.0.0.1:9", "MELISSA_CLIENT_TIMEOUT": "0.5"},
                "wrong token": {"MELISSA_TOKEN": "00" * 6},
            }.get(case, {}),
        }
        done = run_worker(native, environ, mpi)
    assert done.returncode == 1, done.stdout + done.stderr
    stderr = re.sub(r"tcp://127\.0\.0\.1:\d{3,}", "tcp://127.0.0.1:PORT", done.stderr)
    ranks = range(2 if mpi else 1)
    said = [line for line in stderr.splitlines() if line.startswith("c_worker")]
    assert sorted(said) == [f"c_worker rank {r}: melissa_dl error {code}: {message}" for r in ranks]
    assert "simulation" not in done.stdout
