"""A clock that a test moves by hand: what the ``clock`` fixture (``tests/conftest.py``) returns, here so that a test
module names its type (``from clocks import Clock``) without importing a conftest."""

from __future__ import annotations


class Clock:
    """A monotonic clock that a test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now
