"""A user's sampler for the integration tests (``study.sampler: custom``): evenly spaced points on the diagonal of
the parameter box, in simulation order."""

from __future__ import annotations

import numpy as np

from launcher import Sampler


class Diagonal(Sampler):
    def _draw(self, count: int) -> np.ndarray:
        where = (np.arange(self.drawn, self.drawn + count) + 0.5) / self.simulations
        return self._scaled(where[:, None] * np.ones(self.low.size))
