"""One complete time step of one simulation, as buffers hold it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class Sample:
    """All fields of time step ``time_step`` of simulation ``simulation_id``.

    ``nbytes`` is computed once so that byte-bounded buffers need no walk over
    the fields on every put; it is passed where it is known already (the
    windows of a batch, :func:`melissa_dl.buffers.windows.stacked`: all alike).
    """

    simulation_id: int
    time_step: int
    parameters: np.ndarray
    fields: dict[str, np.ndarray]
    nbytes: int = field(default=-1, repr=False)

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            self.nbytes = self.parameters.nbytes + sum([a.nbytes for a in self.fields.values()])

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of it."""
        return {
            "simulation_id": self.simulation_id,
            "time_step": self.time_step,
            "parameters": self.parameters,
            "fields": dict(self.fields),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Sample:
        """The sample, with arrays of its own: views of a checkpoint file would pin the whole file while one
        sample stays."""
        fields = {name: np.array(array) for name, array in state["fields"].items()}
        return cls(state["simulation_id"], state["time_step"], np.array(state["parameters"]), fields)
