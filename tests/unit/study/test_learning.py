"""Per-sample losses: each rank's log, and rank 0's statistic per simulation from each step's first loss."""

from __future__ import annotations

import numpy as np
import pytest

from melissa_dl.study.learning import LossLog, SimulationLosses

pytestmark = pytest.mark.timeout(60)


def records(*rows: tuple[int, int, float]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([r[:2] for r in rows], dtype=np.int64), np.array([r[2] for r in rows])


def test_a_log_gives_what_was_recorded_since_the_last_take_in_order_and_survives_a_checkpoint() -> None:
    log = LossLog()
    assert log.take() is None
    log.record(*records((0, 1, 0.5), (2, 0, 1.5)))
    log.record(*records((0, 1, 0.1)))
    state = log.state_dict()  # a snapshot: the next round still sends them
    restored = LossLog()
    restored.load_state_dict(state)
    for each in (log, restored):
        ids, losses = each.take()  # type: ignore[misc]
        assert ids.tolist() == [[0, 1], [2, 0], [0, 1]] and losses.tolist() == [0.5, 1.5, 0.1]
        assert each.take() is None


@pytest.mark.parametrize(("statistic", "expected"), [("mean", 2.5), ("max", 4.0), ("q50", 2.5), ("q90", 3.7)])
def test_the_statistic_reduces_each_steps_first_loss(statistic: str, expected: float) -> None:
    losses = SimulationLosses(statistic)
    losses.add(records((7, 0, 1.0), (7, 1, 2.0), (7, 0, 99.0)))  # step 0 trained again: its first loss counts
    losses.add(records((7, 2, 3.0), (7, 3, 4.0), (8, 0, 5.0)))
    assert losses.seen(7) == 4 and losses.seen(8) == 1 and losses.seen(9) == 0
    assert losses.reduce(7) == pytest.approx(expected)
    losses.add(records((7, 4, 100.0)))  # after the statistic: ignored
    assert losses.final == {7: pytest.approx(expected)} and losses.seen(7) == 0


def test_a_failed_simulation_has_no_statistic_and_the_state_round_trips() -> None:
    losses = SimulationLosses("max")
    losses.add(records((1, 0, 2.0), (2, 0, 3.0)))
    losses.forget(1)
    assert losses.reduce(3) is None  # nothing seen
    restored = SimulationLosses("max")
    restored.load_state_dict(losses.state_dict())
    assert restored.final == {1: None, 3: None} and restored.seen(2) == 1 and restored.reduce(2) == 3.0
