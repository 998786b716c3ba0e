"""Which time steps of which simulations a rank has received.

A study of 10,000 simulations of 1,000 steps would hold ten million Python
ints in sets (hundreds of MB). Each simulation instead keeps bitmaps of
``CHUNK_STEPS`` steps, allocated only for the chunks its steps fall in and
only up to the highest step seen in each (so a simulation of 5 steps costs a
byte of bitmap, not 512): dense studies cost one bit per step, and a peer
that sends step 2**32-1 costs one chunk (512 bytes), not a bitmap up to that
step. The first chunk of every simulation, where all steps of most studies
fall, sits in one flat map (a nested map per simulation cost each rank 230
more bytes a simulation). "Seen before?" is O(1), which is what dropping
duplicated steps of relaunched simulations needs, and so is the total, which
every bookkeeping round reports.

The saved state is each simulation's sorted steps as little-endian uint32
(steps are 32-bit on the wire), so saving and restoring take time and space
proportional to the steps received.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

CHUNK_STEPS = 4096
_STEP = np.dtype("<u4")


class Ledger:
    """Per-simulation chunked bitmaps of received time steps."""

    def __init__(self) -> None:
        self._first: dict[int, bytearray] = {}  # simulation -> bitmap of steps 0 .. CHUNK_STEPS - 1
        self._later: dict[int, dict[int, bytearray]] = {}  # simulation -> chunk index (1 and on) -> bitmap
        self._counts: dict[int, int] = {}
        self._last: dict[int, int] = {}  # simulation -> its highest step
        self._total = 0

    def add(self, simulation_id: int, time_step: int) -> bool:
        """Record a step; False if it was already there."""
        chunk, bit = divmod(time_step, CHUNK_STEPS)
        byte, mask = divmod(bit, 8)
        bits = self._bits(simulation_id, chunk)
        if bits is None:
            bits = self._keep(simulation_id, chunk, bytearray(byte + 1))
        elif len(bits) <= byte:  # grown by doubling: a simulation's steps mostly come in order
            bits.extend(bytes(max(byte + 1, min(2 * len(bits), CHUNK_STEPS // 8)) - len(bits)))
        if bits[byte] >> mask & 1:
            return False
        bits[byte] |= 1 << mask
        self._counts[simulation_id] = self._counts.get(simulation_id, 0) + 1
        if time_step > self._last.get(simulation_id, -1):
            self._last[simulation_id] = time_step
        self._total += 1
        return True

    def __contains__(self, key: tuple[int, int]) -> bool:
        simulation_id, time_step = key
        chunk, bit = divmod(time_step, CHUNK_STEPS)
        bits = self._bits(simulation_id, chunk)
        return bits is not None and bit >> 3 < len(bits) and bool(bits[bit >> 3] >> (bit & 7) & 1)

    def count(self, simulation_id: int) -> int:
        return self._counts.get(simulation_id, 0)

    def total(self) -> int:
        return self._total

    def last(self, simulation_id: int) -> int | None:
        """The simulation's highest step recorded (None: none)."""
        return self._last.get(simulation_id)

    def steps(self, simulation_id: int) -> list[int]:
        return self._step_array(simulation_id).tolist()

    def simulations(self) -> list[int]:
        return sorted(self._counts)

    def nbytes(self) -> int:
        """Memory held by the bitmaps: what a peer's frames can make this rank allocate."""
        return sum(map(len, self._first.values())) + sum(
            len(bits) for chunks in self._later.values() for bits in chunks.values()
        )

    def state_dict(self) -> dict[int, bytes]:
        return {s: self._step_array(s).astype(_STEP).tobytes() for s in self._counts}

    def load_state_dict(self, state: dict[int, bytes]) -> None:
        self._first, self._later, self._counts, self._last, self._total = {}, {}, {}, {}, 0
        for simulation_id, steps in state.items():
            self._add_steps(simulation_id, np.frombuffer(steps, dtype=_STEP))

    def merge(self, state: dict[int, bytes], keep: Callable[[int, np.ndarray], Any]) -> None:
        """Add the steps of another ledger's ``state_dict`` for which ``keep(simulation, steps)`` is true.

        A restart on another number of ranks rebuilds each rank's ledger this way
        from all the old ones, keeping the steps that the new routing sends it.
        """
        for simulation_id, data in state.items():
            steps = np.frombuffer(data, dtype=_STEP).astype(np.int64)
            self._add_steps(simulation_id, steps[np.broadcast_to(keep(simulation_id, steps), steps.shape)])

    def _bits(self, simulation_id: int, chunk: int) -> bytearray | None:
        if chunk == 0:
            return self._first.get(simulation_id)
        return self._later.get(simulation_id, {}).get(chunk)

    def _keep(self, simulation_id: int, chunk: int, bits: bytearray) -> bytearray:
        if chunk == 0:
            self._first[simulation_id] = bits
        else:
            self._later.setdefault(simulation_id, {})[chunk] = bits
        return bits

    def _chunks(self, simulation_id: int) -> dict[int, bytearray]:
        first = self._first.get(simulation_id)
        return {**({0: first} if first is not None else {}), **self._later.get(simulation_id, {})}

    def _step_array(self, simulation_id: int) -> np.ndarray:
        chunks = self._chunks(simulation_id)
        parts = [
            np.flatnonzero(np.unpackbits(np.frombuffer(chunks[c], dtype=np.uint8), bitorder="little")) + c * CHUNK_STEPS
            for c in sorted(chunks)
        ]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _add_steps(self, simulation_id: int, steps: np.ndarray) -> None:
        """Many steps at once, chunk by chunk (restores and merges)."""
        if steps.size == 0:
            return
        steps = np.unique(steps.astype(np.int64))
        for part in np.split(steps, np.flatnonzero(np.diff(steps // CHUNK_STEPS)) + 1):
            chunk = int(part[0]) // CHUNK_STEPS
            wanted = np.zeros(CHUNK_STEPS, dtype=bool)
            wanted[part - chunk * CHUNK_STEPS] = True
            merged = np.packbits(wanted, bitorder="little")
            old = self._bits(simulation_id, chunk)
            if old is not None:
                merged[: len(old)] |= np.frombuffer(old, dtype=np.uint8)
            self._keep(simulation_id, chunk, bytearray(merged[: int(np.flatnonzero(merged)[-1]) + 1].tobytes()))
        self._last[simulation_id] = max(self._last.get(simulation_id, -1), int(steps[-1]))
        count = sum(int.from_bytes(b, "little").bit_count() for b in self._chunks(simulation_id).values())
        self._total += count - self._counts.get(simulation_id, 0)
        self._counts[simulation_id] = count
