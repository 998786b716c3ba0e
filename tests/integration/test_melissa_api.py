"""Melissa's client API on ours (issue 35, item 5): simulations written to Melissa's C, Fortran and Python APIs as
Melissa documents them, each in a real study, and what a C program's mistakes print."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support import HERE, clean_environment, run_server, study_config
from test_native import data_sockets, receive_until_finalize, recording
from test_studies import assert_every_step_once

from melissa_api import melissa_finalize, melissa_init, melissa_send
from melissa_dl.errors import ClientError
from melissa_dl.runtime.status import EXIT_FAILED_SIMULATIONS
from melissa_dl.wire.protocol import Kind, unpack_header

pytestmark = pytest.mark.timeout(180)

STEPS, SIMULATIONS, GLOBAL = 6, 3, 11  # melissa_sim's field "u" has 11 values, over 2 client ranks


def melissa_study(output: Path, command: list[str], **study: object) -> dict:
    """A 2-rank study of a Melissa-style simulation: parameters on argv (appended, as Melissa's launcher does),
    2 client ranks."""
    return study_config(
        output,
        [*command, "{parameters}"],
        study={"fields": ["u", "mark"], "simulations": SIMULATIONS, "time_steps": STEPS, **study},
        launcher={"scheduler": "mpirun", "client_ranks": 2},
    )


@pytest.mark.parametrize("language", ["c", "fortran", "python"])
def test_a_melissa_simulation_streams_every_step_once(
    tmp_path: Path, output: Path, native: Path, language: str
) -> None:
    program = {
        "c": [str(native / "melissa_sim")],
        "fortran": [str(native / "melissa_sim_f")],
        "python": [sys.executable, str(HERE / "melissa_sim.py")],
    }[language]
    config = melissa_study(output, [*program, str(STEPS)])
    config["training"] = recording(tmp_path / "samples")
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None
    assert_every_step_once(run.report, SIMULATIONS, STEPS)
    assert run.report["rejected"] == {}
    assert [s["attempts"] for s in run.report["per_simulation"]] == [1] * SIMULATIONS
    for simulation in run.report["per_simulation"]:
        a, b = simulation["parameters"]["a"], simulation["parameters"]["b"]
        for t in range(STEPS):
            sample = np.load(tmp_path / "samples" / f"{simulation['id']}_{t}.npz")
            assert sample["u"].dtype == np.float64
            np.testing.assert_allclose(sample["u"], a * np.arange(GLOBAL) + b * t, rtol=1e-15, atol=0)
            assert sample["mark"].tolist() == [t, 100 + t]  # one value per client rank


MISTAKES = r"""
#include <string.h>
#include <melissa_api.h>  /* Melissa's own header name */

/* mistakes_sim MISTAKE: makes that mistake, or none, in streaming 3 steps of the field "field". */
int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    const char *mistake = argv[1];
    double values[4] = {0};
    if (strcmp(mistake, "finalize first") == 0)
        melissa_finalize();
    if (strcmp(mistake, "send first") == 0)
        melissa_send("field", values);
    melissa_init("field", strcmp(mistake, "negative size") == 0 ? -1 : 4, MPI_COMM_WORLD);
    if (strcmp(mistake, "declared twice") == 0)
        melissa_init("field", 4, MPI_COMM_WORLD);
    if (strcmp(mistake, "undeclared field") == 0)
        melissa_send("pressure", values);
    for (int t = 0; t < 3; t++)
        melissa_send("field", values);
    if (strcmp(mistake, "init after a send") == 0)
        melissa_init("late", 4, MPI_COMM_WORLD);
    melissa_finalize();
    MPI_Finalize();
    return 0;
}
"""


@pytest.fixture(scope="module")
def mistakes_sim(native: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MISTAKES built as a Melissa user builds: the MPI compiler wrapper and `pkg-config melissa_dl`."""
    folder = tmp_path_factory.mktemp("mistakes")
    (folder / "mistakes_sim.c").write_text(MISTAKES)
    pkg_config = {**os.environ, "PKG_CONFIG_PATH": str(native.parent / "lib" / "pkgconfig")}
    flags = subprocess.run(
        ["pkg-config", "--cflags", "--libs", "melissa_dl"], env=pkg_config, capture_output=True, text=True, check=True
    ).stdout.split()
    rpath = f"-Wl,-rpath,{native.parent / 'lib'}"
    source, program = str(folder / "mistakes_sim.c"), str(folder / "mistakes_sim")
    subprocess.run(["mpicc.mpich", "-Wall", "-Werror", "-o", program, source, *flags, rpath], check=True)
    return folder / "mistakes_sim"


