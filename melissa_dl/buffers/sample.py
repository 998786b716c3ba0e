"""One complete time step of one simulation, as buffers hold it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class Sample:
    """All fields of time step ``time_step`` of simulation ``simulation_id``: what ``TrainingModule.process`` gets
    (and ``plot``, ``advance``, ``rollout``), and what ``validation_samples`` returns.

    The server assembles it once every client rank's part of the step has arrived: each field is whole. With
    ``training.window`` a sample is a window of consecutive steps of one simulation: each field holds them stacked
    along a leading time axis, ``[inputs + targets, ...]``.

    ```python
    def process(self, sample):
        x = torch.tensor([*sample.parameters, sample.time_step], dtype=torch.float32)
        return x, torch.from_numpy(sample.fields["temperature"]).flatten()
    ```
    """

    simulation_id: int
    """The simulation's index in the study, as its client's ``simulation_id``."""
    time_step: int
    """The step's index, as the simulation sent it; with ``training.window``, the window's first step."""
    parameters: np.ndarray
    """The simulation's parameter set, float64, in the order of ``study.parameters``."""
    fields: dict[str, np.ndarray]
    """Each field of ``study.fields`` at that step, by name: the whole field (the slices of the client ranks stacked,
    or their blocks placed), in the study's dtype and shape (with ``training.window``, after the time axis)."""
    nbytes: int = field(default=-1, repr=False)
    """The bytes of ``parameters`` and ``fields``, computed once so that byte-bounded buffers need no walk over the
    fields on every put (-1, the default: computed from them); passed where it is known already (the windows of a
    batch, ``melissa_dl.buffers.windows.stacked``: all alike)."""

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
