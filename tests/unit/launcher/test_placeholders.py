"""``launcher.command`` and ``launcher.env`` placeholders: filled per attempt, checked with the config."""

from __future__ import annotations

from pathlib import Path

import pytest

from launcher.placeholders import Placeholders, unknown_placeholder
from melissa_dl.config.sections import parse_config
from melissa_dl.errors import ConfigError
from melissa_dl.study.jobs import placeholders_from_config

PARAMETERS = {"temperature": 1.5, "density": 0.1}


def test_parameters_by_name_all_at_once_and_the_attempt_fields() -> None:
    placeholders = Placeholders(
        ["sim", "--t", "{temperature}", "{parameters}", "--all={parameters:.2f}", "run{simulation}.{attempt}"],
        {"CUDA_VISIBLE_DEVICES": "{slot}", "WORKDIR": "/scratch/slot{slot:02d}", "PLAIN": "{{braces}}"},
    )
    command, env = placeholders.fill(7, 1, 3, PARAMETERS)
    assert command == ["sim", "--t", "1.5", "1.5", "0.1", "--all=1.50 0.10", "run7.1"]
    assert env == {"CUDA_VISIBLE_DEVICES": "3", "WORKDIR": "/scratch/slot03", "PLAIN": "{braces}"}


def test_floats_reach_argv_exactly() -> None:
    value = 0.1 + 0.2
    command, _ = Placeholders(["{parameters}", "{x}"]).fill(0, 0, 0, {"x": value})
    assert [float(argument) for argument in command] == [value, value]


@pytest.mark.parametrize(
    ("command", "env", "path", "complaint"),
    [
        (
            ["sim", "{temprature}"],
            {},
            "launcher.command[1]",
            "unknown placeholder {temprature}; known: {simulation}, {attempt}, {slot}, {parameters}, {a}, {b}",
        ),
        (["sim"], {"GPU": "{slots}"}, "launcher.env.GPU", "unknown placeholder {slots}; did you mean {slot}?"),
        (["sim", "{a.b}"], {}, "launcher.command[1]", "unknown placeholder {a.b}"),
        (["sh", "-c", "echo {"], {}, "launcher.command[2]", "Single '{' encountered in format string"),
        (["sh", "-c", "echo }"], {}, "launcher.command[2]", "Single '}' encountered in format string"),
    ],
)
def test_a_placeholder_that_names_nothing_is_refused_with_its_path(
    command: list[str], env: dict[str, str], path: str, complaint: str
) -> None:
    unknown = unknown_placeholder(command, env, ["a", "b"])
    assert unknown is not None and unknown[0] == path and complaint in unknown[1], unknown
    assert "write {{ and }} for a literal brace" in unknown[1]


def test_the_config_check_refuses_an_unknown_placeholder_in_one_line() -> None:
    """Refused where the placeholders are built from the config (``--check`` and every run do it first)."""
    data = {
        "study": {"fields": ["u"], "parameters": [{"name": "a", "low": 0, "high": 1}], "simulations": 2},
        "launcher": {"command": ["sim", "{a}", "{b}"]},
    }
    refusal = r"^launcher\.command\[2\]: '\{b\}': unknown placeholder \{b\}; known: .*, \{a\} \(write"
    with pytest.raises(ConfigError, match=refusal):
        placeholders_from_config(parse_config(data, Path("/studies/x")))
    data["launcher"]["command"] = ["sim", "{a}", "--slot={slot}"]  # type: ignore[index]
    filled = placeholders_from_config(parse_config(data, Path("/studies/x")))
    assert filled.command == ["sim", "{a}", "--slot={slot}"]


@pytest.mark.parametrize(
    ("command", "names", "complaint"),
    [
        (["sim", "{a:d}"], ["a"], "'{a:d}': cannot be filled: ValueError: Unknown format code 'd'"),
        (["sim", "{a.b}"], ["a.b"], "cannot be filled: KeyError: 'a' (a name with '.' or '[' can only be reached"),
        (["sim", "{slot:s}"], ["a"], "cannot be filled: ValueError: Unknown format code 's'"),
    ],
)
def test_a_placeholder_that_cannot_be_filled_is_refused_at_check_not_at_an_attempt_s_start(
    command: list[str], names: list[str], complaint: str
) -> None:
    unknown = unknown_placeholder(command, {}, names)
    assert unknown is not None and unknown[0] == "launcher.command[1]" and complaint in unknown[1], unknown


def test_persistent_workers_take_only_slot() -> None:
    unknown = unknown_placeholder(["w", "{a}"], {}, ["a"], persistent=True)
    assert unknown is not None and "unknown placeholder {a}; known: {slot} (with launcher.persistent" in unknown[1]
    assert unknown_placeholder(["w", "--gpu={slot:02d}"], {"DIR": "/s{slot}"}, ["a"], persistent=True) is None
