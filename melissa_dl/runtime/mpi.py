"""How a failure on one rank ends the whole MPI job instead of hanging it.

An uncaught exception in any thread of any rank is logged with its traceback,
its cause recorded in the output folder for ``melissa-launcher``, and followed
by ``MPI_Abort``, which makes ``mpirun`` kill every rank and exit non-zero (1;
2 without a traceback for an output folder that is full or read-only, where a
restart cannot help). Signals are turned into ``SystemExit`` so that
``finally`` blocks, which stop the simulation jobs, still run; then the job is
aborted, without a traceback (``end_every_rank``): with 75 for a stop signal
(SIGTERM, SIGINT, SIGUSR1) before training, when there is nothing to checkpoint
(``stop_now``), with 128 + the signal for SIGQUIT (``exit_now``). While
training, a stop signal (``mpirun`` forwards them to every rank, ``srun``
SIGUSR1 only) asks for a graceful stop instead: the
ranks agree on a batch, checkpoint and exit 75; the copies of one stop sent to
the whole job are that one stop (``GracefulStop``).
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn, TypeAlias

from melissa_dl.runtime.files import unwritable
from melissa_dl.runtime.status import EXIT_CONFIG, EXIT_STOPPED, record_failure

if TYPE_CHECKING:
    from mpi4py import MPI

Comm: TypeAlias = "MPI.Comm"
"""An MPI communicator, in signatures; the modules that only pass one along need not import mpi4py."""

logger = logging.getLogger(__name__)

ABORT_GRACE = 0.5  # seconds


def install_abort_on_error(comm: Comm, output: Path) -> None:
    """Abort ``comm`` on any uncaught exception (after ``finally`` blocks ran), its cause recorded in the output
    folder for the supervisor (``status.record_failure``)."""

    def abort(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        reason = unwritable(error)
        if reason is None:
            logger.critical("fatal error, aborting the MPI job", exc_info=(kind, error, trace))
            try:
                record_failure(output, error, trace)
            except Exception as problem:  # nothing may keep this rank from ending the job
                logger.warning("could not record the error's cause in %s: %s", output, problem)
        else:  # a full or read-only output folder: one line, and a code the supervisor does not restart on
            logger.critical("%s", reason)
        logging.shutdown()
        time.sleep(ABORT_GRACE)  # let mpirun forward what this rank printed before it tears the job down
        comm.Abort(1 if reason is None else EXIT_CONFIG)

    sys.excepthook = abort
    threading.excepthook = lambda args: abort(args.exc_type, args.exc_value, args.exc_traceback)  # type: ignore[arg-type]
    for sig in STOP_SIGNALS:
        signal.signal(sig, stop_now)
    signal.signal(signal.SIGQUIT, exit_now)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
"""A graceful stop; SIGUSR1 is the one ``srun`` passes on to the ranks as it comes (it kills them on SIGTERM)."""


class Signalled(SystemExit):
    """A signal that ends this rank; ``end_every_rank`` then ends the job with ``code``."""

    def __init__(self, signum: int, code: int) -> None:
        super().__init__(code)
        self.signum = signum


def stop_now(signum: int, frame: Any) -> None:
    """A stop before training (restore, start-up): nothing is trained since the last checkpoint, so the job ends at
    once with 75, and the same command resumes exactly."""
    _end(signum, EXIT_STOPPED)


def exit_now(signum: int, frame: Any) -> None:
    """An exit asked for (SIGQUIT, or a stop signal again once a graceful stop has had its time): 128 + signal."""
    _end(signum, 128 + signum)


def _end(signum: int, code: int) -> None:
    """``Signalled``, so that the ``finally`` blocks (which stop the simulations) run, then ``end_every_rank``. The
    other copies of a job-wide stop, which follow within milliseconds, do nothing from now on, so that none
    interrupts those blocks (a handler that does nothing, not SIG_IGN, which the simulations started meanwhile would
    inherit); SIGQUIT still ends it."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, _ignore)
    raise Signalled(signum, code)


def _ignore(signum: int, frame: Any) -> None:
    """A signal that changes nothing any more."""


def ignore_stops() -> None:
    """Before the interpreter's exit, which puts the default handlers back: a late copy of a stop (srun terminates
    the step once a rank exited 75, with ``--kill-on-bad-exit``) would then kill the rank and change its exit code.
    Ignored signals stay ignored; no simulation is started any more to inherit that."""
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


