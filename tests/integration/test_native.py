"""The C library, its Fortran module and the C and Fortran heat solvers, built from source by `make native`."""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import queue
import re
import runpy
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from support import HERE, ROOT, clean_environment, run_server, study_config, wait_until
from test_security import assert_given_up_within_its_timeout, assert_received_every_step, stub_server
from test_studies import assert_clean_study, assert_every_step_once

from launcher.schedulers import COMMAND_LINE
from melissa_dl.ingest.assembly import Delivery
from melissa_dl.ingest.connections import ConnectionGuard, ServerSocketThread
from melissa_dl.ingest.delivery import DeliveryServer
from melissa_dl.ingest.handshake import HandshakeServer
from melissa_dl.wire.client import Client
from melissa_dl.wire.protocol import PROTOCOL_VERSION, Kind, parts, unpack_header
from melissa_dl.wire.security import Security

pytestmark = pytest.mark.timeout(180)

HeatSolver = runpy.run_path(str(ROOT / "examples" / "heat_pde" / "solver.py"))["HeatSolver"]
HEAT_PARAMETERS = [{"name": n, "low": 100.0, "high": 500.0} for n in ("initial", "left", "right", "bottom", "top")]
VERSION = importlib.metadata.version("melissa_dl")


def recording(directory: Path) -> dict:
    """A training section whose module saves every sample it gets into ``directory``."""
    directory.mkdir()
    return {
        "module": str(HERE / "recorder.py"),
        "class_name": "Recorder",
        "options": {"directory": str(directory)},
        "batch_size": 1,
        "device": "cpu",
    }


@pytest.mark.parametrize("program", ["heat_c", "heat_fortran"])
def test_native_heat_solvers_stream_the_python_solvers_fields(
    tmp_path: Path, output: Path, native: Path, program: str
) -> None:
    steps, nx, ny, simulations = 12, 15, 8, 3  # 15 rows: 8 on client rank 0, 7 on rank 1
    command = [str(native / program), "--nx", str(nx), "--ny", str(ny), "--steps", str(steps)]
    config = study_config(
        output,
        command,
        launcher={"scheduler": "mpirun", "client_ranks": 2},
        study={
            "fields": ["temperature"],
            "parameters": HEAT_PARAMETERS,
            "simulations": simulations,
            "time_steps": steps,
        },
    )
    config["training"] = recording(tmp_path / "samples")
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None
    assert_every_step_once(run.report, simulations, steps)
    assert run.report["rejected"] == {}
    assert run.report["per_rank_samples"][0] > 0 and run.report["per_rank_samples"][1] > 0
    samples = {tuple(map(int, path.stem.split("_"))): np.load(path) for path in (tmp_path / "samples").iterdir()}
    assert sorted(samples) == [(s, t) for s in range(simulations) for t in range(steps)]
    for s in range(simulations):
        solver = HeatSolver(samples[s, 0]["parameters"], nx, ny)
        for t in range(steps):
            field = samples[s, t]["temperature"]
            assert field.dtype == np.float32
            np.testing.assert_allclose(field, solver.step().reshape(-1), rtol=1e-6, err_msg=f"simulation {s} step {t}")


def lines(log: Path) -> list[tuple[str, str]]:
    """The program's lines of an attempt's log as (what, said): the first, the attempt's command, left out."""
    return [tuple(line.split(": ", 1)) for line in log.read_text().splitlines() if not line.startswith(COMMAND_LINE)]


def is_parameter(line: tuple[str, str]) -> bool:
    return line[0] == "parameters" or line[0].startswith("parameter ")


def parameters_said(said: list[tuple[str, str]]) -> tuple[list[float], dict[str, float]]:
    """What a client printed of its parameters: by position ("parameters: <values>") and by name
    ("parameter NAME: <value>")."""
    by_position = [float(value) for key, values in said if key == "parameters" for value in values.split()]
    by_name = {key.removeprefix("parameter "): float(value) for key, value in said if key.startswith("parameter ")}
    return by_position, by_name


