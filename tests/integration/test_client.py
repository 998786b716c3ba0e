"""The client against a live receiver and handshake service, in one process (no MPI)."""

from __future__ import annotations

import secrets
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import zmq
from support import wait_until

from melissa_dl.buffers.kinds import Buffer, make_buffer
from melissa_dl.buffers.sample import Sample
from melissa_dl.errors import ClientError, HandshakeRefused, ReceiverDied, ServerUnreachable
from melissa_dl.ingest.assembly import StreamSpec
from melissa_dl.ingest.handshake import HandshakeServer
from melissa_dl.ingest.receiver import Receiver
from melissa_dl.wire.client import Client, _ask, _handshake_link
from melissa_dl.wire.security import Security

pytestmark = pytest.mark.timeout(60)

SIMULATIONS = 3


@dataclass
class Server:
    buffer: Buffer
    receiver: Receiver
    environ: dict[str, str]

    def announced(self, simulation: int, timeout: float = 60.0) -> int | None:
        """The steps a simulation announced, once every client rank's finalize is in."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            progress = self.receiver.report().progress.get(simulation)
            if progress is not None and progress.expected is not None:
                return progress.expected
            time.sleep(0.05)
        return None

    def drain(self, expected: int, timeout: float = 60.0) -> list[Sample]:
        samples: list[Sample] = []
        deadline = time.monotonic() + timeout
        while len(samples) < expected and time.monotonic() < deadline:
            samples += self.buffer.get_batch(1, timeout=0.1) or []
        return samples


def start_server(
    buffer: Buffer,
    max_message_bytes: int = 1 << 24,
    client_size: int = 1,
    level: str = "token",
    client_timeout: float = 5.0,
    peers: int = 0,
) -> tuple[Server, HandshakeServer]:
    token = secrets.token_bytes(32)
    security = Security.generate(level, token, client_timeout, peers)
    parameters = np.arange(SIMULATIONS * 2, dtype=np.float64).reshape(SIMULATIONS, 2)
    spec = StreamSpec(["a", "b"], parameters, token, server_rank=0, server_size=1, max_message_bytes=max_message_bytes)
    receiver = Receiver(spec, buffer, "127.0.0.1", receive_queue_bytes=2 * max_message_bytes, security=security)
    receiver.start_and_bind()
    handshake = HandshakeServer(
        token=token,
        fields=["a", "b"],
        simulations=SIMULATIONS,
        endpoints=[receiver.endpoints("127.0.0.1")],
        bind_simulation=False,
        max_message_bytes=max_message_bytes,
        bind_address="127.0.0.1",
        client_size=client_size,
        security=security,
    )
    environ = {
        "MELISSA_SERVER": f"tcp://127.0.0.1:{handshake.start_and_bind()}",
        "MELISSA_TOKEN": token.hex(),
        "MELISSA_SIMULATION_ID": "1",
        "MELISSA_PARAMETERS": "[2.0, 3.0]",
        "MELISSA_CLIENT_TIMEOUT": str(client_timeout),
        **security.client_environment(),
    }
    handshake.expect(1, 0)
    return Server(buffer, receiver, environ), handshake


def serving(client_size: int) -> Iterator[Server]:
    buffer = make_buffer("fifo", capacity_samples=100, capacity_bytes=None, watermark=1, seed=0)
    live, handshake = start_server(buffer, client_size=client_size)
    yield live
    live.receiver.stop()
    handshake.stop()


@pytest.fixture
def server() -> Iterator[Server]:
    yield from serving(client_size=1)


@pytest.fixture
def two_rank_server() -> Iterator[Server]:
    yield from serving(client_size=2)


class FakeComm:
    """Rank and size of an MPI-parallel client, without MPI."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def Get_rank(self) -> int:  # noqa: N802 (mpi4py's name)
        return self.rank

    def Get_size(self) -> int:  # noqa: N802
        return self.size


