"""What training learns of each simulation: per-sample losses, and a statistic per simulation for the sampler.

Each rank's trainer records the loss of every sample it trains, with the
sample's ``(simulation, step)`` (:class:`LossLog`); the bookkeeping round
carries the records to rank 0, whose :class:`SimulationLosses` keeps, for each
step, the loss it had the *first* time it was trained (how surprising it was
before the model learnt from it), and once a simulation is done and every one
of its steps has its loss, reduces them to the study's ``loss_statistic``:
their mean (the default), their maximum, or a quantile. A step lives on one
rank only, and that rank's records arrive in the order it trained them, so
"first" needs no agreement between ranks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Records = tuple[np.ndarray, np.ndarray]  # ids [n, 2] (simulation, step) int64, losses [n] float64


class LossLog:
    """One rank's per-sample losses since rank 0 last took them."""

    def __init__(self) -> None:
        self._ids: list[np.ndarray] = []
        self._losses: list[np.ndarray] = []

    def record(self, ids: np.ndarray, losses: np.ndarray) -> None:
        self._ids.append(np.asarray(ids, dtype=np.int64).reshape(-1, 2))
        self._losses.append(np.asarray(losses, dtype=np.float64).reshape(-1))

    def take(self) -> Records | None:
        """Everything recorded since the last take, in training order; None if nothing."""
        records = self._joined()
        self._ids, self._losses = [], []
        return records

    def _joined(self) -> Records | None:
        return (np.concatenate(self._ids), np.concatenate(self._losses)) if self._ids else None

    def state_dict(self) -> dict[str, Any]:
        return {"records": self._joined()}  # not taken: the next round still sends them

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ids, self._losses = [], []
        if state["records"] is not None:
            self.record(*state["records"])


class SimulationLosses:
    """Rank 0: each step's first loss, per simulation, until the simulation's statistic is known."""

    def __init__(self, statistic: str = "mean") -> None:
        self.statistic = statistic
        self._steps: dict[int, dict[int, float]] = {}  # simulation -> step -> first loss
        self.final: dict[int, float | None] = {}  # simulation -> its statistic, once reduced

    def add(self, records: Records) -> None:
        ids, losses = records
        for (simulation, step), loss in zip(ids.tolist(), losses.tolist()):
            if simulation not in self.final:
                self._steps.setdefault(simulation, {}).setdefault(step, loss)

    def seen(self, simulation: int) -> int:
        """Steps of ``simulation`` with a loss so far."""
        return len(self._steps.get(simulation, ()))

    def reduce(self, simulation: int) -> float | None:
        """The statistic of the steps seen (None if none), from now on the simulation's."""
        values = np.fromiter(self._steps.pop(simulation, {}).values(), dtype=np.float64)
        value: float | None = None
        if values.size:
            if self.statistic == "mean":
                value = float(values.mean())
            elif self.statistic == "max":
                value = float(values.max())
            else:  # qNN
                value = float(np.quantile(values, int(self.statistic[1:]) / 100))
        self.final[simulation] = value
        return value

    def forget(self, simulation: int) -> None:
        """A simulation that failed: no statistic, its losses dropped."""
        self._steps.pop(simulation, None)
        self.final[simulation] = None

    def state_dict(self) -> dict[str, Any]:
        return {"steps": {s: dict(steps) for s, steps in self._steps.items()}, "final": dict(self.final)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._steps = {s: dict(steps) for s, steps in state["steps"].items()}
        self.final = dict(state["final"])
