"""The compiled loop of ``finite``: imported only by ``finite.compiled_loop()``, so that numba loads only in a
process that checks a large field."""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def largest_magnitude(bits: np.ndarray, magnitude: np.unsignedinteger) -> np.unsignedinteger:
    """The largest of ``bits & magnitude``."""
    largest = magnitude - magnitude  # a zero of the bits' type: a Python 0 would widen the loop and end its SIMD
    for i in range(bits.shape[0]):
        value = bits[i] & magnitude
        if value > largest:
            largest = value
    return largest
