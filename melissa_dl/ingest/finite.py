"""Whether a received field holds NaN or infinity, found in one read of it.

The receiver thread checks every floating-point field of every step. A float
is NaN or infinite exactly when its exponent bits are all ones, that is when
its bits without the sign, read as an unsigned integer, are at least those of
infinity: so the largest of them says it for the whole field. A compiled loop
of integer maxima reads the field once and writes nothing; on a 1 MiB float32
field just received it takes 29 us where ``np.isfinite(a).all()``, which
writes a mask and reads it again, takes 41-44 (8.7 against 17.5 in cache). It
runs on the calling thread only (a BLAS reduction would start the BLAS
library's threads beside training's). Fields under ``COMPILED_FROM`` bytes,
and any where numba cannot compile the loop, get numpy's check, as fast on
small fields. The loop is compiled (0.3-0.5 s idle, once per rank) at the
first declaration of a field that will take it, so that a study of small
fields never loads numba, and in a thread of its own: numpy checks the fields
until it is ready. Compiled in the receiver's thread, it held the receiver's
lock, which the rank's delivery service also takes, so no client heard from
the rank meanwhile; on a loaded machine that lasted longer than a 5-second
``client_timeout``, and a blocked client gave up on a live server.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


def _bits(dtype: type[np.floating], uint: type[np.unsignedinteger]) -> tuple[type[np.unsignedinteger], int, int]:
    """The unsigned type of ``dtype``'s bits, the mask of all but its sign, and the bits of infinity."""
    return uint, int(~np.array(-0.0, dtype).view(uint)), int(np.array(np.inf, dtype).view(uint))


COMPILED_FROM = 1 << 16  # bytes of a field from which the compiled loop checks it

_BITS = {
    np.dtype(dtype): _bits(dtype, uint)
    for dtype, uint in ((np.float16, np.uint16), (np.float32, np.uint32), (np.float64, np.uint64))
}


@functools.cache
def compiled_loop() -> Callable[[np.ndarray, Any], Any] | None:
    """The loop, compiled (or read from numba's cache) and run once for every dtype; None where numba fails."""
    try:
        from melissa_dl.ingest.finite_loop import largest_magnitude

        for uint, magnitude, _ in _BITS.values():
            largest_magnitude(np.zeros(1, uint), uint(magnitude))
    except Exception:  # a damaged cache file, an unwritable cache folder: numpy's check still works
        logger.warning("numba cannot compile the non-finite check; numpy's runs instead", exc_info=True)
        return None
    return largest_magnitude


_compiling = threading.Lock()
_compiler: threading.Thread | None = None  # the thread that compiles the loop, once started


def prepare(dtype: str, shape: tuple[int, ...]) -> None:
    """Start compiling the loop if fields of this declared layout (a simulation's declaration) will take it."""
    if np.dtype(dtype) in _BITS and np.dtype(dtype).itemsize * math.prod(shape) >= COMPILED_FROM:
        ready_loop()


def ready_loop() -> Callable[[np.ndarray, Any], Any] | None:
    """The compiled loop once its thread compiled it; None until then (the compile started if it was not) and
    where numba fails."""
    global _compiler
    if _compiler is None:  # the lock only until the compile is under way, not for every field after
        with _compiling:
            if _compiler is None:
                _compiler = threading.Thread(target=compiled_loop, name="finite-compile", daemon=True)
                _compiler.start()
    return None if _compiler.is_alive() else compiled_loop()


def all_finite(array: np.ndarray) -> bool:
    """Whether no value of ``array`` (any shape, any dtype) is NaN or infinite."""
    found = _BITS.get(array.dtype)
    if found is None or array.nbytes < COMPILED_FROM or (loop := ready_loop()) is None:
        return bool(np.isfinite(array).all())
    uint, magnitude, infinity = found
    return int(loop(array.ravel(order="K").view(uint), uint(magnitude))) < infinity  # a view in memory order