def test_c_client_mistakes_get_clear_codes_and_the_server_keeps_running(
    tmp_path: Path, output: Path, native: Path
) -> None:
    config = study_config(output, [str(native / "c_client"), "--errors", "--parameter", "a", "--parameter", "b"])
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None
    assert_every_step_once(run.report, 4, 10)
    assert [s["attempts"] for s in run.report["per_simulation"]] == [1, 1, 1, 1]
    sampled = {s["id"]: s["parameters"] for s in run.report["per_simulation"]}
    for s in range(4):  # by name (MELISSA_PARAMETER_NAMES) as by position (MELISSA_PARAMETERS)
        by_position, by_name = parameters_said(lines(output / "simulations" / f"simulation{s}.attempt0.log"))
        assert by_name == dict(zip(["a", "b"], by_position)) == sampled[s]
    assert run.report["rejected"] == {"handshake_auth": 1, "handshake_unknown_simulation": 1}
    refused_token = (
        "simulation 0: tcp://127.0.0.1:PORT: credentials refused (ZAP status 400): this simulation's "
        "credentials (MELISSA_SECURITY=token) are not the server's (a stale environment, or another "
        "study's server?)"
    )
    refused_simulation = "simulation 99: handshake: simulation 99 is not in the study"
    unreachable = "no handshake answer from tcp://127.0.0.1:9 within 0.5 s"
    log = output / "simulations" / "simulation0.attempt0.log"
    log.write_text(re.sub(r"tcp://127\.0\.0\.1:\d{3,}", "tcp://127.0.0.1:PORT", log.read_text()))
    values = json.dumps(list(sampled[0].values()))  # MELISSA_PARAMETERS, as the launcher writes it
    assert [line for line in lines(log) if not is_parameter(line)] == [
        ("version", f"{VERSION} protocol {PROTOCOL_VERSION}"),
        ("unknown parameter", "2 melissa_dl_parameter: no parameter 'x' (the study's: a, b)"),
        ("NULL parameter name", "2 melissa_dl_parameter: name is NULL"),
        (
            "no parameter names",
            "1 MELISSA_PARAMETER_NAMES is not set: start this simulation through melissa-server's "
            "launcher (an older one passes the parameters without their names: read them by position with "
            "melissa_dl_parameters)",
        ),
        ("names not strings", "1 MELISSA_PARAMETER_NAMES='[\"a\", 2]' is not a JSON list of strings"),
        (
            "fewer names than values",
            f"1 MELISSA_PARAMETER_NAMES='[\"a\"]' and MELISSA_PARAMETERS='{values}' differ in length (1 and 2)",
        ),
        (
            "no simulation id",
            "1 MELISSA_SIMULATION_ID is not set: start this simulation through melissa-server's launcher",
        ),
        ("send before init", "3 field 'field': no field is declared: call melissa_dl_init first"),
        ("finalize before init", "3 nothing to finalize: no field is declared"),
        ("unknown dtype", "2 field 'field': dtype 7 is neither MELISSA_DL_FLOAT32 (0) nor MELISSA_DL_FLOAT64 (1)"),
        ("block outside", "2 field 'field': axis 0: a block of 3 from 2 does not fit in 4"),
        (
            "block of 7 axes",
            "2 field 'field': 7 dimensions: a block's global shape, start and shape have 1 to 6 each, as many",
        ),
        ("block without start", "2 field 'field': a NULL global shape, start or shape"),
        ("wrong token", f"7 {refused_token}"),
        (
            "send after that",
            f"3 field 'field': the connection failed earlier ({refused_token}): call melissa_dl_finalize",
        ),
        ("finalize after that", f"3 nothing announced: the connection failed earlier ({refused_token})"),
        ("unknown simulation", f"7 {refused_simulation}"),
        (
            "send after that",
            f"3 field 'field': the connection failed earlier ({refused_simulation}): call melissa_dl_finalize",
        ),
        ("finalize after that", f"3 nothing announced: the connection failed earlier ({refused_simulation})"),
        ("no server", f"8 {unreachable}"),
        (
            "send after that",
            f"3 field 'field': the connection failed earlier ({unreachable}): call melissa_dl_finalize",
        ),
        ("finalize after that", f"3 nothing announced: the connection failed earlier ({unreachable})"),
        ("declared twice", "2 field 'field' is declared twice"),
        ("undeclared field", "4 field 'pressure' was not declared (declared: 'field')"),
        ("wrong count", "6 field 'field': got 31 elements, declared 32"),
        ("wrong dtype", "5 field 'field': got float64 data, declared float32"),
        ("negative step", "2 field 'field': time step -1 is not in [0, 2^32)"),
        ("init after the first send", "3 field 'late': declare every field before the first send"),
    ]


