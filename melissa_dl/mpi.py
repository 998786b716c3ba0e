"""How a failure on one rank ends the whole MPI job instead of hanging it.

An uncaught exception in any thread of any rank is logged with its traceback
and followed by ``MPI_Abort``, which makes ``mpirun`` kill every rank and exit
non-zero. SIGTERM (sent by ``mpirun`` when another rank fails, or by a user)
is turned into ``SystemExit`` so that ``finally`` blocks, which stop the
simulation jobs, still run.
"""
from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from types import TracebackType
from typing import Any

logger = logging.getLogger(__name__)

ABORT_GRACE = 0.5  # seconds


def install_abort_on_error(comm: Any) -> None:
    """Abort ``comm`` on any uncaught exception (after ``finally`` blocks ran)."""

    def abort(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        logger.critical("fatal error, aborting the MPI job", exc_info=(kind, error, trace))
        logging.shutdown()
        time.sleep(ABORT_GRACE)  # let mpirun forward what this rank printed before it tears the job down
        comm.Abort(1)

    sys.excepthook = abort
    threading.excepthook = lambda args: abort(args.exc_type, args.exc_value, args.exc_traceback)  # type: ignore[arg-type]
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
