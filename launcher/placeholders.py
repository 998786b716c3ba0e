"""Placeholders in ``launcher.command`` and ``launcher.env``: what differs between a study's attempts.

They are Python format fields, filled when an attempt starts:

- ``{simulation}``: its id; ``{attempt}``: 0 at its first launch;
- ``{slot}``: the job slot it runs in, 0 to ``job_limit`` - 1, no two running attempts sharing one, so that a
  slot can name a GPU (``"CUDA_VISIBLE_DEVICES": "{slot}"``) or a working folder;
- each of the study's parameters by its name (``{temperature}``), or all at once (``{parameters}``: an argument
  that is nothing else becomes one argument per parameter, in the study's order; inside other text they are
  joined by spaces).

A format spec applies to numbers (``{temperature:.3f}``, ``{slot:02d}``); ``{{`` and ``}}`` are literal braces.
Most existing codes take their parameters on the command line, as Melissa's own examples do.
"""

from __future__ import annotations

import difflib
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ATTEMPT_FIELDS = ("simulation", "attempt", "slot", "parameters")
"""The placeholders every study has; a parameter of one of these names is reached through ``{parameters}``."""
_FORMATTER = string.Formatter()


class _Row(tuple[float, ...]):
    """All the parameters as one placeholder: each formatted with the spec given, joined by spaces."""

    def __format__(self, spec: str) -> str:
        return " ".join(format(value, spec) for value in self)


def placeholders_in(text: str) -> list[str]:
    """The names of the placeholders in ``text``; ``ValueError`` for a lone brace."""
    return [name for _, name, _, _ in _FORMATTER.parse(text) if name is not None]


def unknown_placeholder(
    command: Sequence[str], env: Mapping[str, str], names: Iterable[str], persistent: bool = False
) -> tuple[str, str] | None:
    """The config path and the complaint of the first placeholder of ``command`` or ``env`` that is malformed,
    names neither an attempt's field nor a parameter of ``names`` (``persistent``: anything but ``{slot}``, as a
    worker runs many simulations), or cannot be filled (a spec for another type, ``{temperature:d}``); None when
    all can. Each is filled once here, so that no attempt's start meets it."""
    known = ["slot"] if persistent else [*ATTEMPT_FIELDS, *names]
    texts = [(f"launcher.command[{i}]", argument) for i, argument in enumerate(command)]
    texts += [(f"launcher.env.{name}", value) for name, value in env.items()]
    for path, text in texts:
        try:
            unknown = [name for name in placeholders_in(text) if name not in known]
        except ValueError as error:
            return path, f"{text!r}: {error} (write {{{{ and }}}} for a literal brace)"
        if unknown:
            close = difflib.get_close_matches(unknown[0], known, n=1)
            hint = f"did you mean {{{close[0]}}}? " if close else ""
            listed = ", ".join(f"{{{name}}}" for name in known)
            why = " (with launcher.persistent, a worker runs many simulations)" if persistent else ""
            return path, (
                f"{text!r}: unknown placeholder {{{unknown[0]}}}; {hint}known: {listed}{why} "
                "(write {{ and }} for a literal brace)"
            )
        try:
            filling = Placeholders([text])
            filling.fill_slot(0) if persistent else filling.fill(0, 0, 0, dict.fromkeys(names, 0.5))
        except (ValueError, TypeError, LookupError, AttributeError) as error:
            dotted = any(c in name for name in placeholders_in(text) for c in ".[")
            hint = " (a name with '.' or '[' can only be reached through {parameters})" if dotted else ""
            return path, f"{text!r}: cannot be filled: {type(error).__name__}: {error}{hint}"
    return None


@dataclass(frozen=True)
class Placeholders:
    """``launcher.command`` and ``launcher.env`` as written, filled for each attempt (or each worker)."""

    command: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def fill(
        self, simulation: int, attempt: int, slot: int, parameters: Mapping[str, float]
    ) -> tuple[list[str], dict[str, str]]:
        """The command line and the extra environment of this attempt."""
        return self._filled(
            {
                **parameters,
                "simulation": simulation,
                "attempt": attempt,
                "slot": slot,
                "parameters": _Row(parameters.values()),
            }
        )

    def fill_slot(self, slot: int) -> tuple[list[str], dict[str, str]]:
        """A persistent worker's command line and extra environment: ``{slot}`` is all they may hold."""
        return self._filled({"slot": slot})

    def _filled(self, values: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
        command: list[str] = []
        for argument in self.command:
            spec = _only_parameters(argument)
            command += [argument.format_map(values)] if spec is None else format(values["parameters"], spec).split()
        return command, {name: value.format_map(values) for name, value in self.env.items()}


def _only_parameters(argument: str) -> str | None:
    """The format spec of an argument that is ``{parameters}`` and nothing else (None for any other)."""
    parsed = list(_FORMATTER.parse(argument))
    if len(parsed) == 1 and parsed[0][0] == "" and parsed[0][1] == "parameters" and parsed[0][3] is None:
        return parsed[0][2] or ""
    return None