def test_the_fortran_module_with_use_mpi_handles_and_float64(tmp_path: Path, output: Path, native: Path) -> None:
    values = [[0.25, 2.0], [0.5, 1.5], [0.75, 1.0]]
    config = study_config(
        output,
        [str(native / "f_client"), "6", "a", "b"],
        study={"simulations": 3, "time_steps": 6, "sampler": "list", "parameter_values": values},
        launcher={"scheduler": "mpirun", "client_ranks": 2},
    )
    config["training"] = recording(tmp_path / "samples")
    run = run_server(tmp_path, config, ranks=2)
    assert run.code == 0, run.log
    assert run.report is not None
    assert_every_step_once(run.report, 3, 6)
    assert run.report["rejected"] == {}
    for s in range(3):
        log = lines(output / "simulations" / f"simulation{s}.attempt0.log")
        said = dict(log)
        assert said["version"] == f"{VERSION} protocol {PROTOCOL_VERSION}"
        assert said["simulation"] == f"{s} attempt 0"
        by_position, by_name = parameters_said(log)
        assert by_position == values[s]
        assert by_name == dict(zip(["a", "b"], by_position))
        assert said["unknown parameter"] == "2 melissa_dl_parameter: no parameter 'x' (the study's: a, b)"
        assert said["undeclared field"] == "4 field 'pressure' was not declared (declared: 'field')"
        assert said["wrong count"] == "6 field 'field': got 4 elements, declared 6"
        for t in range(6):
            field = np.load(tmp_path / "samples" / f"{s}_{t}.npz")["field"]
            assert field.dtype == np.float64
            assert field.tolist() == [1000 * s + t] * 6 + [1000 * s + t + 0.5] * 6


class RawRank(ServerSocketThread):
    """A server rank's data socket, behind the study's gates, that keeps every message as it came, with the
    delivery service a finalizing client waits for: it counts what this socket read."""

    socket_type = zmq.PULL
    guard_name = "data"

    def __init__(self, security: Security) -> None:
        super().__init__("raw-rank", "127.0.0.1", security=security, message_cap=1 << 20)
        self.messages: queue.Queue[list[bytes]] = queue.Queue()
        self._read: Counter[tuple[int, int, int]] = Counter()
        self._finalized: set[tuple[int, int, int]] = set()
        self.delivery = DeliveryServer(0, security.token, self._delivery, self.rejections, "127.0.0.1", security)

    def handle(self, socket: zmq.Socket, guard: ConnectionGuard) -> None:
        frames = socket.recv_multipart()
        header = unpack_header(frames[0])
        client = (header.simulation_id, header.attempt, header.client_rank)
        if header.kind is Kind.DECLARE:  # the same attempt again (the test sends it twice): its count starts over
            self._read[client] = 0
            self._finalized.discard(client)
        self._read[client] += 1
        if header.kind is Kind.FINALIZE:
            self._finalized.add(client)
        self.messages.put(frames)

    def _delivery(self, sim: int, attempt: int, client_rank: int) -> Delivery:
        client = (sim, attempt, client_rank)
        return Delivery(self._read[client], client in self._finalized, ended=False)


def receive_until_finalize(ranks: list[RawRank]) -> list[list[list[bytes]]]:
    """Every message each rank gets, up to and including its FINALIZE."""
    received: list[list[list[bytes]]] = []
    for rank in ranks:
        messages: list[list[bytes]] = []
        while not messages or unpack_header(messages[-1][0]).kind is not Kind.FINALIZE:
            messages.append(rank.messages.get(timeout=10))
        received.append(messages)
    return received


