"""How the server process's C allocator treats freed memory.

ZeroMQ's I/O thread allocates every received message with ``malloc``, and the
buffer frees it once trained on. glibc's defaults give the freed top of a heap
back to the kernel as soon as it exceeds twice the largest block freed so
far (about 2 MiB for 1 MiB fields): the next messages then fault their pages
in again, one by one, zero-filled. Measured with ``bench/ingest.py``'s
server side (8 clients, 1 MiB fields), that is 40 to 80 page faults a message
and 30-50% more kernel time (a bare pyzmq receiver: up to 230 faults).
Keeping up to ``TRIM_BYTES`` of freed memory per heap, and serving blocks
below ``MMAP_BYTES`` from the heaps instead of a fresh ``mmap`` each, removes
them.

What is kept is not lost, but it stays resident: over a long study the
heaps' freed pages, each touched once, add up to the high water of every
heap. Measured with ``bench/scale.py`` (6,000 simulations, 1,024 at once),
each rank's resident memory climbed by 80 MB while the memory in use fell
from 224 to 179 MB. So the server also gives every freed page back, in every
heap, once every ``RELEASE_INTERVAL`` seconds (``FreedMemory``): the next
messages fault at most one heap's worth back in, once an interval.

The setting is process-wide, so only the server's entry point makes it,
before MPI starts: an MPI library that sets malloc options of its own at
initialisation (some keep freed memory registered with the network card) has
the last word. A user's own ``GLIBC_TUNABLES`` malloc tunables or
``MALLOC_*_`` variables win too. Elsewhere than glibc nothing is changed.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time

logger = logging.getLogger(__name__)

MMAP_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit
TRIM_BYTES = 64 << 20
RELEASE_INTERVAL = 30.0  # seconds between two returns of every freed page to the kernel
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for the next messages; False where it is not glibc or the user chose."""
    if "malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(
        name.startswith("MALLOC_") and name.endswith("_") for name in os.environ
    ):
        return False
    if not _glibc():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES)):
        logger.warning("the C allocator refused mallopt: freed message memory goes back to the kernel at once")
        return False
    return True


class FreedMemory:
    """Gives the kernel back the pages of every block freed in any heap (glibc's ``malloc_trim``), now or at most
    once every ``interval`` seconds, so that resident memory follows the memory in use. Elsewhere than glibc it
    does nothing."""

    def __init__(self, interval: float = RELEASE_INTERVAL) -> None:
        self.interval = interval
        self._trim = ctypes.CDLL(None).malloc_trim if _glibc() else None
        self._next = time.monotonic() + interval

    def release_if_due(self) -> bool:
        """Whether freed pages were given back now."""
        return time.monotonic() >= self._next and self.release()

    def release(self) -> bool:
        """Whether freed pages were given back (False elsewhere than glibc)."""
        if self._trim is None:
            return False
        self._trim(0)
        self._next = time.monotonic() + self.interval
        return True


def _glibc() -> bool:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION") is not None
    except (ValueError, OSError):  # no such name: another C library
        return False
