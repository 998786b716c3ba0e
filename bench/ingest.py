"""Ingest throughput of one server rank against raw pyzmq PUSH/PULL
(docs/explanation/performance.md#what-the-targets-are).

All sides move the same bytes in the same run: ``--clients`` processes each
send ``--steps`` messages of ``--mib`` MiB of float32. The baseline is a bare
PULL socket receiving them (zero-copy) and dropping them, with the same
high-water marks as the server's sockets. The server side is
the real path: handshake, ``melissa_dl.wire.client.Client.send``, the receiver
thread (header checks, credentials, non-finite check, assembly), the FIFO
buffer and a consumer thread draining it. The C-client side is the same
server fed by ``bench/ingest_client.c`` through ``libmelissa_dl`` (built by
``make native``, which this script runs; without the Debian packages of
``scripts/system-packages check native`` it says so and measures the
Python side only). Both server sides run at each
security level (``server.security``): ``token`` (ZeroMQ PLAIN, the default)
and ``curve`` (CURVE encryption); the baseline is unauthenticated and
unencrypted. Throughput is bytes over the time from the first message
received to the last one consumed; the median of ``--repeat`` runs of each is
reported, one RESULT line per client language and security level.

Every run has a fresh receiving process, so that no side inherits another's
heap. The server's runs make the server's allocator setting
(``melissa_dl.runtime.allocator``, as ``melissa-server`` does at start); the baseline
runs as pyzmq does by default, and once more with that setting, whose ratios
are printed too (``*_same_allocator``, no target).

With ``--hosts`` the same runs cross a network: the receiving side (the
baseline's PULL socket; the server's handshake, receiver, buffer and
consumer) runs on one host of a two-host cluster of network namespaces
(``tests/integration/hosts.py``; root and ``ip`` needed) and every sender on
the other, so that all bytes go through the veth links and bridge between the
hosts' 198.18.0.x addresses. Each side is this script again (``--role``) in
its host's namespace. Its RESULT lines end in ``_hosts``, with the one-host
targets; their baseline is raw pyzmq over the same links.

    python bench/ingest.py [--clients 8] [--mib 1] [--steps 128] [--repeat 5] [--hosts]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing as mp
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from melissa_dl.buffers.kinds import make_buffer
from melissa_dl.ingest.assembly import StreamSpec
from melissa_dl.ingest.handshake import HandshakeServer
from melissa_dl.ingest.receiver import Receiver
from melissa_dl.runtime.allocator import keep_freed_memory
from melissa_dl.wire.client import Client
from melissa_dl.wire.security import LEVELS, Security

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "integration"))
from hosts import Cluster, Host  # noqa: E402  (the tests' cluster of namespaces, its folder put on the path above)

TIMEOUT = 60
SEND_QUEUE, RECEIVE_QUEUE = 8, 64  # messages queued per connection, the same on both sides
ROOT = Path(__file__).resolve().parent.parent
C_CLIENT = ROOT / "build" / "native" / "bin" / "ingest_client"


def raw_sender(go: Any, endpoint: str, steps: int, nbytes: int) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.SNDHWM, SEND_QUEUE)
    socket.connect(endpoint)
    payload = np.ones(nbytes // 4, np.float32)
    go.wait()
    for _ in range(steps):
        socket.send(payload)
    socket.close(linger=-1)
    context.term()


def client_sender(go: Any, environ: dict[str, str], steps: int, nbytes: int) -> None:
    payload = np.ones(nbytes // 4, np.float32)
    with Client({"field": ("float32", payload.shape)}, environ=environ) as client:
        go.wait()
        for t in range(steps):
            client.send("field", t, payload)


class Senders:
    """Sender processes that connect, then all send at once (after their imports and handshakes)."""

    def __init__(self, target: Callable[..., None], args_list: list[tuple[Any, ...]]) -> None:
        context = mp.get_context("spawn")
        self._go = context.Barrier(len(args_list))
        self._processes = [context.Process(target=target, args=(self._go, *args)) for args in args_list]
        for p in self._processes:
            p.start()

    def join(self) -> None:
        for p in self._processes:
            p.join(TIMEOUT)
            assert p.exitcode == 0, f"a sender ended with {p.exitcode}"


class CSenders:
    """``ingest_client`` processes that connect, say "ready", then all send at once when told to."""

    def __init__(self, args_list: list[tuple[dict[str, str], int, int]]) -> None:
        self._processes = [
            subprocess.Popen(
                [str(C_CLIENT), str(steps), str(nbytes // 4)],
                env=env,
                text=True,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            for env, steps, nbytes in args_list
        ]
        for p in self._processes:
            assert p.stdout is not None and p.stdout.readline() == "ready\n", "a C sender did not start"
        for p in self._processes:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.close()

    def join(self) -> None:
        for p in self._processes:
            assert p.wait(TIMEOUT) == 0, f"a C sender ended with {p.returncode}"


class Relayed:
    """The senders of a receiving side on the other host (``--hosts``): asked of the parent process on stdout,
    which runs them there (it alone can enter both hosts and kill what fails), and joined when it says so on stdin."""

    def __init__(self, kind: str, args_list: list[tuple[Any, ...]]) -> None:
        print(json.dumps([kind, args_list]), flush=True)

    def join(self) -> None:
        assert sys.stdin.readline() == "ended\n", "the senders on the other host failed"


def start_senders(kind: str, args_list: list[tuple[Any, ...]], remote: bool) -> Senders | CSenders | Relayed:
    """One sender of ``kind`` (``raw``, ``python`` or ``c``) per tuple of arguments; on the other host if ``remote``."""
    if remote:
        return Relayed(kind, args_list)
    if kind == "c":
        return CSenders(args_list)
    return Senders(raw_sender if kind == "raw" else client_sender, args_list)


def raw_throughput(clients: int, steps: int, nbytes: int, host: str | None) -> float:
    address = host or "127.0.0.1"
    socket = zmq.Context.instance().socket(zmq.PULL)
    socket.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
    port = socket.bind_to_random_port(f"tcp://{address}")
    socket.setsockopt(zmq.RCVTIMEO, TIMEOUT * 1000)  # a dead sender fails the bench instead of hanging it
    senders = start_senders("raw", [(f"tcp://{address}:{port}", steps, nbytes)] * clients, host is not None)
    socket.recv(copy=False)
    start = time.perf_counter()
    for _ in range(clients * steps - 1):
        socket.recv(copy=False)
    elapsed = time.perf_counter() - start
    senders.join()
    socket.close(linger=0)
    return (clients * steps - 1) * nbytes / elapsed


def server_throughput(clients: int, steps: int, nbytes: int, c_client: bool, level: str, host: str | None) -> float:
    address = host or "127.0.0.1"
    token = secrets.token_bytes(32)
    security = Security.generate(level, token, TIMEOUT)
    spec = StreamSpec(["field"], np.zeros((clients, 1)), token, server_rank=0, server_size=1, max_message_bytes=nbytes)
    buffer = make_buffer("fifo", capacity_samples=64, capacity_bytes=None, watermark=1, seed=0)
    receiver = Receiver(spec, buffer, address, receive_queue_bytes=RECEIVE_QUEUE * nbytes, security=security)
    receiver.start_and_bind()
    handshake = HandshakeServer(
        token=token,
        fields=["field"],
        simulations=clients,
        endpoints=[receiver.endpoints(address)],
        bind_simulation=False,
        max_message_bytes=nbytes,
        bind_address=address,
        security=security,
    )
    endpoint = f"tcp://{address}:{handshake.start_and_bind()}"
    for sim in range(clients):
        handshake.expect(sim, 0)
    environs = [
        {
            "MELISSA_SERVER": endpoint,
            "MELISSA_TOKEN": token.hex(),
            "MELISSA_SIMULATION_ID": str(sim),
            "MELISSA_PARAMETERS": "[0.0]",
            "MELISSA_SEND_QUEUE_BYTES": str(SEND_QUEUE * nbytes),
            "MELISSA_CLIENT_TIMEOUT": str(TIMEOUT),
            **security.client_environment(),
        }
        for sim in range(clients)
    ]
    senders = start_senders("c" if c_client else "python", [(env, steps, nbytes) for env in environs], host is not None)

    def take(size: int) -> int:
        batch = buffer.get_batch(size, timeout=TIMEOUT)
        assert batch, "no data: a sender died"
        return len(batch)

    consumed = take(1)
    start = time.perf_counter()
    while consumed < clients * steps:
        consumed += take(min(8, clients * steps - consumed))
    elapsed = time.perf_counter() - start
    senders.join()
    receiver.stop()
    handshake.stop()
    return (clients * steps - 1) * nbytes / elapsed


RAW, RAW_KEPT = "raw", "raw_kept"  # the baseline as pyzmq runs, and with the server's allocator setting


def throughput(side: tuple[str, bool, str], clients: int, steps: int, nbytes: int, host: str | None = None) -> float:
    """One run of one side (``RAW``, ``RAW_KEPT`` or ``"server"``, C clients or not, security level); bound to
    ``host``, the senders on the other host, with ``--hosts``."""
    kind, c_client, level = side
    if kind != RAW and not keep_freed_memory():
        raise SystemExit(
            "the allocator setting was not made (not glibc, or GLIBC_TUNABLES / MALLOC_*_ set): "
            "the server side would not be the server's"
        )
    if kind == "server":
        return server_throughput(clients, steps, nbytes, c_client, level, host)
    return raw_throughput(clients, steps, nbytes, host)


def in_fresh_process(side: tuple[str, bool, str], clients: int, steps: int, nbytes: int) -> float:
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as process:
        return process.submit(throughput, side, clients, steps, nbytes).result()


def hosts_unavailable() -> str:
    """Why ``--hosts`` cannot run here, or "": its hosts are network namespaces, made by ``ip`` as root."""
    if os.geteuid() != 0:
        return "needs root (its hosts are network namespaces)"
    missing = [tool for tool in ("ip", "nsenter", "unshare") if shutil.which(tool) is None]
    return f"needs {', '.join(missing)} (iproute2, util-linux)" if missing else ""


def across_hosts(cluster: Cluster, side: tuple[str, bool, str], clients: int, steps: int, nbytes: int) -> float:
    """One run with the receiving side on the cluster's first host and its senders on the second: each a fresh
    process of this script (``--role``) in a session of its own, so that a failed run is killed whole."""
    receiving_host, sending_host = cluster.hosts
    started: list[subprocess.Popen[str]] = []

    def start(host: Host, role: str, request: str) -> subprocess.Popen[str]:
        command = cluster.on(host, [sys.executable, str(Path(__file__).resolve()), "--role", role])
        process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        started.append(process)
        assert process.stdin is not None
        process.stdin.write(request)
        process.stdin.flush()
        return process

    try:
        receiving = start(
            receiving_host, "receive", json.dumps([side, clients, steps, nbytes, receiving_host.address]) + "\n"
        )
        assert receiving.stdout is not None
        request = receiving.stdout.readline()  # once it is bound: what to send, where
        assert request, "the receiving side ended before asking for its senders"
        sending = start(sending_host, "send", request)
        sending.communicate(timeout=clients * TIMEOUT)
        assert sending.returncode == 0, f"the senders' side ended with {sending.returncode}"
        result, _ = receiving.communicate("ended\n", timeout=TIMEOUT)  # nothing is left unread: it waited for this
        assert receiving.returncode == 0, f"the receiving side ended with {receiving.returncode}"
        return float(result)
    except BaseException:  # Ctrl-C too: the sides run in sessions of their own, which the terminal does not reach
        for process in started:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        raise


def role(name: str) -> None:
    """A side of one ``--hosts`` run (``receive`` or ``send``), run in its host's namespace, given its work as
    one line of JSON on stdin."""
    request = json.loads(sys.stdin.readline())
    if name == "receive":
        side, clients, steps, nbytes, host = request
        print(throughput(tuple(side), clients, steps, nbytes, host), flush=True)
    else:
        kind, args_list = request
        start_senders(kind, [tuple(args) for args in args_list], remote=False).join()


def label(side: tuple[str, bool, str]) -> str:
    kind, c_client, level = side
    if kind != "server":
        return "raw pyzmq" if kind == RAW else "raw pyzmq, allocator set"
    return f"server, {'C' if c_client else 'Python'} clients, {level}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--mib", type=float, default=1.0)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--hosts", action="store_true", help="receivers on one host, senders on another (root)")
    parser.add_argument("--role", choices=["receive", "send"], help=argparse.SUPPRESS)  # a side of a --hosts run
    args = parser.parse_args()
    if args.role:
        return role(args.role)
    if args.hosts and (why := hosts_unavailable()):
        raise SystemExit(f"--hosts: {why}")
    nbytes = int(args.mib * (1 << 20))
    missing = subprocess.run(
        [str(ROOT / "scripts" / "system-packages"), "check", "native"], capture_output=True, text=True, check=True
    ).stdout.strip()
    if missing:
        print(
            f"C clients: skipped, the build needs the Debian packages {missing} "
            "(`scripts/system-packages install native` as root)"
        )
    else:
        subprocess.run(["make", "-s", "-C", str(ROOT), "native"], check=True, stdout=subprocess.DEVNULL)
    servers = [("server", c_client, level) for c_client in ((False,) if missing else (False, True)) for level in LEVELS]
    sides = [(RAW, False, ""), (RAW_KEPT, False, ""), *servers]
    runs: dict[tuple[str, bool, str], list[float]] = {side: [] for side in sides}
    with contextlib.ExitStack() as stack:  # the cluster's namespaces removed at the end, however it ends
        measure = in_fresh_process
        if args.hosts:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # `timeout`, `kill`: clean up too
            try:
                measure = functools.partial(across_hosts, stack.enter_context(Cluster(2)))
            except RuntimeError as error:  # `ip` refused: no network namespaces in this container
                raise SystemExit(f"--hosts: no cluster of hosts here: {error}") from None
        for _ in range(args.repeat):  # interleaved so that drifts of the machine hit every side
            for side in sides:
                runs[side].append(measure(side, args.clients, args.steps, nbytes))
    where = "across two hosts: " if args.hosts else ""
    print(where + "; ".join(f"{label(side)}: {[round(r / 1e6) for r in runs[side]]} MB/s" for side in sides))
    raw_mb, kept_mb = (statistics.median(runs[kind, False, ""]) / 1e6 for kind in (RAW, RAW_KEPT))
    hosts = "_hosts" if args.hosts else ""
    for side in servers:  # the names of the token lines are those of the runs before security levels
        _, c_client, level = side
        name = "ingest" + ("_c_client" if c_client else "") + ("" if level == "token" else f"_{level}")
        server_mb = statistics.median(runs[side]) / 1e6
        baselines = [("", "raw_pyzmq", raw_mb, "0.9" if level == "token" else "none")]
        if level == "token":
            baselines.append(("_same_allocator", "raw_pyzmq_allocator_set", kept_mb, "none"))
        for suffix, baseline, baseline_mb, target in baselines:
            print(
                f"RESULT {name}{suffix}{hosts} ratio={server_mb / baseline_mb:.3f} target={target} "
                f"server={server_mb:.0f}MB/s {baseline}={baseline_mb:.0f}MB/s security={level} "
                f"clients={args.clients} field={args.mib:g}MiB"
            )


if __name__ == "__main__":
    main()
