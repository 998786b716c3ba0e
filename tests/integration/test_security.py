"""The door of every server socket (ZAP, both security levels), ZeroMQ's message cap, and dead servers found by
heartbeats instead of send timeouts: Python clients and raw peers against a live receiver and handshake service."""

from __future__ import annotations

import contextlib
import json
import logging
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from support import HERE, TOY_SIM, clean_environment, run_server, study_config, wait_until
from test_client import Server, start_server
from test_studies import assert_clean_study

from melissa_dl.buffers.kinds import make_buffer
from melissa_dl.errors import HandshakeRefused, ServerUnreachable
from melissa_dl.ingest.connections import PENDING_IN_ALL
from melissa_dl.wire.client import WAKE_MS, Client
from melissa_dl.wire.protocol import PART_BYTES, PROTOCOL_VERSION, Header, Kind, encode_json, simulation_key
from melissa_dl.wire.rejections import RejectionLog

pytestmark = pytest.mark.timeout(120)

MIB = 1 << 20
LEVELS = ["token", "curve"]
FIELDS = {"a": ("float32", (3,)), "b": ("float32", (1,))}


def count(log: RejectionLog, kind: str) -> int:
    return log.counts().get(kind, 0)


def at_the_door(log: RejectionLog, socket: str) -> int:
    """Refusals before ZeroMQ read a message: refused credentials or mechanism, or a handshake given up (which side
    of a mechanism mismatch notices it first varies)."""
    return count(log, f"{socket}_auth") + count(log, f"{socket}_noauth")


@contextlib.contextmanager
def serving(level: str, **options: object) -> Iterator[tuple[Server, object]]:
    buffer = make_buffer(
        "fifo",
        capacity_samples=int(options.pop("capacity", 100)),  # type: ignore[call-overload]
        capacity_bytes=None,
        watermark=1,
        seed=0,
    )
    server, handshake = start_server(buffer, level=level, **options)  # type: ignore[arg-type]
    try:
        yield server, handshake
    finally:
        server.receiver.stop()
        handshake.stop()


OUTSIDERS = ["no credentials", "PLAIN, wrong password", "CURVE, foreign client key", "CURVE, wrong server key"]


def outsider(context: zmq.Context, kind: int, how: str, server: Server) -> zmq.Socket:
    """A raw socket with some credentials, none of them the study's."""
    socket = context.socket(kind)
    if how == "PLAIN, wrong password":
        socket.plain_username, socket.plain_password = b"melissa", b"00" * 32
    elif how.startswith("CURVE"):
        public, secret = zmq.curve_keypair()
        right = server.environ.get("MELISSA_CURVE_SERVER_KEY", zmq.curve_keypair()[0].decode()).encode()
        socket.curve_serverkey = right if how == "CURVE, foreign client key" else zmq.curve_keypair()[0]
        socket.curve_publickey, socket.curve_secretkey = public, secret
    return socket


def offer(socket: zmq.Socket, message: list[bytes]) -> None:
    """Send ``message`` unless the socket has no connection left to queue it on: ZeroMQ drops a connecting
    socket's connection when the server refuses its handshake, and on a busy machine the refusal can come
    before the send, which would then wait for ever."""
    with contextlib.suppress(zmq.Again):
        socket.send_multipart(message, zmq.NOBLOCK)