@contextlib.contextmanager
def data_sockets(
    token: bytes,
    bind: bool,
    level: str = "token",
    max_message_bytes: int = 1 << 20,
    next_work: Callable[[str, str | None], dict[str, Any]] | None = None,
    block: int = 1,
    overlap: int = 0,
) -> Iterator[tuple[dict[str, str], list[RawRank], HandshakeServer]]:
    """A handshake service for simulation 3 of a study with the field "field" (persistent workers asking
    ``next_work``; steps routed in ``block``s, with ``overlap``), and two raw ranks standing for two server ranks;
    yields the client's environment, the ranks and the handshake service."""
    security = Security.generate(level, token, 10.0)
    ranks = [RawRank(security) for _ in range(2)]
    for rank in ranks:
        rank.start_and_bind()
        rank.delivery.start_and_bind()
    handshake = HandshakeServer(
        token=token,
        fields=["field"],
        simulations=4,
        endpoints=[(f"tcp://127.0.0.1:{r.port}", f"tcp://127.0.0.1:{r.delivery.port}") for r in ranks],
        bind_simulation=bind,
        max_message_bytes=max_message_bytes,
        bind_address="127.0.0.1",
        security=security,
        next_work=next_work,
        block=block,
        overlap=overlap,
    )
    handshake.expect(3, 0)
    try:
        yield (
            {
                "MELISSA_SERVER": f"tcp://127.0.0.1:{handshake.start_and_bind()}",
                "MELISSA_TOKEN": token.hex(),
                "MELISSA_SIMULATION_ID": "3",
                "MELISSA_PARAMETERS": "[0.5]",
                "MELISSA_CLIENT_TIMEOUT": "10",
                **security.client_environment(),
            },
            ranks,
            handshake,
        )
    finally:
        handshake.stop()
        for rank in ranks:
            rank.delivery.stop()
            rank.stop()


def run_c_client(native: Path, environ: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(native / "c_client"), *args],
        env={**clean_environment(), **environ},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("token_bytes, bind, count", [(32, False, 6), (120, True, 6), (32, False, 300_000)])
def test_the_c_client_sends_the_python_clients_bytes(native: Path, token_bytes: int, bind: bool, count: int) -> None:
    """300,000 float32 are 1.2 MB: a slice over PART_BYTES, which both clients send as the same two parts."""
    token = bytes((7 * i + 3) % 256 for i in range(token_bytes))  # a key longer than SHA-256's block, too
    with data_sockets(token, bind, max_message_bytes=4 << 20) as (environ, ranks, handshake):
        done = run_c_client(native, environ, "--steps", "5", "--count", str(count))
        assert done.returncode == 0, done.stdout + done.stderr
        from_c = receive_until_finalize(ranks)
        handshake.expect(3, 0)  # the same attempt again: its client rank may say hello once more
        with Client({"field": ("float32", (count,))}, environ=environ) as client:
            for t in range(5):
                client.send("field", t, np.full(count, 3000 + t, np.float32))
        from_python = receive_until_finalize(ranks)
    assert from_c == from_python
    kinds = [[unpack_header(message[0]).kind for message in messages] for messages in from_c]
    steps = [2, 3] if not bind else [0, 5]  # step t goes to rank (3 + t) mod 2, or every step to rank 3 mod 2
    per_step = len(parts(4 * count))
    assert kinds == [[Kind.DECLARE, *[Kind.DATA] * (n * per_step), Kind.FINALIZE] for n in steps]
    offsets = [unpack_header(message[0]).offset for message in from_c[0][1:-1]]
    assert offsets == [offset for _ in range(steps[0]) for offset in parts(4 * count)]


def test_with_windows_the_c_client_sends_each_blocks_steps_and_the_next_blocks_first_to_the_same_ranks(
    native: Path,
) -> None:
    """Blocks of 4 steps, 2 copied: simulation 3's blocks go to ranks 1, 0, 1 (steps 0-3, 4-7, 8-9), and rank 1
    also gets steps 4 and 5, rank 0 steps 8 and 9; both clients send the same messages, and each FINALIZE counts
    the copies."""
    token = bytes(range(32))
    with data_sockets(token, False, block=4, overlap=2) as (environ, ranks, handshake):
        done = run_c_client(native, environ, "--steps", "10", "--count", "6")
        assert done.returncode == 0, done.stdout + done.stderr
        from_c = receive_until_finalize(ranks)
        handshake.expect(3, 0)
        with Client({"field": ("float32", (6,))}, environ=environ) as client:
            for t in range(10):
                client.send("field", t, np.full(6, 3000 + t, np.float32))
        from_python = receive_until_finalize(ranks)
    assert from_c == from_python
    steps = [[unpack_header(m[0]).time_step for m in messages[1:-1]] for messages in from_c]
    assert steps == [[4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 4, 5, 8, 9]]
    finalized = [json.loads(bytes(messages[-1][1])) for messages in from_c]
    assert finalized == [{"steps": 6}, {"steps": 8}]