def test_slices_of_a_parallel_client_are_stacked_in_rank_order(two_rank_server: Server) -> None:
    server = two_rank_server

    def run(rank: int) -> None:
        fields = {"a": ("float32", (rank + 1, 3)), "b": ("int64", (2,))}
        with Client(fields, comm=FakeComm(rank, 2), environ=server.environ) as client:
            for t in range(5):
                client.send("a", t, np.full((rank + 1, 3), 10 * t + rank, dtype=np.float32))
                client.send("b", t, np.array([t, rank]))

    threads = [threading.Thread(target=run, args=(r,)) for r in (1, 0)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
        assert not thread.is_alive()
    samples = sorted(server.drain(5), key=lambda s: s.time_step)
    assert [s.time_step for s in samples] == [0, 1, 2, 3, 4]
    for s in samples:
        assert s.simulation_id == 1 and s.parameters.tolist() == [2.0, 3.0]
        assert s.fields["a"].tolist() == [[10 * s.time_step] * 3] + [[10 * s.time_step + 1] * 3] * 2
        assert s.fields["b"].tolist() == [s.time_step, 0, s.time_step, 1]
    assert server.announced(1) == 5


def test_misuse_raises_client_errors_naming_the_field(server: Server) -> None:
    with Client({"a": ("float32", (3,)), "b": ("float32", (1,))}, environ=server.environ) as client:
        with pytest.raises(ClientError, match="field 'c' was not declared"):
            client.send("c", 0, np.zeros(3, np.float32))
        with pytest.raises(ClientError, match=r"field 'a': got float64\[3\], declared float32\[3\]"):
            client.send("a", 0, np.zeros(3))
        with pytest.raises(ClientError, match=r"field 'a': got float32\[4\]"):
            client.send("a", 0, np.zeros(4, np.float32))
    with pytest.raises(ClientError, match="MELISSA_SIMULATION_ID is not set"):
        Client({"a": ("float32", (3,))}, environ={})


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"MELISSA_TOKEN": "00" * 32},
            r"credentials refused \(ZAP status 400\): this simulation's credentials "
            r"\(MELISSA_SECURITY=token\) are not the server's",
        ),
        ({"MELISSA_SIMULATION_ID": "2"}, "simulation 2 is not expected"),
    ],
)
def test_refused_handshakes_say_why(server: Server, change: dict[str, str], message: str) -> None:
    with pytest.raises(HandshakeRefused, match=message):
        Client({"a": ("float32", (3,)), "b": ("float32", (1,))}, environ={**server.environ, **change})


@pytest.mark.timeout(30)
def test_credentials_refused_before_the_hello_is_sent_are_an_error_not_a_hang(server: Server) -> None:
    """On a busy machine the server's refusal can come between the client's connect and its send: ZeroMQ then
    leaves the socket without a connection, where a blocking send waits for ever. Here the hello is sent once
    the socket has dropped the refused connection (it takes no message any more)."""
    environ = {**server.environ, "MELISSA_TOKEN": "00" * 32}
    link = _handshake_link(zmq.Context.instance(), environ["MELISSA_SERVER"], environ)
    try:
        while link.socket.poll(0, zmq.POLLOUT):
            time.sleep(0.01)
        with pytest.raises(HandshakeRefused, match="credentials refused"):
            _ask(link, {"hello": 1}, timeout=5.0, who="simulation 1")
    finally:
        link.close()


def test_a_client_without_server_fails_after_its_timeout() -> None:
    environ = {
        "MELISSA_SERVER": "tcp://127.0.0.1:9",
        "MELISSA_TOKEN": "00",
        "MELISSA_SIMULATION_ID": "0",
        "MELISSA_PARAMETERS": "[]",
        "MELISSA_CLIENT_TIMEOUT": "0.5",
    }
    start = time.monotonic()
    with pytest.raises(ServerUnreachable, match="no handshake answer"):
        Client({"a": ("float32", (3,))}, environ=environ)
    assert time.monotonic() - start < 5


