"""Loading a class the user wrote, named in the config by file and class: the training module, a sampler.

The file is imported under a name of its own (so that cloudpickle and
dataclasses find it), with its folder on ``sys.path`` (its helpers import as
usual); whatever importing it raises, and a class that is missing or of the
wrong kind, is a ``ConfigError`` naming the config key, with a suggestion.
"""

from __future__ import annotations

import difflib
import importlib.util
import sys
from pathlib import Path
from typing import Any

from melissa_dl.errors import ConfigError


def load_class(path: Path, class_name: str, base: type, key: str) -> Any:
    """The subclass of ``base`` named ``class_name`` in the file ``path`` (``key``: its config section)."""
    if not path.is_file():
        raise ConfigError(f"{key}.module: no file {path}")
    name = f"melissa_user_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # the user's code: whatever it raises is this config's error
        raise ConfigError(f"{key}.module: importing {path} failed: {type(error).__name__}: {error}") from error
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, base)):
        defined = [n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, base) and v is not base]
        close = difflib.get_close_matches(class_name, defined, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else f" (it defines {', '.join(defined) or 'none'})"
        raise ConfigError(f"{key}.class_name: {path.name} defines no {base.__name__} subclass '{class_name}'{hint}")
    return cls
