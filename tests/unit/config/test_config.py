"""Loading, type-checking and consistency checks of the study configuration."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from melissa_dl.config.limits import CLIENT_TIMEOUT_RANGE, MAX_SIMULATION_ID, SEND_QUEUE_BYTES_RANGE
from melissa_dl.config.sections import Config, MiB, ParameterConfig, load_config, parse_config
from melissa_dl.errors import ClientError, ConfigError
from melissa_dl.wire.client import (
    ENV_CLIENT_TIMEOUT,
    ENV_PARAMETERS,
    ENV_SEND_QUEUE_BYTES,
    ENV_SIMULATION_ID,
    ENV_TOKEN,
    Client,
)

pytestmark = pytest.mark.timeout(60)

BASE = Path("/studies/heat")
MINIMAL: dict[str, Any] = {
    "study": {
        "fields": ["u"],
        "parameters": [{"name": "a", "low": 0, "high": 1}, {"name": "b", "low": 0, "high": 2}],
        "simulations": 2,
    },
    "launcher": {"command": ["python", "sim.py"]},
}
DELETE = object()


def edited(changes: dict[tuple[str | int, ...], Any]) -> dict[str, Any]:
    """A copy of MINIMAL with each path set to its value (or removed, for DELETE); sections are created."""
    data = copy.deepcopy(MINIMAL)
    for path, value in changes.items():
        *parents, last = path
        target = data
        for key in parents:
            target = target.setdefault(key, {}) if isinstance(key, str) else target[key]
        if value is DELETE:
            del target[last]
        else:
            target[last] = value
    return data


def refused(data: Any, *parts: str) -> str:
    """Parse ``data``, expect a ConfigError whose message contains every part, and return the message."""
    with pytest.raises(ConfigError) as info:
        parse_config(data, BASE)
    message = str(info.value)
    for part in parts:
        assert part in message
    return message


def test_minimal_config_gets_the_documented_defaults() -> None:
    config = parse_config(edited({}), BASE)
    assert config.study.parameters == [ParameterConfig("a", 0.0, 1.0), ParameterConfig("b", 0.0, 2.0)]
    assert type(config.study.parameters[0].low) is float  # JSON integers become floats where a number is expected
    assert (config.study.sampler, config.study.parameter_values, config.study.time_steps, config.study.seed) == (
        "uniform",
        None,
        None,
        0,
    )
    assert (config.server.interface, config.server.handshake_port) == ("127.0.0.1", 0)
    assert (config.server.max_message_bytes, config.server.receive_queue_bytes) == (64 * MiB, 256 * MiB)
    assert config.server.bind_simulation_to_server_rank is False and config.server.reject_non_finite is True
    assert (config.buffer.kind, config.buffer.capacity_samples, config.buffer.capacity_bytes) == (
        "reservoir",
        1000,
        None,
    )
    assert (config.buffer.per_server_watermark, config.buffer.pseudo_epochs) == (1, 1)
    launcher = config.launcher
    assert (launcher.scheduler, launcher.client_ranks, launcher.job_limit, launcher.max_retries) == ("local", 1, 4, 2)
    assert (launcher.simulation_timeout, launcher.client_timeout, launcher.env) == (120.0, 60.0, {})
    assert config.output_dir == "output" and config.plots is True
    assert config.base_dir == BASE
    assert config.output_path == BASE / "output"


def test_defaults_are_not_shared_between_configs() -> None:
    first, second = parse_config(edited({}), BASE), parse_config(edited({}), BASE)
    first.launcher.env["OMP_NUM_THREADS"] = "1"
    first.server.max_message_bytes = 1
    assert second.launcher.env == {}
    assert second.server.max_message_bytes == 64 * MiB


@pytest.mark.parametrize(
    ("key", "moved"),
    [("checkpoint_interval", "checkpoint.interval"), ("keep_checkpoints", "checkpoint.keep")],
)
def test_a_key_that_moved_to_the_checkpoint_section_says_where(key: str, moved: str) -> None:
    training = {"module": "m.py", "class_name": "M", key: 5}
    assert refused(edited({("training",): training}), "") == f"training.{key}: moved to {moved}"
    config = parse_config(edited({("checkpoint",): {"interval": 7, "keep": 2}}), BASE)
    assert (config.checkpoint.interval, config.checkpoint.keep) == (7, 2)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({("outptu_dir",): "out"}, "outptu_dir: unknown key (did you mean 'output_dir'?)"),
        ({("server", "handshake_prot"): 5555}, "server.handshake_prot: unknown key (did you mean 'handshake_port'?)"),
        (
            {("study", "parameters", 1, "hihg"): 3},
            "study.parameters[1].hihg: unknown key (did you mean 'high'?)",
        ),
        ({("buffer", "zzzzzz"): 1}, "buffer.zzzzzz: unknown key"),
        ({("base_dir",): "/elsewhere"}, "base_dir: unknown key"),  # internal fields are not options
    ],
)
def test_unknown_keys_are_refused_with_a_suggestion(changes: dict, expected: str) -> None:
    message = refused(edited(changes), expected)
    if "did you mean" not in expected:
        assert "did you mean" not in message


@pytest.mark.parametrize(
    "path, value, expected",
    [
        (("study", "simulations"), "3", 'study.simulations: expected an integer, got "3"'),
        (("launcher", "job_limit"), True, "launcher.job_limit: expected an integer, got true"),
        (("launcher", "job_limit"), 2.5, "launcher.job_limit: expected an integer, got 2.5"),
        (("server", "reject_non_finite"), 1, "server.reject_non_finite: expected true or false, got 1"),
        (("server", "status_interval"), "x", 'server.status_interval: expected a number, got "x"'),
        (("server", "status_interval"), False, "server.status_interval: expected a number, got false"),
        (("study", "parameters", 1, "low"), "x", 'study.parameters[1].low: expected a number, got "x"'),
        (("study", "fields"), ["u", 3], "study.fields[1]: expected a string, got 3"),
        (("study", "fields"), "u", 'study.fields: expected a list or an object, got "u"'),
        (("study", "time_steps"), "10", 'study.time_steps: expected an integer, got "10"'),
        (("study", "parameter_values"), [[1, "a"]], 'study.parameter_values[0][1]: expected a number, got "a"'),
        (("launcher", "env"), {"OMP_NUM_THREADS": 4}, "launcher.env.OMP_NUM_THREADS: expected a string, got 4"),
        (("server",), [], "server: expected an object, got []"),
        (("launcher", "slurm"), 5, "launcher.slurm: expected an object, got 5"),
        (("launcher", "slurm"), [], "launcher.slurm: expected an object, got []"),
        (("launcher", "srun"), None, "launcher.srun: expected an object, got null"),
        (("launcher", "slurm", "partition"), 3, "launcher.slurm.partition: expected a string, got 3"),
    ],
)
def test_wrong_types_name_the_json_path(path: tuple, value: Any, expected: str) -> None:
    refused(edited({path: value}), expected)


@pytest.mark.parametrize(
    "path, value, expected",
    [
        (
            ("launcher", "scheduler"),
            "mpirn",
            'launcher.scheduler: expected one of "local", "mpirun", "slurm", "srun", got "mpirn" '
            '(did you mean "mpirun"?)',
        ),
        (
            ("buffer", "kind"),
            "reservior",
            'buffer.kind: expected one of "fifo", "firo", "reservoir", got "reservior" (did you mean "reservoir"?)',
        ),
        (
            ("buffer", "kind"),
            "lifo",
            'buffer.kind: expected one of "fifo", "firo", "reservoir", got "lifo" (did you mean "fifo"?)',
        ),
        (("training", "device"), "quantum", 'training.device: expected one of "auto", "cpu", "cuda", got "quantum"'),
    ],
)
def test_a_misspelt_choice_gets_a_suggestion(path: tuple, value: str, expected: str) -> None:
    changes = {path: value}
    if path[0] == "training":
        changes[("training",)] = {"module": "m.py", "class_name": "M", "device": value}
        del changes[path]
    message = refused(edited(changes), expected)
    assert message == expected


def test_top_level_must_be_an_object() -> None:
    refused([MINIMAL], "(top level): expected an object")


@pytest.mark.parametrize(
    "path, expected",
    [
        (("study",), "study: missing required key"),
        (("study", "simulations"), "study.simulations: missing required key"),
        (("study", "parameters", 0, "name"), "study.parameters[0].name: missing required key"),
        (("launcher", "command"), "launcher.command: missing required key"),
    ],
)
def test_missing_required_key(path: tuple, expected: str) -> None:
    refused(edited({path: DELETE}), expected)


@pytest.mark.parametrize(
    "path, value, expected",
    [
        (("buffer", "kind"), "lifo", 'buffer.kind: expected one of "fifo", "firo", "reservoir", got "lifo"'),
        (
            ("study", "sampler"),
            "random",
            'study.sampler: expected one of "uniform", "sobol", "halton", "lhs", "list", '
            '"adaptive", "custom", got "random"',
        ),
        (
            ("launcher", "scheduler"),
            "pbs",
            'launcher.scheduler: expected one of "local", "mpirun", "slurm", "srun", got "pbs"',
        ),
    ],
)
def test_literal_violation_lists_the_allowed_values(path: tuple, value: str, expected: str) -> None:
    refused(edited({path: value}), expected)


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({("study", "fields"): []}, "study.fields: at least one field is needed"),
        ({("study", "fields"): ["u", "v", "u"]}, "study.fields: field names must be unique"),
        ({("study", "fields"): [f"f{i}" for i in range(1 << 16)]}, "study.fields: at most 65535 fields"),
        ({("study", "parameters"): []}, "study.parameters: at least one parameter is needed"),
        ({("study", "parameters", 1, "high"): -1}, "study.parameters[1].high: -1.0 is below low=0.0"),
        ({("study", "parameters", 0, "low"): float("-inf")}, "study.parameters[0].low: must be finite"),
        ({("study", "parameters", 1, "high"): float("nan")}, "study.parameters[1].high: must be finite"),
        ({("study", "simulations"): 0}, "study.simulations: must be between 1 and 2**31"),
        ({("study", "simulations"): (1 << 31) + 1}, "study.simulations: must be between 1 and 2**31"),
        (
            {("study", "simulations"): 1 << 31, ("study", "validation", "simulations"): 1},
            "study.validation: 1 held-out simulations after 2147483648 take simulation ids past 2**31 - 1",
        ),
        ({("study", "sampler"): "list"}, "study.parameter_values: required by sampler 'list'"),
        ({("study", "parameter_values"): [[0, 0], [1, 1]]}, "study.parameter_values: only used with sampler 'list'"),
        (
            {("study", "sampler"): "list", ("study", "parameter_values"): [[0, 0]]},
            "study.parameter_values: 1 rows for 2 simulations",
        ),
        (
            {("study", "sampler"): "list", ("study", "parameter_values"): [[0, 0], [1]]},
            "study.parameter_values[1]: 1 values for 2 parameters",
        ),
        (
            {("study", "sampler"): "list", ("study", "parameter_values"): [[0, 0], [1, float("nan")]]},
            "study.parameter_values[1]: values must be finite",
        ),
        ({("study", "time_steps"): 0}, "study.time_steps: must be between 1 and 2**32 - 1"),
        ({("server", "handshake_port"): 1 << 16}, "server.handshake_port: not a port number"),
        ({("server", "handshake_port"): -1}, "server.handshake_port: not a port number"),
        ({("server", "max_message_bytes"): 0}, "server.max_message_bytes: must be positive"),
        ({("server", "receive_queue_bytes"): 0}, "server.receive_queue_bytes: must be positive"),
        ({("server", "status_interval"): 0}, "server.status_interval: must be positive"),
        ({("server", "control_interval"): -0.1}, "server.control_interval: must be positive"),
        (
            {("buffer", "capacity_samples"): None},
            "buffer.capacity_samples: give capacity_samples, capacity_bytes or both",
        ),
        ({("buffer", "capacity_samples"): 0}, "buffer.capacity_samples: must be positive"),
        ({("buffer", "capacity_bytes"): 0}, "buffer.capacity_bytes: must be positive"),
        ({("buffer", "per_server_watermark"): 0}, "buffer.per_server_watermark: must be at least 1"),
        (
            {("buffer", "capacity_samples"): 10, ("buffer", "per_server_watermark"): 11},
            "buffer.per_server_watermark: 11 is above capacity_samples=10",
        ),
        ({("buffer", "pseudo_epochs"): 0}, "buffer.pseudo_epochs: must be at least 1"),
        ({("launcher", "command"): []}, "launcher.command: must not be empty"),
        (
            {("launcher", "scheduler"): "mpirun", ("launcher", "client_ranks"): 0},
            "launcher.client_ranks: must be at least 1",
        ),
        (
            {("launcher", "client_ranks"): 2},
            "launcher.client_ranks: more than one client rank needs scheduler 'mpirun', 'slurm' or 'srun'",
        ),
        ({("launcher", "job_limit"): 0}, "launcher.job_limit: must be at least 1"),
        ({("launcher", "simulation_timeout"): 0}, "launcher.simulation_timeout: must be positive"),
        ({("launcher", "max_retries"): -1}, "launcher.max_retries: must not be negative"),
        *(
            ({("launcher", "client_timeout"): value}, "launcher.client_timeout: must be between 0.001 and 1e+06")
            for value in (0, 0.0001, 1000000.5, 1e308, float("inf"), float("nan"))
        ),
        *(
            ({("launcher", "send_queue_bytes"): value}, "launcher.send_queue_bytes: must be between 1 and 1e+18")
            for value in (0, 10**18 + 1)
        ),
        ({("checkpoint", "seconds"): float("nan")}, "checkpoint.seconds: must not be negative"),
    ],
)
def test_inconsistent_values_are_refused(changes: dict, expected: str) -> None:
    refused(edited(changes), expected)


@pytest.mark.parametrize(
    "changes",
    [
        {("buffer", "capacity_samples"): 10, ("buffer", "per_server_watermark"): 10},
        {
            ("buffer", "capacity_samples"): None,
            ("buffer", "capacity_bytes"): MiB,
            ("buffer", "per_server_watermark"): 5000,
        },
        {("launcher", "scheduler"): "mpirun", ("launcher", "client_ranks"): 4},
        {("study", "sampler"): "list", ("study", "parameter_values"): [[0, 0], [1, 2]]},
        {("study", "parameters", 0, "high"): 0},  # low == high: a fixed parameter
        {("launcher", "max_retries"): 0, ("server", "handshake_port"): 65535, ("study", "time_steps"): (1 << 32) - 1},
        {("launcher", "client_timeout"): 0.001, ("launcher", "send_queue_bytes"): 1},
        {("launcher", "client_timeout"): 1e6, ("launcher", "send_queue_bytes"): 10**18},
        {("study", "simulations"): (1 << 31) - 1, ("study", "validation", "simulations"): 1},
    ],
)
def test_boundary_values_are_accepted(changes: dict) -> None:
    config = parse_config(edited(changes), BASE)
    assert config.to_dict() == parse_config(config.to_dict(), BASE).to_dict()


def test_negative_study_seed_is_refused() -> None:
    with pytest.raises(ValueError):
        np.random.default_rng(-1)  # what the uniform sampler does with it at start-up
    refused(edited({("study", "seed"): -1}), "study.seed")


def write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def test_load_config_resolves_paths_against_the_file_folder(tmp_path: Path) -> None:
    path = write(tmp_path / "study.json", json.dumps(edited({("output_dir",): "results"})))
    config = load_config(path)
    assert config.base_dir == tmp_path.resolve()
    assert config.output_path == tmp_path.resolve() / "results"


def test_load_config_names_line_and_column_of_invalid_json(tmp_path: Path) -> None:
    path = write(tmp_path / "study.json", '{\n  "study": {\n    "fields": [,]\n  }\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith("invalid JSON at line 3 column 16")  # the caller names the file


def test_load_config_on_a_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.json"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == "cannot read (No such file or directory)"  # the caller names the file


def test_load_config_on_a_file_that_is_not_text(tmp_path: Path) -> None:
    path = write(tmp_path / "study.json", b'\xff\xfe{"study": 1}')
    with pytest.raises(ConfigError, match="^not UTF-8 text"):
        load_config(path)


def test_digest_identifies_the_resolved_values() -> None:
    config = parse_config(edited({}), BASE)
    digest = config.digest()
    assert len(digest) == 16 and int(digest, 16) >= 0
    assert parse_config(edited({}), Path("/elsewhere")).digest() == digest  # base_dir is not part of it
    assert parse_config(edited({("server", "status_interval"): 5}), BASE).digest() == digest  # 5 == default 5.0
    assert parse_config(edited({("launcher", "job_limit"): 4}), BASE).digest() == digest  # explicit default
    for changes in ({("study", "seed"): 1}, {("study", "fields"): ["v"]}, {("launcher", "env"): {"A": "1"}}):
        assert parse_config(edited(changes), BASE).digest() != digest


def test_to_dict_round_trips_through_parse_config() -> None:
    data = edited(
        {
            ("study", "sampler"): "list",
            ("study", "parameter_values"): [[0, 0.5], [1, 2]],
            ("study", "time_steps"): 100,
            ("server", "bind_simulation_to_server_rank"): True,
            ("buffer", "kind"): "reservoir",
            ("buffer", "capacity_bytes"): 8 * MiB,
            ("launcher", "scheduler"): "mpirun",
            ("launcher", "client_ranks"): 2,
            ("launcher", "env"): {"OMP_NUM_THREADS": "1"},
        }
    )
    config = parse_config(data, BASE)
    plain = config.to_dict()
    assert "base_dir" not in plain
    assert plain["study"]["parameters"][1] == {"name": "b", "low": 0.0, "high": 2.0}
    again = parse_config(json.loads(json.dumps(plain)), BASE)
    assert again == config
    assert isinstance(again, Config)


def test_fields_may_pin_their_dtype_and_shape() -> None:
    fields = {"u": {"dtype": "float32", "shape": [16, 32]}, "v": {"dtype": "int64", "shape": []}}
    study = parse_config(edited({("study", "fields"): fields}), BASE).study
    assert study.field_names == ["u", "v"]
    assert study.field_layouts == {"u": ("float32", (16, 32)), "v": ("int64", ())}
    assert parse_config(edited({}), BASE).study.field_layouts == {}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"u": {"dtype": "complex64", "shape": [2]}}, "study.fields.u.dtype: expected one of"),
        ({"u": {"dtype": "float32"}}, "study.fields.u.shape: missing required key"),
        ({"u": {"dtype": "float32", "shape": [1, 2, 3, 4, 5, 6, 7]}}, "study.fields.u.shape: at most 6 dimensions"),
        ({"u": {"dtype": "float32", "shape": [-1]}}, "study.fields.u.shape: at most 6 dimensions"),
    ],
)
def test_pinned_field_layouts_are_checked(fields: dict[str, Any], message: str) -> None:
    refused(edited({("study", "fields"): fields}), message)


def test_every_section_that_checks_itself_is_found_without_a_list() -> None:
    """``check(config)`` on every dataclass of the config that has one; a section added elsewhere (a scheduler's
    options, read when given or chosen) is checked as well, with no line in the config module."""
    from launcher.slurm import SlurmOptions
    from melissa_dl.config import sections as config_module

    config = parse_config(edited({("launcher", "slurm"): {}}), BASE)
    window = config_module.WindowConfig(inputs=2)  # optional sections
    config.training = config_module.TrainingConfig(module="model.py", class_name="Model", window=window)
    reached = {type(section) for section in config_module.sections(config)}
    checking = {
        cls
        for cls in vars(config_module).values()
        if isinstance(cls, type) and dataclasses.is_dataclass(cls) and callable(getattr(cls, "check", None))
    }
    assert checking and checking <= reached
    assert SlurmOptions in reached


def test_a_new_sections_check_runs_and_names_its_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from launcher.slurm import SlurmOptions

    def check(self: SlurmOptions, config: Config) -> None:
        if self.partition == "nowhere":
            raise ConfigError("launcher.slurm.partition: no such partition")

    monkeypatch.setattr(SlurmOptions, "check", check, raising=False)
    refused(edited({("launcher", "slurm", "partition"): "nowhere"}), "launcher.slurm.partition: no such partition")
    assert parse_config(edited({("launcher", "slurm", "partition"): "short"}), BASE).launcher.scheduler == "local"


def test_the_bounds_of_the_clients_environment_are_the_c_librarys() -> None:
    """The configuration refuses what a client would: the C library's ``env_number`` calls state the bounds
    that ``melissa_dl.config.limits`` holds for the configuration and the Python client."""
    source = (Path(__file__).resolve().parents[3] / "native" / "src" / "client.c").read_text()
    calls = re.findall(r'env_number\("(MELISSA_\w+)", [^,]+, ([^,]+), ([^,]+), (?:true|false),', source)
    bounds = {name: (float(low), float(high.replace("INT32_MAX", str(2**31 - 1)))) for name, low, high in calls}
    assert bounds == {
        "MELISSA_SIMULATION_ID": (0, MAX_SIMULATION_ID),
        "MELISSA_ATTEMPT": (0, MAX_SIMULATION_ID),
        "MELISSA_CLIENT_TIMEOUT": CLIENT_TIMEOUT_RANGE,
        "MELISSA_SEND_QUEUE_BYTES": SEND_QUEUE_BYTES_RANGE,
    }


@pytest.mark.parametrize(
    "name, value, expected",
    [
        (ENV_CLIENT_TIMEOUT, "inf", "a number in [0.001, 1e+06]"),
        (ENV_CLIENT_TIMEOUT, "1e308", "a number in [0.001, 1e+06]"),
        (ENV_CLIENT_TIMEOUT, "0.0001", "a number in [0.001, 1e+06]"),
        (ENV_CLIENT_TIMEOUT, "soon", "a number in [0.001, 1e+06]"),
        (ENV_SEND_QUEUE_BYTES, "0", "an integer in [1, 1e+18]"),
        (ENV_SEND_QUEUE_BYTES, "1.5", "an integer in [1, 1e+18]"),
    ],
)
def test_the_python_client_refuses_what_the_configuration_refuses_in_one_line(
    name: str, value: str, expected: str
) -> None:
    """A client started by hand with a bad environment: a ``ClientError`` before any socket, as the C library's
    ``MELISSA_DL_ERR_ENVIRONMENT``, not an ``OverflowError`` deep in ZeroMQ."""
    environ = {ENV_SIMULATION_ID: "0", ENV_PARAMETERS: "[0.5]", ENV_TOKEN: "00", name: value}
    with pytest.raises(ClientError) as info:
        Client({"u": ("float32", (4,))}, environ=environ)
    assert str(info.value) == f"{name}={value!r} is not {expected}"


@pytest.mark.parametrize(
    "window, changes, message",
    [
        ({"inputs": 4, "targets": 1, "block": 4}, {}, "training.window.block: 4 is shorter than a window (5)"),
        (
            {"inputs": 4},
            {("study", "time_steps"): 3},
            "training.window: a window of 5 steps is longer than the simulations (study.time_steps=3)",
        ),
        ({"inputs": 4}, {("study", "sampler"): "adaptive"}, "training.window: the adaptive sampler learns"),
        ({"inputs": 0}, {}, "training.window.inputs: must be at least 1"),
        ({"targets": 1}, {}, "training.window.inputs: missing required key"),
    ],
)
def test_windows_are_checked(tmp_path: Path, window: dict[str, Any], changes: dict, message: str) -> None:
    (tmp_path / "m.py").write_text("")
    data = edited({("training",): {"module": "m.py", "class_name": "M", "window": window}, **changes})
    with pytest.raises(ConfigError) as info:
        parse_config(data, tmp_path)
    assert str(info.value).startswith(message)


def test_a_window_is_its_inputs_and_targets_and_routes_its_steps_to_one_rank(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text("")
    window = {"inputs": 3, "targets": 2, "stride": 2, "block": 16}
    config = parse_config(edited({("training",): {"module": "m.py", "class_name": "M", "window": window}}), tmp_path)
    assert config.training is not None and config.training.window is not None
    assert (config.training.window.length, config.training.window.routing) == (5, {"block": 16, "overlap": 4})