@pytest.mark.parametrize("level", LEVELS)
def test_a_peer_without_the_studys_credentials_gets_nothing_accepted_on_either_socket(level: str) -> None:
    with serving(level) as (server, handshake):
        environ = server.environ
        hello = encode_json(
            {
                "protocol": PROTOCOL_VERSION,
                "token": environ["MELISSA_TOKEN"],
                "simulation_id": 1,
                "attempt": 0,
                "client_rank": 0,
                "client_size": 1,
                "fields": {"a": ["float32", [3]], "b": ["float32", [1]]},
            }
        )
        key = simulation_key(bytes.fromhex(environ["MELISSA_TOKEN"]), 1, 0)  # the outsiders even know the token
        declaration = encode_json({"fields": {"a": ["float32", [3]], "b": ["float32", [1]]}})
        frames = [
            [Header(Kind.DECLARE, key, 1, 0, 0, 0, 1, 0, "uint8", (), len(declaration)).pack(), declaration],
            *[
                [
                    Header(Kind.DATA, key, 1, 0, 7, 0, 1, f, "float32", shape, 4 * shape[0]).pack(),
                    np.full(shape, 666, np.float32).tobytes(),
                ]
                for f, shape in ((0, (3,)), (1, (1,)))
            ],
        ]
        endpoint = f"tcp://127.0.0.1:{server.receiver.port}"
        context = zmq.Context()
        context.setsockopt(zmq.LINGER, 0)
        try:
            for how in OUTSIDERS:
                before = at_the_door(handshake.rejections, "handshake")
                request = outsider(context, zmq.REQ, how, server)
                request.connect(environ["MELISSA_SERVER"])
                offer(request, [hello])
                assert wait_until(lambda: at_the_door(handshake.rejections, "handshake") > before), how
                assert not request.poll(300), how  # no answer: the hello was never read
                request.close(linger=0)
                before = at_the_door(server.receiver.rejections, "data")
                push = outsider(context, zmq.PUSH, how, server)
                push.connect(endpoint)
                for message in frames:
                    offer(push, message)
                assert wait_until(lambda: at_the_door(server.receiver.rejections, "data") > before), how
                push.close(linger=0)
        finally:
            context.destroy(linger=0)  # its sockets too: after a failed assertion, term() would wait for them forever
        wrong = {
            "token": {"MELISSA_TOKEN": "00" * 32},
            "curve": dict(
                zip(("MELISSA_CURVE_PUBLIC_KEY", "MELISSA_CURVE_SECRET_KEY"), (k.decode() for k in zmq.curve_keypair()))
            ),
        }[level]
        with pytest.raises(
            HandshakeRefused,
            match=r"credentials refused \(ZAP status 400\): this simulation's "
            rf"credentials \(MELISSA_SECURITY={level}\) are not the server's",
        ):
            Client(FIELDS, environ={**environ, **wrong})
        assert len(server.buffer) == 0
        with Client(FIELDS, environ=environ) as client:  # the study's own client still gets in
            client.send("a", 0, np.ones(3, np.float32))
            client.send("b", 0, np.ones(1, np.float32))
        samples = server.drain(1)
        assert [(s.time_step, s.fields["a"].tolist()) for s in samples] == [(0, [1.0, 1.0, 1.0])]
        assert server.drain(1, timeout=0.5) == []
        assert server.announced(1) == 1
        # nothing the outsiders sent reached the frame parser: only refusals at the door were counted
        assert "data_auth" in server.receiver.rejections.counts()  # the wrong password, at least
        assert set(server.receiver.rejections.counts()) <= {"data_auth", "data_noauth"}
        assert at_the_door(handshake.rejections, "handshake") >= len(OUTSIDERS) + 1


