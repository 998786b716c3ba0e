"""Which module holds each kind a configuration chooses by name: a new scheduler, buffer kind or sampler is one file
of its own plus one line here.

Plain data: the configuration reads the names from here (its choices, its checks) without importing any kind;
``load`` imports a kind's module only when a study chooses it, so that a broken file of one kind (a syntax error,
a failing import) leaves every study that does not choose it working, and one that does gets a one-line
``ConfigError`` naming the file and line.
"""

from __future__ import annotations

import importlib
import traceback
from typing import Any

from melissa_dl.errors import ConfigError

SCHEDULERS = {
    "local": "launcher.schedulers:LocalScheduler",
    "mpirun": "launcher.schedulers:MpirunScheduler",
    "slurm": "launcher.slurm:SlurmScheduler",
    "srun": "launcher.slurm:SrunScheduler",
}
"""``launcher.scheduler``: how each simulation's job runs (a ``launcher.Scheduler``)."""

BUFFERS = {
    "fifo": "melissa_dl.buffers.kinds:FifoBuffer",
    "firo": "melissa_dl.buffers.kinds:FiroBuffer",
    "reservoir": "melissa_dl.buffers.kinds:ReservoirBuffer",
}
"""``buffer.kind``: what a rank's buffer serves and drops (a ``melissa_dl.buffers.kinds.Buffer``)."""


SPACE_FILLING = {
    "uniform": "launcher.samplers:UniformSampler",
    "sobol": "launcher.samplers:SobolSampler",
    "halton": "launcher.samplers:HaltonSampler",
    "lhs": "launcher.samplers:LhsSampler",
}
"""The samplers that need nothing but bounds, a seed and a count: also ``study.adaptive.base``."""

SAMPLERS = {
    **SPACE_FILLING,
    "list": "launcher.samplers:ListSampler",
    "adaptive": "launcher.samplers:AdaptiveSampler",
}
"""``study.sampler`` (a ``launcher.Sampler``), besides ``custom``: the user's class (``study.custom_sampler``)."""


def load(registry: dict[str, str], kind: str, path: str) -> Any:
    """The class ``registry`` names ``kind`` (a key of it), its module imported now; ``path`` (the config key that
    chose it) heads the error of a module that cannot be imported."""
    module, _, name = registry[kind].partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except SyntaxError as error:
        raise ConfigError(f"{path}: {kind!r} cannot load: {error.filename}:{error.lineno}: {error.msg}") from None
    except Exception as error:  # an import that fails, an error at import, a class that is not there
        where = traceback.extract_tb(error.__traceback__)[-1]
        raise ConfigError(
            f"{path}: {kind!r} cannot load: {where.filename}:{where.lineno}: {type(error).__name__}: {error}"
        ) from None
