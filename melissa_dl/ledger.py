"""Which time steps of which simulations a rank has received.

A study of 10,000 simulations of 1,000 steps would hold ten million Python
ints in sets (hundreds of MB); one bitmap per simulation holds the same in
1.25 MB and answers "seen before?" in O(1), which is what dropping duplicated
steps of relaunched simulations needs.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np


class Ledger:
    """Per-simulation bitmaps of received time steps."""

    def __init__(self) -> None:
        self._bits: dict[int, bytearray] = {}
        self._counts: dict[int, int] = {}

    def add(self, simulation_id: int, time_step: int) -> bool:
        """Record a step; False if it was already there."""
        bits = self._bits.setdefault(simulation_id, bytearray())
        byte, mask = divmod(time_step, 8)
        if byte >= len(bits):
            bits.extend(bytes(max(byte + 1 - len(bits), len(bits))))
        if bits[byte] >> mask & 1:
            return False
        bits[byte] |= 1 << mask
        self._counts[simulation_id] = self._counts.get(simulation_id, 0) + 1
        return True

    def __contains__(self, key: tuple[int, int]) -> bool:
        simulation_id, time_step = key
        bits = self._bits.get(simulation_id)
        byte, mask = divmod(time_step, 8)
        return bits is not None and byte < len(bits) and bool(bits[byte] >> mask & 1)

    def count(self, simulation_id: int) -> int:
        return self._counts.get(simulation_id, 0)

    def total(self) -> int:
        return sum(self._counts.values())

    def steps(self, simulation_id: int) -> list[int]:
        bits = self._bits.get(simulation_id, bytearray())
        return [8 * i + j for i, b in enumerate(bits) if b for j in range(8) if b >> j & 1]

    def simulations(self) -> list[int]:
        return sorted(self._counts)

    def state_dict(self) -> dict[int, bytes]:
        return {s: bytes(b) for s, b in self._bits.items()}

    def load_state_dict(self, state: dict[int, bytes]) -> None:
        self._bits = {s: bytearray(b) for s, b in state.items()}
        self._counts = {s: sum(bin(x).count("1") for x in b) for s, b in self._bits.items()}

    def merge(self, state: dict[int, bytes], keep: Callable[[int, np.ndarray], np.ndarray]) -> None:
        """Add the steps of another ledger's ``state_dict`` for which ``keep(simulation, steps)`` is true.

        A restart on another number of ranks rebuilds each rank's ledger this way
        from all the old ones, keeping the steps that the new routing sends it.
        """
        for simulation_id, bits in state.items():
            steps = np.flatnonzero(np.unpackbits(np.frombuffer(bits, dtype=np.uint8), bitorder="little"))
            steps = steps[np.broadcast_to(keep(simulation_id, steps), steps.shape)]
            if steps.size == 0:
                continue
            mine = np.frombuffer(bytes(self._bits.get(simulation_id, b"")), dtype=np.uint8)
            wanted = np.zeros(max(len(bits), len(mine)) * 8, dtype=bool)
            wanted[steps] = True
            merged = np.packbits(wanted, bitorder="little")
            merged[: len(mine)] |= mine
            self._bits[simulation_id] = bytearray(merged.tobytes())
            self._counts[simulation_id] = int(np.unpackbits(merged).sum())