@pytest.mark.parametrize("level", LEVELS)
def test_a_slice_of_exactly_max_message_bytes_passes_zeromqs_cap_at_each_level(level: str) -> None:
    """CURVE frames a part in 33 more bytes: a cap of exactly max_message_bytes dropped every largest slice."""
    with serving(level, max_message_bytes=MIB) as (server, _):
        with Client({"a": ("float32", (MIB // 4,)), "b": ("float32", (1,))}, environ=server.environ) as client:
            for t in range(2):
                client.send("a", t, np.full(MIB // 4, t, np.float32))
                client.send("b", t, np.zeros(1, np.float32))
        assert sorted(s.time_step for s in server.drain(2)) == [0, 1]
        assert server.receiver.rejections.counts() == {}


@pytest.mark.parametrize("level", LEVELS)
def test_a_slice_over_part_bytes_arrives_whole_from_its_parts_at_each_level(level: str) -> None:
    """Every server socket caps a message part at about PART_BYTES; a larger slice is sent, and joined, in parts."""
    count = 5 * PART_BYTES // 8 + 1  # float32: 2.5 MiB and 4 bytes, three parts
    with serving(level, max_message_bytes=4 * MIB) as (server, _):
        with Client({"a": ("float32", (count,)), "b": ("float32", (1,))}, environ=server.environ) as client:
            for t in range(2):
                client.send("a", t, np.arange(count, dtype=np.float32) + t)
                client.send("b", t, np.zeros(1, np.float32))
        samples = sorted(server.drain(2), key=lambda sample: sample.time_step)
        for t, sample in enumerate(samples):
            np.testing.assert_array_equal(sample.fields["a"], np.arange(count, dtype=np.float32) + t)
        assert server.receiver.rejections.counts() == {}


def zmtp_greeting(mechanism: str) -> bytes:
    """What a ZeroMQ peer says first (ZMTP 3.0): signature, version, mechanism, as-server, filler."""
    return b"\xff" + bytes(8) + b"\x7f" + bytes([3, 0]) + mechanism.encode().ljust(20, b"\0") + bytes(32)


def oversize_login(mechanism: str) -> bytes:
    """A greeting, then a command frame announced just under 64 MiB and its first 64 KiB."""
    return zmtp_greeting(mechanism) + b"\x06" + ((64 << 20) - 1).to_bytes(8, "big") + bytes(64 << 10)


def until_closed(port: int, message: bytes) -> None:
    """Connect, say ``message`` and wait until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as peer:
        try:
            peer.sendall(message)
            while peer.recv(1 << 16):
                pass
        except ConnectionError:
            pass  # reset: closed with bytes unread


@pytest.mark.parametrize("level", LEVELS)
def test_garbage_and_parts_over_the_cap_before_login_are_cut_and_counted_at_every_socket(level: str) -> None:
    mechanism = "PLAIN" if level == "token" else "CURVE"
    with serving(level, max_message_bytes=64 * MIB) as (server, handshake):
        doors = {
            "data": (server.receiver.port, server.receiver.rejections),
            "ack": (server.receiver.delivery.port, server.receiver.rejections),
            "handshake": (handshake.port, handshake.rejections),
        }
        for port, _ in doors.values():
            for _ in range(3):
                until_closed(port, b"GET / HTTP/1.1\r\nHost: melissa\r\n\r\n")  # not ZMTP
                until_closed(port, oversize_login(mechanism))
        for name, (_, log) in doors.items():
            assert wait_until(lambda: count(log, f"{name}_cut") == 6), log.counts()
        assert set(server.receiver.rejections.counts()) == {"data_cut", "ack_cut"}
        assert set(handshake.rejections.counts()) == {"handshake_cut"}
        with Client(FIELDS, environ=server.environ) as client:  # the doors still open for the study's clients
            client.send("a", 0, np.ones(3, np.float32))
            client.send("b", 0, np.ones(1, np.float32))
        assert [s.time_step for s in server.drain(1)] == [0]


@pytest.mark.parametrize("reset", [False, True])
def test_a_peer_that_goes_away_before_its_login_is_counted_without_a_security_warning(
    caplog: pytest.LogCaptureFixture, reset: bool
) -> None:
    """A process that ends while it connects (a simulation killed, a rank torn down) closes or resets its
    connection before its login: counted as ``_noauth``, said at INFO (issue 57, item 3: four warnings at a
    sibling's teardown read as an attack)."""
    caplog.set_level(logging.INFO, logger="melissa_dl.wire.rejections")
    with serving("token") as (server, _):
        peer = socket.create_connection(("127.0.0.1", server.receiver.port), timeout=10)
        peer.sendall(b"\xff" + bytes(8) + b"\x7f")  # the start of ZMTP's greeting, then nothing more
        if reset:
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # an RST, not a FIN
        peer.close()
        log = server.receiver.rejections
        assert wait_until(lambda: count(log, "data_noauth") == 1), log.counts()
    said = [r for r in caplog.records if "data_noauth" in r.getMessage()]
    assert [r.levelno for r in said] == [logging.INFO], caplog.text
    assert "a connection closed by its peer before its login was done" in said[0].getMessage()


@pytest.mark.parametrize("peers", [0, PENDING_IN_ALL + 40])
def test_logins_beyond_the_pending_cap_are_shut_and_counted(caplog: pytest.LogCaptureFixture, peers: int) -> None:
    """Peers of this host (127.0.0.1) are under the cap of all; the cap of one host is for the others. The cap of
    all is never below the simulation ranks the study may run at once (``peers``), which may all log in at once."""
    cap = max(PENDING_IN_ALL, peers)
    with serving("token", peers=peers) as (server, _):
        idle = [socket.create_connection(("127.0.0.1", server.receiver.port), timeout=10) for _ in range(cap + 10)]
        try:
            log = server.receiver.rejections
            assert wait_until(lambda: count(log, "data_connections") == 10), log.counts()
            assert any(
                f"{cap} connections still logging in, at most {cap}: closing a new one" in record.getMessage()
                for record in caplog.records
            )
        finally:
            for peer in idle:
                peer.close()
        assert wait_until(lambda: count(log, "data_noauth") == cap), log.counts()
        with Client(FIELDS, environ=server.environ) as client:
            client.send("a", 0, np.ones(3, np.float32))
            client.send("b", 0, np.ones(1, np.float32))
        assert [s.time_step for s in server.drain(1)] == [0]


def reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)


def status_megabytes(key: str) -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+) kB", status).group(1)) / 1e3  # type: ignore[union-attr]


# Runs in a process of its own, so that its buffers are not counted in the server's RSS. argv: the client's
# environment as JSON, the data endpoint.
BIG_SENDER = r"""
import contextlib, json, sys, time, zmq
from melissa_dl.wire.security import configure_client
environ, endpoint = json.loads(sys.argv[1]), sys.argv[2]
context = zmq.Context()
sockets = []
def connect(kind, address, credentials):
    socket = context.socket(kind)
    if credentials:
        configure_client(socket, environ)
    socket.connect(address)
    sockets.append(socket)
    return socket
big = bytearray(200 << 20)
with contextlib.suppress(zmq.Again):  # refused at the handshake, its connection may be gone already (offer)
    connect(zmq.PUSH, endpoint, False).send_multipart([b"x" * 67, big], zmq.NOBLOCK, copy=False)  # no credentials
connect(zmq.PUSH, endpoint, True).send_multipart([b"x" * 67, big], copy=False)    # credentials, over the cap
hellos = [connect(zmq.REQ, environ["MELISSA_SERVER"], True) for _ in range(10)]
for socket in hellos:
    socket.send(bytes(25 << 20), copy=False)                                   # 25 MB hellos
time.sleep(3)
print(json.dumps([socket.poll(0) for socket in hellos]), flush=True)
for socket in sockets:
    socket.close(linger=0)
context.term()
"""


def test_frames_and_hellos_over_zeromqs_cap_cost_the_rank_no_memory() -> None:
    with serving("token", max_message_bytes=MIB) as (server, _):
        reset_peak_rss()
        before = status_megabytes("VmRSS")
        done = subprocess.run(
            [sys.executable, "-c", BIG_SENDER, json.dumps(server.environ), f"tcp://127.0.0.1:{server.receiver.port}"],
            env=clean_environment(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == [0] * 10  # no hello of 25 MB was read, so none was answered
        grown = status_megabytes("VmHWM") - before  # the peak: a frame read and freed leaves no trace in VmRSS
        assert grown < 50, f"the rank grew by {grown:.0f} MB"  # 200 + 200 + 250 MB were sent
        assert at_the_door(server.receiver.rejections, "data") >= 1
        assert len(server.buffer) == 0
        with Client(FIELDS, environ=server.environ) as client:  # the door still opens for the study's clients
            client.send("a", 0, np.ones(3, np.float32))
            client.send("b", 0, np.ones(1, np.float32))
        assert [s.time_step for s in server.drain(1)] == [0]


@pytest.mark.alone
def test_back_pressure_three_times_longer_than_the_client_timeout_fails_nothing() -> None:
    """The buffer stays full for 3.5 s, client_timeout is 1 s: the client waits, in its sends or in the flush of
    its finalize, and every step arrives; with a send timeout (or a bounded linger) it failed after 1 s."""
    steps, size = 8, MIB  # 4 MiB per step: more than ZeroMQ's queues and the kernel's socket buffers hold
    with serving("token", capacity=1, max_message_bytes=4 * size, client_timeout=1.0) as (server, _):
        server.environ["MELISSA_SEND_QUEUE_BYTES"] = str(8 * size)
        fields = {"a": ("float32", (size,)), "b": ("float32", (1,))}
        outcome: dict[str, object] = {}

        def simulate() -> None:
            try:
                with Client(fields, environ=server.environ) as client:
                    for t in range(steps):
                        client.send("a", t, np.full(size, t, np.float32))
                        client.send("b", t, np.zeros(1, np.float32))
                outcome["ended"] = time.monotonic()
            except BaseException as error:  # handed to the test's thread
                outcome["error"] = error

        thread = threading.Thread(target=simulate)
        thread.start()
        time.sleep(3.5)  # nobody reads the buffer
        hold_end = time.monotonic()
        assert "error" not in outcome and "ended" not in outcome  # still waiting, not failed
        samples = server.drain(steps)
        thread.join(30)
        assert not thread.is_alive()
        assert "error" not in outcome, outcome
        assert outcome["ended"] >= hold_end  # type: ignore[operator]
        assert sorted(s.time_step for s in samples) == list(range(steps))
        assert all(s.fields["a"][0] == s.time_step for s in samples)
        assert server.announced(1) == steps


@contextlib.contextmanager
def stub_server(*args: str) -> Iterator[tuple[subprocess.Popen[str], dict[str, str]]]:
    """``stub_server.py`` in a process of its own; yields it and the client's environment."""
    process = subprocess.Popen(
        [sys.executable, str(HERE / "stub_server.py"), *args],
        env=clean_environment(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        yield process, json.loads(process.stdout.readline())
    finally:
        process.kill()
        process.wait(10)


def assert_received_every_step(process: subprocess.Popen[str], steps: int) -> None:
    """Stop the stub server (closing its stdin) and check its tally: each step once, all announced."""
    assert process.stdin is not None and process.stdout is not None
    process.stdin.close()
    tally = json.loads(process.stdout.readline())
    assert process.wait(30) == 0
    assert sorted(tally["steps"]) == list(range(steps)) and tally["announced"] == steps


def assert_given_up_within_its_timeout(elapsed: float) -> None:
    """A blocked client takes a rank for dead once it has been unreachable (no connection, or a question
    unanswered) for its timeout, 1 s here, and sees it at its next wake: up to ``WAKE_MS`` later."""
    assert 0.8 < elapsed < 1 + WAKE_MS / 1000 + 0.5, elapsed


@pytest.mark.alone
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGSTOP])
def test_a_blocked_client_of_a_dead_server_fails_within_its_timeout(how: signal.Signals) -> None:
    """Killed, the server's connections close at once; frozen, its delivery service stops answering."""
    with stub_server("--timeout", "1", "--capacity", "1") as (process, environ):
        errors: list[BaseException] = []
        sent: list[int] = []

        def simulate() -> None:
            try:
                with Client({"field": ("float32", (MIB // 4,))}, environ=environ) as client:
                    for t in range(1000):
                        client.send("field", t, np.zeros(MIB // 4, np.float32))
                        sent.append(t)
            except BaseException as error:  # handed to the test's thread
                errors.append(error)

        thread = threading.Thread(target=simulate)
        thread.start()
        time.sleep(1.5)  # 1.5 client timeouts of back-pressure: blocked, not failed
        blocked_at = len(sent)
        assert not errors and 0 < blocked_at < 1000
        process.send_signal(how)
        start = time.monotonic()
        thread.join(30)
        elapsed = time.monotonic() - start
        assert not thread.is_alive()
        assert len(sent) == blocked_at
        assert len(errors) == 1 and isinstance(errors[0], ServerUnreachable), errors
        assert "has been unreachable for 1 s" in str(errors[0])
        assert_given_up_within_its_timeout(elapsed)
        process.kill()
        assert process.wait(10) == -signal.SIGKILL


@pytest.mark.alone
def test_a_client_blocked_by_a_server_process_that_holds_its_buffer_loses_nothing() -> None:
    with stub_server("--timeout", "1", "--capacity", "2", "--hold", "3.5") as (process, environ):
        start = time.monotonic()
        with Client({"field": ("float32", (MIB // 4,))}, environ=environ) as client:
            for t in range(24):
                client.send("field", t, np.full(MIB // 4, t, np.float32))
        assert time.monotonic() - start > 3.0
        assert_received_every_step(process, 24)


@pytest.mark.parametrize("level", LEVELS)
def test_a_whole_study_runs_at_each_security_level(tmp_path: Path, output: Path, level: str) -> None:
    """The launcher hands each simulation what its level needs (MELISSA_SECURITY and, for curve, the keys)."""
    config = study_config(
        output,
        [sys.executable, TOY_SIM, "--mpi"],
        server={"security": level},
        launcher={"scheduler": "mpirun", "client_ranks": 2},
    )
    assert_clean_study(run_server(tmp_path, config, ranks=2), 4, 10)
