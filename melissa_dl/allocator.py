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

logger = logging.getLogger(__name__)

MMAP_BYTES = 32 << 20  # glibc's largest mmap threshold on 64-bit
TRIM_BYTES = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for the next messages; False where it is not glibc or the user chose."""
    if "malloc." in os.environ.get("GLIBC_TUNABLES", "") or any(
            name.startswith("MALLOC_") and name.endswith("_") for name in os.environ):
        return False
    try:
        glibc = os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):  # no such name: another C library
        glibc = None
    if glibc is None:
        return False
    mallopt = ctypes.CDLL(None).mallopt
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES)):
        logger.warning("the C allocator refused mallopt: freed message memory goes back to the kernel at once")
        return False
    return True
