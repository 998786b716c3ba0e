"""What the size of a message part costs the receiving of 1 MiB slices (the choice of ``PART_BYTES``, issue 32).

Every server socket caps a message part, and libzmq applies that cap to a
peer's login as to its data: the smaller the part, the less a peer without
credentials can make a rank hold, and the more messages and copies a slice
costs. ``--clients`` processes each send ``--steps`` slices of 1 MiB over
ZeroMQ PLAIN to one PULL socket in this process, either whole (two frames,
header and payload, viewed without a copy, as the server does for a slice of
at most ``PART_BYTES``) or in parts of ``--part`` bytes (one message per
part, each copied into the slice's array at its offset, as the server joins a
larger slice). The median of ``--repeat`` runs of each; prints, per part size,

    RESULT parts_<KiB>k ratio=<in parts / whole> target=none ...

No target: the figure says what a smaller cap would cost the ingest.

    python bench/parts.py [--clients 8] [--steps 300] [--repeat 3] [--part 262144 65536]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import struct
import time

import numpy as np
import zmq
from zmq.auth.thread import ThreadAuthenticator

MIB = 1 << 20
HEADER = struct.Struct("<QQ")  # slice number, offset


def send(port: int, part: int, steps: int) -> None:
    context = zmq.Context()
    socket = context.socket(zmq.PUSH)
    socket.plain_username, socket.plain_password = b"bench", b"secret"
    socket.connect(f"tcp://127.0.0.1:{port}")
    data = memoryview(np.random.default_rng(0).random(MIB // 8)).cast("B")
    for step in range(steps):
        for offset in range(0, MIB, part):
            socket.send_multipart([HEADER.pack(step, offset), data[offset : offset + part]], copy=False)
    socket.close(linger=-1)
    context.term()


def receive(part: int, clients: int, steps: int) -> float:
    """MB/s from the first message to the last, with ``part`` bytes a message (MIB: whole slices, viewed)."""
    context = zmq.Context()
    authenticator = ThreadAuthenticator(context)
    authenticator.start()
    authenticator.configure_plain(domain="*", passwords={"bench": "secret"})
    socket = context.socket(zmq.PULL)
    socket.plain_server = True
    socket.maxmsgsize = part + 256
    port = socket.bind_to_random_port("tcp://127.0.0.1")
    senders = [mp.Process(target=send, args=(port, part, steps)) for _ in range(clients)]
    for process in senders:
        process.start()
    received, kept, slices, start = 0, [], {}, None
    while received < clients * steps * MIB:
        if part == MIB:
            frames = socket.recv_multipart(copy=False)
            start = start or time.perf_counter()
            kept.append(np.frombuffer(frames[1].buffer, np.uint8))
            received += MIB
        else:
            number, offset = HEADER.unpack(socket.recv())
            start = start or time.perf_counter()
            array = slices.setdefault(number, np.empty(MIB, np.uint8))
            received += socket.recv_into(memoryview(array)[offset : offset + part])
            if offset + part >= MIB:
                kept.append(slices.pop(number))
        del kept[:-128]  # a buffer that lets go of old samples
    seconds = time.perf_counter() - (start or 0.0)
    for process in senders:
        process.join()
    authenticator.stop()
    socket.close()
    context.term()
    return received / seconds / 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--part", type=int, nargs="+", default=[256 << 10, 64 << 10])
    args = parser.parse_args()
    sizes = [MIB, *args.part]
    runs: dict[int, list[float]] = {size: [] for size in sizes}
    for _ in range(args.repeat):  # interleaved, so that a change of the machine's speed falls on every size
        for size in sizes:
            runs[size].append(receive(size, args.clients, args.steps))
    whole = statistics.median(runs[MIB])
    for size in args.part:
        median = statistics.median(runs[size])
        print(
            f"RESULT parts_{size >> 10}k ratio={median / whole:.3f} target=none in_parts={median:.0f}MB/s "
            f"whole={whole:.0f}MB/s runs={[round(r) for r in runs[size]]} whole_runs={[round(r) for r in runs[MIB]]}"
        )


if __name__ == "__main__":
    main()
