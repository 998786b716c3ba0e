"""How a rank reads stop signals: the copies of one job-wide stop are one graceful stop; a later one, or SIGQUIT, is
an exit at once, and an exit is never interrupted by the copies that follow it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from melissa_dl.runtime import mpi
from melissa_dl.runtime.mpi import GracefulStop, exit_now

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(autouse=True)
def handlers() -> Iterator[None]:
    """The process's handlers as they were, whatever a test installed."""
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(mpi.time, "monotonic", clock)
    return clock


@pytest.mark.parametrize(
    "sig, copies, later",
    [
        (signal.SIGTERM, [0.0, 0.001, 0.1, 4.9], 5.5),  # the rank's own, mpirun's, the supervisor's, a slow srun's
        (signal.SIGINT, [0.0, 0.05], 1.5),  # a Ctrl-C and mpirun's copy of it; then a second Ctrl-C
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


def test_an_exit_is_not_interrupted_by_the_stop_signals_that_follow_but_sigquit_still_exits() -> None:
    signal.signal(signal.SIGQUIT, exit_now)
    with pytest.raises(SystemExit) as ended:
        exit_now(signal.SIGTERM, None)
    assert ended.value.code == 128 + signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGTERM)  # ignored: the finally blocks of the first exit run on
    os.kill(os.getpid(), signal.SIGINT)
    with pytest.raises(SystemExit) as forced:
        os.kill(os.getpid(), signal.SIGQUIT)
    assert forced.value.code == 128 + signal.SIGQUIT