def test_names_are_escaped_in_json_both_ways(native: Path) -> None:
    name = 'ta"g\\ é 😀'  # sent in the hello, echoed back by the refusal as \" \\ \u00e9 and a surrogate pair
    with data_sockets(b"secret", bind=False) as (environ, _, _):
        done = run_c_client(native, environ, "--field", name)
    assert done.returncode == 1
    quoted = name.replace("\\", "\\\\")  # refusals quote peer text as repr does
    assert done.stderr == (
        f"c_client: melissa_dl error 7: simulation 3: handshake: simulation 3: unknown field "
        f"'{quoted}' (study has ['field'])\n"
    )


def test_the_c_client_links_the_static_library_and_the_solvers_the_shared_one(native: Path) -> None:
    def needed(program: str) -> str:
        return subprocess.run(
            ["readelf", "-d", str(native / program)], capture_output=True, text=True, check=True
        ).stdout

    assert "libmelissa_dl" not in needed("c_client")
    assert "[libmelissa_dl.so.0]" in needed("heat_c")
    assert "[libmelissa_dl_fortran.so.0]" in needed("heat_fortran")


SERIAL_PROGRAM = r"""
#include <stdio.h>
#include <melissa_dl.h>
int main(void) {
    int code = melissa_dl_init("field", MELISSA_DL_FLOAT32, 4, MPI_COMM_WORLD);
    fprintf(stderr, "%d %s\n", code, melissa_dl_error_message());
    return code == MELISSA_DL_ERR_MPI ? 0 : 1;
}
"""


