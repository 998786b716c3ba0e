"""One complete time step of one simulation, as buffers hold it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class Sample:
    """All fields of time step ``time_step`` of simulation ``simulation_id``.

    ``nbytes`` is computed once so that byte-bounded buffers need no walk over
    the fields on every put.
    """

    simulation_id: int
    time_step: int
    parameters: np.ndarray
    fields: dict[str, np.ndarray]
    nbytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.nbytes = int(self.parameters.nbytes) + sum(int(a.nbytes) for a in self.fields.values())
