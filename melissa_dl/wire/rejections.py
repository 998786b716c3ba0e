"""Counting refused input without flooding the log.

A misbehaving client can send thousands of bad frames a second; each kind of
refusal is logged in full the first time, then summarised at most once per
``interval`` seconds, and every refusal is counted for the final report
(and checkpointed, so that a restart forgets none).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterable

logger = logging.getLogger(__name__)


class RejectionLog:
    """Thread-safe counts of refusals by kind, with rate-limited warnings."""

    def __init__(self, interval: float = 10.0) -> None:
        self._interval = interval
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._unlogged: Counter[tuple[str, int]] = Counter()  # by kind and level
        self._last_logged: dict[tuple[str, int], float] = {}

    def reject(self, kind: str, message: str, level: int = logging.WARNING) -> None:
        """Count a refusal of ``kind``; log it at ``level`` unless its kind was logged at that level less than
        ``interval`` seconds ago (INFO: what is ordinary, such as a peer that went away, counted all the same, and
        never silencing a warning)."""
        now = time.monotonic()
        said = (kind, level)
        with self._lock:
            self._counts[kind] += 1
            last = self._last_logged.get(said)
            if last is not None and now - last < self._interval:
                self._unlogged[said] += 1
                return
            self._last_logged[said] = now
            silenced = self._unlogged.pop(said, 0)
        more = f" ({silenced} more of this kind since the last one said)" if silenced else ""
        logger.log(level, "refused (%s): %s%s", kind, message, more)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def state_dict(self) -> dict[str, int]:
        return self.counts()

    def load_state_dict(self, counts: dict[str, int]) -> None:
        """Continue the counts of an earlier run, so that the final report forgets no refusal."""
        with self._lock:
            self._counts = Counter(counts)


def merge_rejections(counts: Iterable[dict[str, int]]) -> dict[str, int]:
    """Several ranks' (or runs') refusal counts added up by kind."""
    total: Counter[str] = Counter()
    for c in counts:
        total.update(c)
    return dict(sorted(total.items()))
