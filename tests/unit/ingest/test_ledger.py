"""The per-simulation bitmaps of received time steps."""

from __future__ import annotations

import random

import numpy as np
import pytest

from melissa_dl.ingest.ledger import Ledger

pytestmark = pytest.mark.timeout(60)


def filled(steps: dict[int, list[int]]) -> Ledger:
    ledger = Ledger()
    for sim, sim_steps in steps.items():
        for step in sim_steps:
            ledger.add(sim, step)
    return ledger


def test_add_records_a_step_once() -> None:
    ledger = Ledger()
    assert (3, 5) not in ledger
    assert ledger.add(3, 5) is True
    assert ledger.add(3, 5) is False
    assert (3, 5) in ledger
    assert ledger.count(3) == 1
    assert (3, 4) not in ledger and (3, 6) not in ledger and (2, 5) not in ledger and (4, 5) not in ledger


@pytest.mark.parametrize("step", [0, 7, 8, 9, 15, 16, 1023, 10**6, 10**6 + 7])
def test_steps_around_byte_boundaries_and_large_steps(step: int) -> None:
    ledger = filled({0: [3]})
    assert ledger.add(0, step) is (step != 3)
    assert (0, step) in ledger
    assert (0, step + 1) not in ledger
    assert ledger.steps(0) == sorted({3, step})


def test_counts_total_and_simulations() -> None:
    ledger = filled({4: [0, 1, 2, 1], 1: [9], 7: [10**6]})
    assert [ledger.count(s) for s in (1, 4, 7, 0)] == [1, 3, 1, 0]
    assert ledger.total() == 5
    assert ledger.simulations() == [1, 4, 7]


def test_steps_are_sorted_whatever_the_arrival_order() -> None:
    rng = random.Random(1234)
    steps = rng.sample(range(5000), 600)
    ledger = filled({2: steps + steps[:50]})  # and some duplicates
    assert ledger.steps(2) == sorted(steps)
    assert ledger.count(2) == 600
    assert ledger.steps(99) == []


def test_state_dict_round_trip_restores_everything() -> None:
    rng = random.Random(99)
    original = filled({s: rng.sample(range(3000), 40 * (s + 1)) for s in range(4)} | {9: [10**6]})
    state = original.state_dict()
    assert all(isinstance(k, int) and isinstance(v, bytes) for k, v in state.items())
    original.add(0, 4000)  # the snapshot does not follow later changes
    restored = Ledger()
    restored.load_state_dict(state)
    assert restored.simulations() == [0, 1, 2, 3, 9]
    assert [restored.count(s) for s in (0, 1, 2, 3, 9)] == [40, 80, 120, 160, 1]
    assert restored.total() == 401
    assert restored.steps(2) == original.steps(2)
    assert (0, 4000) not in restored
    assert restored.add(9, 10**6) is False
    assert restored.add(0, 4000) is True
    assert restored.count(0) == 41 and restored.total() == 402


def test_load_state_dict_replaces_the_previous_state() -> None:
    ledger = filled({1: [1, 2]})
    ledger.load_state_dict(filled({5: [0]}).state_dict())
    assert ledger.simulations() == [5]
    assert (1, 1) not in ledger and ledger.count(1) == 0 and ledger.total() == 1


def test_merge_keeps_the_selected_steps_of_other_ledgers() -> None:
    first, second = filled({0: [0, 1, 9], 3: [4]}), filled({0: [2, 17], 5: [1]})
    merged = filled({0: [1]})
    for other in (first, second):
        merged.merge(other.state_dict(), lambda sim, steps: (sim + steps) % 2 == 1)
    assert merged.steps(0) == [1, 9, 17] and merged.count(0) == 3
    assert merged.steps(3) == [4] and merged.simulations() == [0, 3]  # (5 + 1) % 2 == 0: not kept
    everything = Ledger()
    everything.merge(first.state_dict(), lambda sim, steps: True)
    assert everything.state_dict() == first.state_dict() and everything.total() == first.total()


def test_memory_is_proportional_to_the_steps_received_not_the_largest_step() -> None:
    ledger = filled({0: [(1 << 32) - 1], 1: [0, 1, 2]})
    assert ledger.nbytes() <= 2 * 512  # one chunk each, not a bitmap up to step 2**32 - 1 (512 MiB)
    assert ((0, (1 << 32) - 1)) in ledger and ledger.steps(0) == [(1 << 32) - 1]
    assert len(ledger.state_dict()[0]) == 4  # one uint32 per step


def test_a_short_simulation_costs_a_byte_of_bitmap_restored_or_not() -> None:
    """10,000 simulations of 5 steps held 512 bytes of bitmap each on every rank (issue 31)."""
    ledger = Ledger()
    for t in (4, 0, 2):
        ledger.add(7, t)
    ledger.add(8, 4095)  # the last step of a chunk: the whole chunk
    assert ledger.nbytes() == 1 + 512
    restored = Ledger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.nbytes() == 1 + 512 and restored.steps(7) == [0, 2, 4] and restored.total() == 4
    for t in range(8, 20):  # growing past its first byte
        restored.add(7, t)
    assert restored.steps(7) == [0, 2, 4, *range(8, 20)] and (7, 5) not in restored and (7, 30) not in restored
    assert restored.total() == 16 and restored.nbytes() == 4 + 512


def test_restoring_a_large_ledger_is_vectorised() -> None:
    """The old restore counted bits byte by byte in Python (~90 s for one step 2**32 - 1): the timeout would fire."""
    steps = np.arange(0, 2_000_000, 2, dtype=np.uint32)  # a rank's share of a long simulation
    state = {7: steps.tobytes(), 8: np.array([(1 << 32) - 1], dtype=np.uint32).tobytes()}
    ledger = Ledger()
    ledger.load_state_dict(state)
    assert ledger.count(7) == 1_000_000 and ledger.count(8) == 1
    assert (7, 1_999_998) in ledger and (7, 1_999_999) not in ledger
