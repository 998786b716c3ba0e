"""Draws simulation parameters and starts, polls and kills simulation jobs for the server's rank 0.

The server decides what runs, retries and states; this package only runs processes. It imports nothing of
``melissa_dl``: the dependency runs one way.
"""

from __future__ import annotations

from launcher.jobs import NOT_RUNNABLE, START_FAILED, Launcher, program_last_line
from launcher.samplers import Breeding, Sampler
from launcher.schedulers import (
    KILL_GRACE,
    Job,
    JobTemplate,
    LocalScheduler,
    MpirunScheduler,
    Scheduler,
    child_environment,
)

__all__ = [
    "Breeding",
    "KILL_GRACE",
    "START_FAILED",
    "Job",
    "JobTemplate",
    "Launcher",
    "LocalScheduler",
    "MpirunScheduler",
    "NOT_RUNNABLE",
    "Sampler",
    "Scheduler",
    "child_environment",
    "program_last_line",
]
