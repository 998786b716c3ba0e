"""Assembling a field from blocks against from axis-0 slabs of the same bytes (issue 54, item 1).

A rank's ``Assembler`` (the server's receiver without its socket) is handed the messages of ``--steps`` steps of
one 3-D float32 field of ``--mib`` MiB from 8 client ranks, each rank's piece in parts of ``PART_BYTES`` as the
clients send it: either 8 axis-0 slabs (each gathered from its parts, then stacked with one concatenation) or a
2x2x2 decomposition in blocks (each part written straight into the global array by a few strided copies). The
two alternate, ``--repeat`` times; the median of each.

    RESULT blocks_assembly ratio=<slabs' seconds per step / blocks'> target=0.9 ...

    python bench/blocks.py [--mib 64] [--steps 8] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from melissa_dl.ingest.assembly import Assembler, StreamSpec
from melissa_dl.wire.blocks import Block
from melissa_dl.wire.protocol import PART_BYTES, Header, Kind, encode_json, parts, simulation_key

TOKEN = b"bench"
RANKS = 8


def pieces(whole: tuple[int, int, int], blocks: bool) -> list[tuple[tuple[int, ...], Block | None]]:
    """Each client rank's shape and block: a 2x2x2 decomposition, or 8 slabs along axis 0."""
    if not blocks:
        return [((whole[0] // RANKS, *whole[1:]), None)] * RANKS
    half = tuple(n // 2 for n in whole)
    return [(half, Block(tuple(((rank >> (2 - d)) & 1) * half[d] for d in range(3)), whole)) for rank in range(RANKS)]


def messages(whole: tuple[int, int, int], blocks: bool, steps: int) -> list[list[list[bytes]]]:
    """Per step, every message of the 8 client ranks (their declarations first, in step 0's list)."""
    key = simulation_key(TOKEN, 0, 0)
    payload = np.random.default_rng(0).random(int(np.prod(whole)) // RANKS).astype(np.float32).tobytes()
    declared, per_step = [], []
    for rank, (shape, block) in enumerate(pieces(whole, blocks)):
        decl = ["float32", list(shape), *([block.to_json()] if block else [])]
        body = encode_json({"fields": {"u": decl}})
        header = Header(Kind.DECLARE, key, 0, 0, 0, rank, RANKS, 0, "uint8", (), len(body))
        declared.append([header.pack(), body])
    for step in range(steps):
        frames = []
        for rank, (shape, _) in enumerate(pieces(whole, blocks)):
            for offset in parts(len(payload)):
                header = Header(Kind.DATA, key, 0, 0, step, rank, RANKS, 0, "float32", shape, len(payload), offset)
                frames.append([header.pack(), payload[offset : offset + PART_BYTES]])
        per_step.append(frames)
    per_step[0] = declared + per_step[0]
    return per_step


def seconds_per_step(whole: tuple[int, int, int], blocks: bool, steps: int) -> float:
    spec = StreamSpec(
        fields=["u"],
        parameters=np.zeros((1, 1)),
        token=TOKEN,
        server_rank=0,
        server_size=1,
        bind_simulation=True,
        reject_non_finite=False,  # the same cost in both; measured by bench/ingest.py
        max_partial_bytes=4 * int(np.prod(whole)) * 2,
    )
    assembler = Assembler(spec)
    made = messages(whole, blocks, steps)
    samples, start = 0, time.perf_counter()
    for frames in made:
        for message in frames:
            sample = assembler.handle(message)
            if sample is not None:
                assert sample.fields["u"].shape == whole
                assembler.commit(sample)
                samples += 1
    took = time.perf_counter() - start
    assert samples == steps
    return took / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    side = round((args.mib * (1 << 20) // 4) ** (1 / 3))  # 256 for 64 MiB
    whole = (side, side, side)
    slabs, blocks = [], []
    for _ in range(args.repeat):
        slabs.append(seconds_per_step(whole, False, args.steps))
        blocks.append(seconds_per_step(whole, True, args.steps))
    slab, block = statistics.median(slabs), statistics.median(blocks)
    mib = 4 * side**3 / (1 << 20)
    print(
        f"RESULT blocks_assembly ratio={slab / block:.3f} target=0.9 slabs_ms={1e3 * slab:.1f} "
        f"blocks_ms={1e3 * block:.1f} field={side}x{side}x{side} float32 ({mib:.0f} MiB) ranks={RANKS} "
        f"steps={args.steps} repeat={args.repeat}"
    )


if __name__ == "__main__":
    main()