def test_a_serial_program_loads_no_mpi_and_a_communicator_without_mpi_is_named(tmp_path: Path, native: Path) -> None:
    prefix = native.parent

    def loaded(program: Path) -> str:
        return subprocess.run(["ldd", str(program)], capture_output=True, text=True, check=True).stdout

    assert "libmpich" not in loaded(prefix / "lib" / "libmelissa_dl.so")
    assert "libmpich" not in loaded(native / "scale_client")  # MPI_COMM_NULL, no MPI_Init
    assert "libmpich" in loaded(native / "heat_c")  # an MPI program: the library's MPI calls resolve to its MPI
    source = tmp_path / "serial.c"
    source.write_text(SERIAL_PROGRAM)
    mpi_include = subprocess.run(
        ["pkg-config", "--cflags", "mpich"], capture_output=True, text=True, check=True
    ).stdout.split()
    subprocess.run(
        [
            "cc",
            "-Wl,--as-needed",
            "-o",
            str(tmp_path / "serial"),
            str(source),
            f"-I{prefix / 'include'}",
            *mpi_include,
            f"-L{prefix / 'lib'}",
            "-lmelissa_dl",
            f"-Wl,-rpath,{prefix / 'lib'}",
        ],
        check=True,
    )
    done = subprocess.run([str(tmp_path / "serial")], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stderr == (
        "10 field 'field': a communicator was passed, but this program is not linked with MPI "
        "(build it with mpicc, or pass MPI_COMM_NULL from a serial program)\n"
    )


@pytest.mark.parametrize("level", ["token", "curve"])
def test_a_c_client_without_the_studys_credentials_is_refused_at_the_door(native: Path, level: str) -> None:
    with data_sockets(b"secret", bind=False, level=level) as (environ, ranks, handshake):
        public, secret = (key.decode() for key in zmq.curve_keypair())
        wrong = {
            "token": {"MELISSA_TOKEN": "00" * 6},
            "curve": {"MELISSA_CURVE_PUBLIC_KEY": public, "MELISSA_CURVE_SECRET_KEY": secret},
        }[level]
        done = run_c_client(native, {**environ, **wrong}, "--steps", "2", "--count", "4")
        assert done.returncode == 1
        assert re.fullmatch(
            r"c_client: melissa_dl error 7: simulation 3: tcp://127\.0\.0\.1:\d+: credentials refused "
            rf"\(ZAP status 400\): this simulation's credentials \(MELISSA_SECURITY={level}\) are not "
            r"the server's \(a stale environment, or another study's server\?\)\n",
            done.stderr,
        )
        assert handshake.rejections.counts() == {"handshake_auth": 1}
        if level == "curve":  # another server's key: the server cannot read the hello, the client hears nothing
            done = run_c_client(native, {**environ, "MELISSA_CURVE_SERVER_KEY": public, "MELISSA_CLIENT_TIMEOUT": "1"})
            assert done.returncode == 1
            assert re.fullmatch(
                r"c_client: melissa_dl error 8: no handshake answer from tcp://127\.0\.0\.1:\d+ within "
                r"1 s \(\d+ ZeroMQ handshakes with it failed: another security level or CURVE server "
                r"key than MELISSA_SECURITY=curve\?\)\n",
                done.stderr,
            )
            assert wait_until(lambda: handshake.rejections.counts()["handshake_auth"] > 1)  # it cannot decrypt
        time.sleep(0.2)
        assert all(rank.messages.empty() for rank in ranks)  # nothing reached a data socket
        done = run_c_client(native, environ, "--steps", "2", "--count", "4")  # the study's credentials pass
        assert done.returncode == 0, done.stderr
        kinds = [[unpack_header(m[0]).kind for m in messages] for messages in receive_until_finalize(ranks)]
        assert kinds == [[Kind.DECLARE, Kind.DATA, Kind.FINALIZE]] * 2


def test_c_and_fortran_clients_run_a_study_at_the_curve_level(tmp_path: Path, output: Path, native: Path) -> None:
    config = study_config(
        output,
        [str(native / "c_client")],
        server={"security": "curve"},
        launcher={"scheduler": "mpirun", "client_ranks": 2},
    )
    assert_clean_study(run_server(tmp_path, config, ranks=2), 4, 10)
    config = study_config(
        tmp_path / "fortran",
        [str(native / "f_client"), "6"],
        server={"security": "curve"},
        study={"simulations": 2, "time_steps": 6},
        launcher={"scheduler": "mpirun", "client_ranks": 2},
    )
    assert_clean_study(run_server(tmp_path, config, ranks=1), 2, 6)


MIB = 1 << 20


@pytest.mark.alone
def test_the_c_client_waits_out_back_pressure_longer_than_its_timeout(native: Path) -> None:
    """The stub server holds its buffer full for 3.5 s; MELISSA_CLIENT_TIMEOUT is 1 s."""
    with stub_server("--timeout", "1", "--capacity", "2", "--hold", "3.5") as (process, environ):
        start = time.monotonic()
        done = run_c_client(native, environ, "--steps", "24", "--count", str(MIB // 4))
        assert done.returncode == 0, done.stderr
        assert time.monotonic() - start > 3.0
        assert_received_every_step(process, 24)


@pytest.mark.alone
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_blocked_c_client_of_a_dead_server_fails_within_its_timeout(native: Path, how: signal.Signals) -> None:
    with stub_server("--timeout", "1", "--capacity", "1") as (process, environ):
        client = subprocess.Popen(
            [str(native / "c_client"), "--steps", "1000", "--count", str(MIB // 4)],
            env={**clean_environment(), **environ},
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            time.sleep(1.5)  # blocked by back-pressure for 1.5 timeouts: waiting, not failed
            assert client.poll() is None
            process.send_signal(how)
            start = time.monotonic()
            _, stderr = client.communicate(timeout=30)
            elapsed = time.monotonic() - start
        finally:
            client.kill()
        process.kill()
        assert process.wait(10) == -signal.SIGKILL
    assert client.returncode == 1
    assert re.fullmatch(
        r"c_client: melissa_dl error 8: simulation 1: server rank 0 \(tcp://127\.0\.0\.1:\d+\) has "
        r"been unreachable for 1 s \(no connection, no answer\)\n",
        stderr,
    )
    assert_given_up_within_its_timeout(elapsed)
