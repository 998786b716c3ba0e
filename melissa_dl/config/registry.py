"""Which module holds each kind a configuration chooses by name: a new scheduler, buffer kind or space-filling
sampler (bounds, a seed and a count) is one file of its own plus one line here.

Plain data: the configuration reads the names from here (its choices, its checks) without importing any kind;
``load`` imports a kind's module only when a study chooses it, so that a broken file of one kind (a syntax error,
a failing import) leaves every study that does not choose it working, and one that does gets a one-line
``ConfigError`` naming the file and line.
"""

from __future__ import annotations

import importlib
import importlib.util
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
    chose it) heads the error of a module that cannot be imported, which names the place in the kind's own file."""
    module, _, name = registry[kind].partition(":")
    failed = f"{path}: {kind!r} cannot load"
    try:
        found = importlib.import_module(module)
    except SyntaxError as error:
        raise ConfigError(f"{failed}: {error.filename}:{error.lineno}: {error.msg}") from None
    except ModuleNotFoundError as error:
        if error.name != module:  # the kind's module is there: something it imports is not
            raise ConfigError(f"{failed}: {_place(module, error)}: {type(error).__name__}: {error}") from None
        raise ConfigError(f"{failed}: no module {module} (its line in {__name__}: {registry[kind]!r})") from None
    except Exception as error:  # an error at import
        raise ConfigError(f"{failed}: {_place(module, error)}: {type(error).__name__}: {error}") from None
    if not hasattr(found, name):
        raise ConfigError(f"{failed}: {found.__file__} has no {name} (its line in {__name__}: {registry[kind]!r})")
    return getattr(found, name)


def _place(module: str, error: BaseException) -> str:
    """``file:line`` of ``error`` in ``module``'s own file (where it reached into a library), else where it arose."""
    frames = traceback.extract_tb(error.__traceback__)
    spec = importlib.util.find_spec(module)
    own = [frame for frame in frames if spec is not None and frame.filename == spec.origin]
    where = (own or frames)[-1]
    return f"{where.filename}:{where.lineno}"
