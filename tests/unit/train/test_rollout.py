"""Rollout validation: the default rollout feeds the module's predictions back, errors per horizon."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from melissa_dl.buffers.sample import Sample
from melissa_dl.train.module import TrainingModule
from melissa_dl.train.rollout import at_horizons, rollout_errors, trajectories


class Doubling(TrainingModule):
    """Predicts ``targets`` steps, each twice the last one it has seen; records the windows it was given."""

    def __init__(self, targets: int = 1) -> None:
        super().__init__()
        self.targets = targets
        self.given: list[list[float]] = []

    def configure_optimizer(self) -> torch.optim.Optimizer:
        raise NotImplementedError

    def process(self, sample: Sample) -> Any:
        raise NotImplementedError

    def training_step(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def advance(self, window: Sample) -> dict[str, Any]:
        self.given.append(window.fields["u"][:, 0].tolist())
        last = window.fields["u"][-1]
        steps = [last * 2 ** (i + 1) for i in range(self.targets)]
        return {"u": torch.from_numpy(np.stack(steps))}


def trajectory(values: list[float], sim: int = 0) -> Sample:
    return Sample(sim, 0, np.zeros(1), {"u": np.array(values)[:, None] * np.ones((1, 3))})


def test_the_default_rollout_feeds_the_predictions_back_and_keeps_the_steps_asked() -> None:
    module = Doubling(targets=2)
    first = trajectory([1.0, 2.0])
    predicted = module.rollout(first, 5)
    assert predicted["u"][:, 0].tolist() == [4.0, 8.0, 16.0, 32.0, 64.0]
    assert module.given == [[1.0, 2.0], [4.0, 8.0], [16.0, 32.0]]  # the last 2 steps, its own after the first
    assert module.rolls_out()


class Still(Doubling):
    advance = TrainingModule.advance  # type: ignore[assignment]


def test_a_module_without_advance_or_rollout_is_not_rolled_out() -> None:
    assert not Still().rolls_out()


def test_a_rollout_that_calls_an_undefined_advance_is_told_which_and_how_to_mend_it() -> None:
    with pytest.raises(
        TypeError, match=r"^Still\.advance\(window\) is called \(by its rollout\) but not defined: define"
    ):
        Still().rollout(trajectory([1.0, 2.0]), 3)


def test_rollout_errors_are_relative_per_step_and_taken_at_the_horizons() -> None:
    truth = trajectory([1.0, 2.0, 4.0, 8.0, 20.0])  # the model's doubling is right up to 8, then 16 for 20
    errors = rollout_errors(Doubling(), truth, inputs=2)
    assert errors.tolist() == pytest.approx([0.0, 0.0, 4.0 / 20.0])
    sums = at_horizons(errors)
    np.testing.assert_allclose(sums, [[0.0, 1.0], [0.0, 0.0], [0.2, 1.0]])  # no horizon 10 in 3 steps
    long = at_horizons(np.arange(12.0))
    assert long.tolist() == [[0.0, 1.0], [9.0, 1.0], [11.0, 1.0]]


def test_trajectories_are_each_simulations_consecutive_steps_from_its_first() -> None:
    steps = [Sample(1, t, np.zeros(1), {"u": np.full(2, float(t))}) for t in (3, 4, 5, 7, 4)]
    steps += [Sample(2, t, np.zeros(1), {"u": np.full(2, float(t))}) for t in (0, 1)]
    found = trajectories(steps, inputs=2)
    assert [(t.simulation_id, t.time_step) for t in found] == [(1, 3)]  # simulation 2 has nothing to predict
    assert found[0].fields["u"][:, 0].tolist() == [3.0, 4.0, 5.0]  # up to the first gap


class Broken(Doubling):
    def __init__(self, answer: dict[str, Any]) -> None:
        super().__init__()
        self.answer = answer

    def advance(self, window: Sample) -> dict[str, Any]:
        return self.answer


@pytest.mark.parametrize(
    "answer, message",
    [
        ({"u": np.zeros((0, 3))}, "Broken.advance predicted no step of 'u'"),
        ({"v": np.zeros((1, 3))}, "Broken.advance returned ['v'], not every field ['u']"),
    ],
)
def test_an_advance_that_predicts_nothing_or_not_every_field_is_an_error_not_a_hang(
    answer: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError) as info:
        Broken(answer).rollout(trajectory([1.0, 2.0]), 3)
    assert str(info.value) == message