def end_every_rank(comm: Comm, signalled: SystemExit) -> NoReturn:
    """End the job on a signal's ``SystemExit``: the other ranks may wait inside a collective, where Python
    runs no signal handler, so a plain exit of this rank would leave them (and ``mpirun``) hanging."""
    code = signalled.code if isinstance(signalled.code, int) else 1
    cause = f"signal {signalled.signum}" if isinstance(signalled, Signalled) else "exit"
    logger.warning("%s: ending every rank (exit code %d)", cause, code)
    logging.shutdown()
    time.sleep(ABORT_GRACE)  # as abort() does: mpirun forwards that line before it tears the job down
    comm.Abort(code)
    os._exit(code)  # MPI_Abort returns where the launcher is already tearing the job down: no traceback then


def first_of_launch() -> bool:
    """Whether this process is rank 0 of its launch (hydra, Open MPI, srun), before or without MPI: the one
    that speaks for all K when they all meet the same error."""
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        if name in os.environ:
            return os.environ[name] == "0"
    return True


def launch_problem(size: int) -> str | None:
    """Why this MPI job is not what its launcher started, if it is not.

    ``srun`` without ``--mpi=pmi2`` starts every task as an MPI singleton of
    size 1: K servers that each think they are alone.
    """
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))
    if size == 1 and tasks > 1:
        return (
            f"srun started {tasks} tasks but MPI sees one rank in each: start the server with "
            f"`srun --mpi=pmi2 -n {tasks} melissa-server CONFIG` (the mpich wheel's MPI needs srun's pmi2 plugin)"
        )
    return None


def keep_pmi_lines_short() -> bool:
    """Before MPI starts under ``srun --mpi=pmi2`` with the ``mpich`` wheel: its OFI netmod instead of its
    default, UCX, unless the user chose one (``MPIR_CVAR_CH4_NETMOD`` or ``MPICH_CH4_NETMOD``). True where it
    chose.

    MPICH publishes a rank's network address in PMI-1 ``put`` lines cut to
    values of 1,022 characters; UCX's address takes nine of them, and a
    line's header makes it up to about 1,080 bytes. Slurm's pmi2 plugin reads
    each PMI-1 line with one 1,024-byte ``read`` (``handle_pmi1_cmd`` in
    src/plugins/mpi/pmi2/pmi1.c, not yet reading up to the newline): a line longer than that is taken as two
    requests, neither valid, and every rank aborts in ``MPI_Init``. How long
    the lines are depends on the address, so it happened now and then. OFI's
    address fits one short line. Only with the wheel: a site's MPICH built
    without OFI would refuse the name.
    """
    if os.environ.get("SLURM_MPI_TYPE") != "pmi2" or "PMI_FD" not in os.environ:
        return False
    if "MPIR_CVAR_CH4_NETMOD" in os.environ or "MPICH_CH4_NETMOD" in os.environ:
        return False
    try:
        importlib.metadata.distribution("mpich")
    except importlib.metadata.PackageNotFoundError:
        return False
    os.environ["MPIR_CVAR_CH4_NETMOD"] = "ofi"
    return True


class GracefulStop:
    """While installed (training), SIGTERM, SIGINT or SIGUSR1 asks for a graceful stop: ``requested`` is set, and the
    ranks checkpoint and exit.

    A stop sent to the whole job (``scancel``, a Slurm time limit, ``kill -TERM -PGID``) reaches each rank
    several times: directly, through ``mpiexec`` or ``srun``, through ``melissa-launcher``. So the same signal
    again within ``REPEATS`` seconds of its first is that same stop; later (the stop has had its time), it means
    exit now, as SIGQUIT does at any time. SIGINT's window is short, so that a second Ctrl-C from a terminal, a
    second or more after the first, exits at once.
    """

    REPEATS: ClassVar[dict[int, float]] = {signal.SIGTERM: 5.0, signal.SIGINT: 1.0, signal.SIGUSR1: 5.0}

    def __init__(self, how: str = "after a checkpoint at the next batch") -> None:
        self.requested = False
        self._how = how  # what the stop does, as its warning says
        self._first: dict[int, float] = {}  # signal -> when it first came

    def install(self) -> None:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)

    def done(self) -> None:
        """The stop is made (its checkpoint committed, or given up on): a late copy of it, such as srun's
        termination of the ranks slower to end than the first, changes nothing."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, _ignore)

    def _handle(self, signum: int, frame: Any) -> None:
        now = time.monotonic()
        if now - self._first.setdefault(signum, now) > self.REPEATS[signum]:
            exit_now(signum, frame)
        if not self.requested:
            self.requested = True
            logger.warning(
                "signal %d: stopping %s (the same signal after %g s, or SIGQUIT, exits at once)",
                signum,
                self._how,
                self.REPEATS[signum],
            )
