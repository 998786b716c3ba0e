"""Parameter tables for the simulations of a study.

Every server rank draws with the same arguments and must get the same
table, so every sampler is a pure function of its seed. The arguments come
from a checked configuration (``study`` section), which reads ``SAMPLERS``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SAMPLERS = ("uniform", "sobol", "list")


def draw_parameters(
    sampler: str,
    count: int,
    low: Sequence[float],
    high: Sequence[float],
    seed: int,
    values: Sequence[Sequence[float]] | None = None,
) -> np.ndarray:
    """Return the float64 ``[count, d]`` parameters of ``count`` simulations.

    ``d = len(low)``. "uniform" draws i.i.d. in ``[low, high)``; "sobol" draws
    a scrambled Sobol' sequence, which covers the box far more evenly than
    random points for small ``count``; "list" returns ``values`` as given.
    """
    lo = np.asarray(low, dtype=np.float64)
    hi = np.asarray(high, dtype=np.float64)
    if sampler == "list":
        return np.array(values, dtype=np.float64)
    if sampler == "uniform":
        return np.random.default_rng(seed).uniform(lo, hi, size=(count, lo.size))
    import torch  # here: the supervisor imports this package and should not pay for torch

    engine = torch.quasirandom.SobolEngine(lo.size, scramble=True, seed=seed)
    unit = engine.draw(count, dtype=torch.float64).numpy()
    return lo + (hi - lo) * unit