def run_mistake(program: Path, environ: dict[str, str], mistake: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(program), mistake], env={**clean_environment(), **environ}, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "mistake, line",
    [
        ("finalize first", "melissa_finalize(): ClientError: nothing to finalize: no field is declared"),
        ("send first", "melissa_send('field'): ClientError: no field is declared: call melissa_init first"),
        ("negative size", "melissa_init('field'): ClientError: field 'field': negative size -1"),
        ("declared twice", "melissa_init('field'): ClientError: field 'field' is declared twice"),
        (
            "undeclared field",
            "melissa_send('pressure'): ClientError: field 'pressure' was not declared by melissa_init "
            "(declared: 'field')",
        ),
        (
            "init after a send",
            "melissa_init('late'): ClientError: field 'late': declare every field before the first send",
        ),
    ],
)
def test_a_mistake_prints_one_client_error_line_and_exits_1(mistakes_sim: Path, mistake: str, line: str) -> None:
    with data_sockets(b"secret", bind=False) as (environ, _, _):
        done = run_mistake(mistakes_sim, environ, mistake)
    assert (done.returncode, done.stdout, done.stderr) == (1, "", line + "\n")


def test_no_launcher_is_a_client_error_and_no_server_is_not(mistakes_sim: Path) -> None:
    done = run_mistake(mistakes_sim, {}, "none")
    assert (done.returncode, done.stderr) == (
        1,
        "melissa_init('field'): ClientError: MELISSA_SIMULATION_ID is not set: start this simulation through "
        "melissa-server's launcher\n",
    )
    with data_sockets(b"secret", bind=False) as (environ, _, _):  # a relaunch may find the server: retried
        done = run_mistake(
            mistakes_sim, {**environ, "MELISSA_SERVER": "tcp://127.0.0.1:9", "MELISSA_CLIENT_TIMEOUT": "0.5"}, "none"
        )
    assert (done.returncode, done.stderr) == (
        1,
        "melissa_send('field'): melissa_dl error 8: no handshake answer from tcp://127.0.0.1:9 within 0.5 s\n",
    )


def data_steps(received: list[list[list[bytes]]]) -> list[list[int]]:
    """The time steps of the DATA messages each rank received."""
    headers = [[unpack_header(message[0]) for message in messages] for messages in received]
    return [[h.time_step for h in rank if h.kind is Kind.DATA] for rank in headers]


def test_the_steps_are_numbered_per_field_from_0(mistakes_sim: Path) -> None:
    """Simulation 3 sends steps 0, 1, 2: step t goes to server rank (3 + t) mod 2."""
    with data_sockets(b"secret", bind=False) as (environ, ranks, _):
        done = run_mistake(mistakes_sim, environ, "none")
        assert (done.returncode, done.stderr) == (0, "")
        assert data_steps(receive_until_finalize(ranks)) == [[1], [0, 2]]


def test_a_client_error_is_not_relaunched(tmp_path: Path, output: Path, mistakes_sim: Path) -> None:
    """Both client ranks print the line: it ends the attempt's output, whatever their order. No attempt that printed
    a ClientError is followed by another; one that failed before printing it (an MPI start refused on a busy
    machine) is relaunched as any failure is, and its log is in the message."""
    config = melissa_study(output, [str(mistakes_sim), "undeclared field"], simulations=2)
    config["study"]["fields"] = ["field"]
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == EXIT_FAILED_SIMULATIONS, run.log
    assert run.report is not None
    assert run.report["simulations"]["failed"] == 2 and run.report["samples_received"] == 0
    for simulation in run.report["per_simulation"]:
        logs = [
            (output / "simulations" / f"simulation{simulation['id']}.attempt{attempt}.log").read_text()
            for attempt in range(simulation["attempts"])
        ]
        assert not any("ClientError" in log for log in logs[:-1]), (simulation, logs, run.log)
        assert simulation["reason"].endswith(
            "melissa_send('pressure'): ClientError: field 'pressure' was not declared by melissa_init "
            "(declared: 'field')"
        ), simulation


def test_python_mistakes_raise_client_errors_and_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refused send does not advance the field's step: simulation 3's step 0 goes to server rank 1."""
    with data_sockets(b"secret", bind=False) as (environ, ranks, _):
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        with pytest.raises(ClientError, match=r"^melissa_finalize\(\): no field was declared by melissa_init$"):
            melissa_finalize()
        melissa_init("field", 4, None)
        mistakes = [
            (lambda: melissa_init("field", 4, None), r"melissa_init\('field'\): the field is declared twice"),
            (lambda: melissa_init("x", -1, None), r"melissa_init\('x'\): negative size -1"),
            (lambda: melissa_init("x", 1, object()), r"melissa_init\('x'\): another communicator than the first"),
            (
                lambda: melissa_send("pressure", np.zeros(4)),
                r"melissa_send\('pressure'\): the field was not declared by melissa_init \(declared: \['field'\]\)",
            ),
            (lambda: melissa_send("field", np.zeros(3)), r"field 'field': got float64\[3\], declared float64\[4\]"),
        ]
        for mistake, message in mistakes:
            with pytest.raises(ClientError, match=f"^{message}"):
                mistake()
        melissa_send("field", [1, 2, 3, 4])  # any numbers: sent as float64
        with pytest.raises(ClientError, match=r"^melissa_init\('late'\): declare every field before the first"):
            melissa_init("late", 1, None)
        melissa_finalize()
        assert data_steps(receive_until_finalize(ranks)) == [[], [0]]