@pytest.mark.timeout(300)
def test_a_full_buffer_blocks_the_client_and_loses_nothing() -> None:
    """The client waits while the buffer is full, and resumes as it frees: it never gives up on the live server,
    whatever the machine's load (a compile of the non-finite check once held the delivery service for longer than
    the 5-second client timeout). Waits are on samples or on the client's failure, under the test's timeout only."""
    mib = 1 << 20
    buffer = make_buffer("fifo", capacity_samples=2, capacity_bytes=None, watermark=1, seed=0)
    server, handshake = start_server(buffer, max_message_bytes=mib)
    server.environ["MELISSA_SEND_QUEUE_BYTES"] = str(2 * mib)
    steps = 64  # 64 MiB: far more than the buffer, ZeroMQ's queues and the kernel's socket buffers hold
    sent: list[int] = []
    failures: list[BaseException] = []

    def simulate() -> None:
        try:
            with Client({"a": ("float32", (mib // 4,)), "b": ("float32", (1,))}, environ=server.environ) as client:
                for t in range(steps):
                    client.send("a", t, np.full(mib // 4, t, np.float32))
                    client.send("b", t, np.zeros(1, np.float32))
                    sent.append(t)
        except BaseException as error:
            failures.append(error)

    thread = threading.Thread(target=simulate)
    thread.start()
    assert wait_until(lambda: len(buffer) == 2 or bool(failures), timeout=240)
    assert len(buffer) == 2 and len(sent) < steps and not failures  # the client waits instead of data being dropped
    samples: list[Sample] = []
    while len(samples) < steps and not failures:  # a lost sample: the test's timeout (the last may still be put)
        samples += buffer.get_batch(1, timeout=0.1) or []
    thread.join(60)
    assert not thread.is_alive() and not failures, failures
    assert sorted(s.time_step for s in samples) == list(range(steps))
    assert all(s.fields["a"][0] == s.time_step for s in samples)
    server.receiver.stop()
    handshake.stop()


class AnswerLosingRelay:
    """A TCP relay to the handshake port that ends its first connection instead of passing on the answer to the
    hello: what a connection cut after its login (the guard's caps) or a failing link does to a client."""

    def __init__(self, port: int, answered: threading.Event) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.upstream = port
        self.answered = answered  # set once the service has admitted the hello (its answer follows)
        self.cut = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client, not self.cut.is_set()), daemon=True).start()

    def _relay(self, client: socket.socket, lose_answer: bool) -> None:
        with client, socket.create_connection(("127.0.0.1", self.upstream)) as server:
            while True:
                ready, _, _ = select.select([client, server], [], [], 10)
                for end in ready:
                    data = end.recv(65536)
                    if not data:
                        return
                    if end is server and lose_answer and self.answered.is_set():
                        self.cut.set()
                        return  # both ends close: the answer is lost with the connection
                    (server if end is client else client).sendall(data)

    def close(self) -> None:
        self.listener.close()


def test_a_hello_whose_answer_was_lost_with_its_connection_is_sent_again() -> None:
    buffer = make_buffer("fifo", capacity_samples=100, capacity_bytes=None, watermark=1, seed=0)
    server, handshake = start_server(buffer)
    answers: list[dict[str, Any]] = []
    admitted = threading.Event()
    answer = handshake.answer

    def answer_and_note(request: list[bytes]) -> dict[str, Any]:
        reply = answer(request)
        answers.append(reply)
        admitted.set()
        return reply

    handshake.answer = answer_and_note  # type: ignore[method-assign]
    relay = AnswerLosingRelay(int(server.environ["MELISSA_SERVER"].rsplit(":", 1)[1]), admitted)
    environ = {**server.environ, "MELISSA_SERVER": f"tcp://127.0.0.1:{relay.port}"}
    try:
        with Client({"a": ("float32", (3,)), "b": ("float32", (1,))}, environ=environ) as client:
            client.send("a", 0, np.ones(3, np.float32))
            client.send("b", 0, np.zeros(1, np.float32))
        assert relay.cut.is_set()
        assert len(answers) == 2 and answers[0] == answers[1] and answers[0]["ok"]  # the same hello, answered again
        assert [s.time_step for s in server.drain(1)] == [0]
    finally:
        relay.close()
        server.receiver.stop()
        handshake.stop()


def test_a_client_whose_server_vanishes_fails_after_its_timeout() -> None:
    mib = 1 << 20
    server, handshake = start_server(
        make_buffer("fifo", capacity_samples=1000, capacity_bytes=None, watermark=1, seed=0), max_message_bytes=mib
    )
    server.environ.update(MELISSA_CLIENT_TIMEOUT="1", MELISSA_SEND_QUEUE_BYTES=str(2 * mib))
    fields = {"a": ("float32", (mib // 4,)), "b": ("float32", (1,))}
    start = 0.0
    with pytest.raises(ServerUnreachable, match=r"server rank 0 \(tcp://127.0.0.1:\d+\) has been unreachable for 1 s"):
        with Client(fields, environ=server.environ) as client:
            client.send("a", 0, np.zeros(mib // 4, np.float32))
            client.send("b", 0, np.zeros(1, np.float32))
            assert len(server.drain(1)) == 1
            server.receiver.stop()  # the server dies: its sockets close, nobody will read again
            handshake.stop()
            start = time.monotonic()
            for t in range(1, 1000):
                client.send("a", t, np.zeros(mib // 4, np.float32))
                client.send("b", t, np.zeros(1, np.float32))
    assert time.monotonic() - start < 10


class BrokenBuffer:
    def put(self, sample: Sample, timeout: float | None = None, on_insert: object = None) -> bool:
        raise RuntimeError("disk on fire")

    def __len__(self) -> int:
        return 0


def test_a_receiver_failure_reaches_the_main_thread() -> None:
    """The rank's data socket closes with its thread, so the finalizing client, whose messages it cannot
    confirm, fails after its timeout instead of exiting as if they were delivered."""
    server, handshake = start_server(BrokenBuffer(), client_timeout=1.0)  # type: ignore[arg-type]
    with pytest.raises(ServerUnreachable, match="unreachable for 1 s"):
        with Client({"a": ("float32", (3,)), "b": ("float32", (1,))}, environ=server.environ) as client:
            client.send("a", 0, np.zeros(3, np.float32))
            client.send("b", 0, np.zeros(1, np.float32))
    server.receiver.join(10)
    with pytest.raises(ReceiverDied, match="disk on fire"):
        server.receiver.check()
    handshake.stop()


def test_small_buffered_samples_cost_what_the_buffer_counts() -> None:
    """A view of a 200-byte payload pins ZeroMQ's whole receive chunk: 2,000 such samples held ~36 MB."""
    from melissa_dl.train.trainer import rss_megabytes

    steps = 2000
    buffer = make_buffer("fifo", capacity_samples=steps, capacity_bytes=None, watermark=1, seed=0)
    server, handshake = start_server(buffer)
    try:
        before = rss_megabytes()
        with Client({"a": ("float32", (50,)), "b": ("int64", (1,))}, environ=server.environ) as client:
            for t in range(steps):
                client.send("a", t, np.full(50, t, dtype=np.float32))
                client.send("b", t, np.array([t]))
                time.sleep(0.001)  # a slow stream: each message arrives alone, in a receive chunk of its own
        assert server.announced(1) == steps
        grown = rss_megabytes() - before
        counted = buffer.nbytes / 1e6
    finally:
        server.receiver.stop()
        handshake.stop()
    assert len(buffer) == steps
    assert grown < counted + 8, f"RSS grew {grown:.1f} MB for {counted:.1f} MB of buffered samples"
