"""How a rank reads stop signals: the copies of one job-wide stop are one graceful stop; a later one, or SIGQUIT, is
an exit at once; a stop before training ends the job with 75; an end is never interrupted by the copies that follow
it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from melissa_dl.runtime import mpi
from melissa_dl.runtime.mpi import STOP_SIGNALS, GracefulStop, Signalled, exit_now, stop_now
from melissa_dl.runtime.status import EXIT_STOPPED

if TYPE_CHECKING:
    from clocks import Clock  # tests/clocks.py

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def handlers() -> Iterator[None]:
    """The process's handlers as they were, whatever a test installed."""
    saved = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGQUIT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


CLOCKED = (mpi,)  # the modules whose clock the tests move (the ``clock`` fixture)


@pytest.mark.parametrize(
    "sig, copies, later",
    [
        (signal.SIGTERM, [0.0, 0.001, 0.1, 4.9], 5.5),  # the rank's own, mpirun's, the supervisor's, a slow srun's
        (signal.SIGINT, [0.0, 0.05], 1.5),  # a Ctrl-C and mpirun's copy of it; then a second Ctrl-C
        (signal.SIGUSR1, [0.0, 0.1], 5.5),  # what the supervisor passes on through srun
    ],
)
def test_the_copies_of_one_stop_are_one_stop_and_a_later_signal_exits(
    clock: Clock, sig: signal.Signals, copies: list[float], later: float
) -> None:
    stop = GracefulStop()
    stop.install()
    for delay in copies:
        clock.now = 100.0 + delay
        os.kill(os.getpid(), sig)
        assert stop.requested
    clock.now = 100.0 + later  # the stop has had its time: the same signal means exit now
    with pytest.raises(SystemExit) as ended:
        os.kill(os.getpid(), sig)
    assert ended.value.code == 128 + sig


def test_sigterm_after_sigint_is_the_same_stop(clock: Clock) -> None:
    stop = GracefulStop()
    stop.install()
    os.kill(os.getpid(), signal.SIGINT)
    clock.now += 3.0
    os.kill(os.getpid(), signal.SIGTERM)  # its own first: a stop already under way
    assert stop.requested


@pytest.mark.parametrize("end, sig, code", [(stop_now, signal.SIGTERM, EXIT_STOPPED), (exit_now, signal.SIGTERM, 143)])
def test_an_end_is_not_interrupted_by_the_stop_signals_that_follow_but_sigquit_still_exits(
    end: object, sig: signal.Signals, code: int
) -> None:
    signal.signal(signal.SIGQUIT, exit_now)
    with pytest.raises(Signalled) as ended:
        end(sig, None)  # type: ignore[operator]
    assert (ended.value.code, ended.value.signum) == (code, sig)
    for each in (signal.SIGTERM, signal.SIGINT):  # a handler of ours, not SIG_IGN: what a child started now inherits
        assert signal.getsignal(each) not in (signal.SIG_IGN, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # nothing: the finally blocks of the first end run on
    os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(Signalled) as forced:
        os.kill(os.getpid(), signal.SIGQUIT)
    assert forced.value.code == 128 + signal.SIGQUIT
