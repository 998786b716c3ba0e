"""The study configuration: one JSON file loaded into typed dataclasses.

Every field carries its documentation in ``metadata["doc"]`` so that the
README reference and ``melissa-server --check`` come from one place. The
loader walks the dataclasses' type hints, so a new option is one line here;
every mistake is reported as a ``ConfigError`` naming its JSON path.
"""
from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from melissa_dl.errors import ConfigError
from melissa_dl.protocol import DTYPES, MAX_NDIM

MiB = 1 << 20


def option(default: Any = dataclasses.MISSING, doc: str = "") -> Any:
    """A dataclass field with its documentation; a class or a container as
    default becomes a factory so that no two configs share it."""
    if isinstance(default, type):
        return field(default_factory=default, metadata={"doc": doc})
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc})
    return field(default=default, metadata={"doc": doc})


@dataclass
class ParameterConfig:
    name: str = option(doc="Name of the parameter, as the simulation knows it.")
    low: float = option(doc="Lower bound of the sweep.")
    high: float = option(doc="Upper bound of the sweep.")


@dataclass
class FieldConfig:
    dtype: Literal[DTYPES] = option(doc="Element type of the field.")
    shape: list[int] = option(doc="Shape of the whole field (an MPI client's slices joined on axis 0).")


@dataclass
class StudyConfig:
    fields: list[str] | dict[str, FieldConfig] = option(
        doc="Names of the fields every time step carries; or an object `name: {dtype, shape}` that pins each "
        "field's layout. Unpinned fields are pinned by the first simulation admitted; a simulation declaring "
        "another dtype or shape is refused and fails at once."
    )
    parameters: list[ParameterConfig] = option(doc="The swept parameters and their bounds.")
    simulations: int = option(doc="Number of simulations (parameter sets) in the study.")
    sampler: Literal["uniform", "sobol", "list"] = option(
        "uniform", doc="How parameter sets are drawn: uniform random, scrambled Sobol, or `parameter_values`."
    )
    parameter_values: list[list[float]] | None = option(
        None, doc="Explicit parameter sets, one row per simulation (sampler `list`)."
    )
    time_steps: int | None = option(
        None, doc="Time steps each simulation sends, if known: larger steps are refused and the report checks the total."
    )
    seed: int = option(0, doc="Seed of the parameter sampler.")

    @property
    def field_names(self) -> list[str]:
        return list(self.fields)

    @property
    def field_layouts(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """The layouts pinned by the configuration (none when ``fields`` is a list of names)."""
        if isinstance(self.fields, list):
            return {}
        return {name: (f.dtype, tuple(f.shape)) for name, f in self.fields.items()}


@dataclass
class ServerConfig:
    interface: str = option(
        "127.0.0.1", doc="Address the server binds and advertises; `*` binds all and advertises the host name."
    )
    handshake_port: int = option(0, doc="Port of rank 0's handshake socket; 0 picks a free one.")
    bind_simulation_to_server_rank: bool = option(
        False, doc="Send every step of simulation s to rank s mod K instead of (s + t) mod K."
    )
    max_message_bytes: int = option(64 * MiB, doc="Largest accepted field slice; larger frames are refused.")
    security: Literal["token", "curve"] = option(
        "token", doc="`token`: only peers holding the study's token connect (ZeroMQ PLAIN, not encrypted); "
        "`curve`: CURVE encryption and authentication with keys drawn per study (README, Security)."
    )
    receive_queue_bytes: int = option(
        256 * MiB, doc="Memory ZeroMQ may queue per client connection on each rank (sets the high-water mark)."
    )
    reject_non_finite: bool = option(True, doc="Refuse floating-point fields holding NaN or infinity.")
    max_partial_bytes: int = option(
        256 * MiB, doc="Memory each rank gives to steps still missing a field or a client rank's slice; beyond it "
        "the oldest incomplete step is dropped and counted as refused (`incomplete`)."
    )
    status_interval: float = option(5.0, doc="Seconds between two status lines of rank 0.")
    control_interval: float = option(0.2, doc="Seconds between two synchronisations of the ranks' bookkeeping.")


@dataclass
class BufferConfig:
    kind: Literal["fifo", "firo", "reservoir"] = option("fifo", doc="Buffer policy (see README).")
    capacity_samples: int | None = option(1000, doc="Samples a rank's buffer holds at most.")
    capacity_bytes: int | None = option(None, doc="Bytes a rank's buffer holds at most.")
    per_server_watermark: int = option(1, doc="Samples a rank must receive before it serves any.")
    pseudo_epochs: int = option(1, doc="FIRO: times a sample is served before it is removed.")
    seed: int = option(0, doc="Seed of the buffer's random choices (rank r uses seed + r).")


@dataclass
class SlurmConfig:
    partition: str | None = option(None, doc="`sbatch --partition` of each simulation's job (default: Slurm's).")
    time_limit: str | None = option(None, doc="`sbatch --time` of each simulation's job, e.g. `\"00:30:00\"`.")
    account: str | None = option(None, doc="`sbatch --account` of each simulation's job.")
    sbatch_args: list[str] = option([], doc="More `sbatch` arguments of each simulation's job, e.g. "
                                    "`[\"--mem=4G\", \"--qos=short\"]`.")


@dataclass
class LauncherConfig:
    command: list[str] = option(doc="Command line of one simulation, run from the config file's folder.")
    scheduler: Literal["local", "mpirun", "slurm"] = option(
        "local", doc="`local`: one subprocess per simulation; `mpirun`: `mpirun -n client_ranks command`; "
        "`slurm`: one `sbatch` job per simulation attempt, running `srun --mpi=pmi2 -n client_ranks command`."
    )
    client_ranks: int = option(
        1, doc="MPI ranks of each simulation (scheduler `mpirun` or `slurm`); a hello of another client size is "
        "refused."
    )
    slurm: SlurmConfig = option(SlurmConfig, doc="Options of each simulation's job (scheduler `slurm`).")
    job_limit: int = option(4, doc="Simulations running at once.")
    simulation_timeout: float = option(
        300.0, doc="Seconds without data from a running simulation before it is killed and relaunched."
    )
    max_retries: int = option(2, doc="Relaunches of a failed simulation before it is reported failed.")
    client_timeout: float = option(
        300.0, doc="Seconds a client waits for an unreachable server (no connection, no heartbeat) before failing; "
        "back-pressure is waited out however long."
    )
    send_queue_bytes: int = option(64 * MiB, doc="Memory ZeroMQ may queue in each client rank per server rank.")
    env: dict[str, str] = option({}, doc="Extra environment variables of the simulations.")
    server_timeout: float = option(
        600.0, doc="`melissa-launcher`: seconds without a heartbeat of the server before it is killed and restarted."
    )
    max_server_restarts: int = option(3, doc="`melissa-launcher`: restarts of a dead server before giving up.")


@dataclass
class TrainingConfig:
    module: str = option(doc="Python file defining the TrainingModule, relative to the config file.")
    class_name: str = option(doc="Name of the TrainingModule subclass in that file.")
    options: dict[str, Any] = option({}, doc="Keyword arguments of the class's constructor.")
    batch_size: int = option(32, doc="Samples per batch on each rank.")
    nb_batches_update: int = option(100, doc="Batches between two validations.")
    log_interval: int = option(10, doc="Batches between two TensorBoard points of the training scalars.")
    validation_batch_size: int = option(256, doc="Samples per validation batch.")
    device: Literal["auto", "cpu", "cuda"] = option("auto", doc="`auto`: CUDA when available (one GPU per rank).")
    seed: int = option(0, doc="Seed of torch on every rank, so that all replicas start identical.")
    stall_timeout: float = option(
        120.0,
        doc="Seconds a rank may lack data while another rank's buffer is full before the job stops with an error.",
    )
    checkpoint_interval: int = option(
        500, doc="Batches between two checkpoints (one is also written at the end); 0 writes only the last."
    )
    keep_checkpoints: int = option(3, doc="Committed checkpoint versions kept on disk; older ones are deleted.")


@dataclass
class Config:
    study: StudyConfig = option(doc="What the study computes.")
    launcher: LauncherConfig = option(doc="How simulations are started.")
    server: ServerConfig = option(ServerConfig, doc="The server's sockets and bookkeeping.")
    buffer: BufferConfig = option(BufferConfig, doc="Each rank's sample buffer.")
    training: TrainingConfig | None = option(None, doc="What to train; without it the server only receives and drains.")
    output_dir: str = option("output", doc="Folder of logs, reports and checkpoints, relative to the config file.")
    base_dir: Path = field(default=Path("."), metadata={"internal": True})

    @property
    def output_path(self) -> Path:
        return self.base_dir / self.output_dir

    def to_dict(self) -> dict[str, Any]:
        """The resolved configuration as JSON-ready data (internal fields left out)."""
        return _to_plain(self)

    def digest(self) -> str:
        """Identifies a configuration, so a checkpoint can tell what produced it."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {
            f.name: _to_plain(getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not f.metadata.get("internal")
        }
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(json.dumps(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return "a list"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "an object"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}.get(
        tp, str(tp)
    )


def _json_kind(tp: Any) -> type | None:
    """The JSON container a type is read from, if any."""
    origin = typing.get_origin(tp)
    if origin is list:
        return list
    if origin is dict or dataclasses.is_dataclass(tp):
        return dict
    return None


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check ``value`` against the type ``tp`` and build it; ``path`` names it in errors."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(arms) < len(typing.get_args(tp)):
            return None
        if len(arms) == 1:  # X | None: report X's own error, with its deeper path
            return _convert(arms[0], value, path)
        for arg in arms:
            try:
                return _convert(arg, value, path)
            except ConfigError:
                if _json_kind(arg) == type(value):
                    raise  # the value has this arm's shape: its error names the culprit best
                continue
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
    elif origin is list:
        if isinstance(value, list):
            (item,) = typing.get_args(tp)
            return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    elif origin is dict:
        if isinstance(value, dict):
            _, item = typing.get_args(tp)
            return {k: _convert(item, v, f"{path}.{k}") for k, v in value.items()}
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return _build(tp, value, path)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise ConfigError(f"{path}: expected {_type_name(tp)}, got {json.dumps(value)}")


def _build(cls: type, data: dict[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}
    prefix = f"{path}." if path else ""
    for key in data:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"{prefix}{key}: unknown key{hint}")
    kwargs = {}
    for name, f in known.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], prefix + name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ConfigError(f"{prefix}{name}: missing required key")
    return cls(**kwargs)


def _require(condition: bool, path: str, message: str) -> None:
    if not condition:
        raise ConfigError(f"{path}: {message}")


def _check(config: Config) -> None:
    """Refuse values that are well typed but inconsistent."""
    study, server, buffer, launcher = config.study, config.server, config.buffer, config.launcher
    _require(len(study.fields) > 0, "study.fields", "at least one field is needed")
    _require(len(set(study.fields)) == len(study.fields), "study.fields", "field names must be unique")
    _require(len(study.fields) < 1 << 16, "study.fields", "at most 65535 fields")
    for name, (_, shape) in study.field_layouts.items():
        _require(len(shape) <= MAX_NDIM and all(0 <= n < 1 << 32 for n in shape), f"study.fields.{name}.shape",
                 f"at most {MAX_NDIM} dimensions of 0 to 2**32 - 1")
    _require(server.max_partial_bytes > 0, "server.max_partial_bytes", "must be positive")
    _require(len(study.parameters) > 0, "study.parameters", "at least one parameter is needed")
    for i, p in enumerate(study.parameters):
        _require(p.low <= p.high, f"study.parameters[{i}].high", f"{p.high} is below low={p.low}")
    _require(0 < study.simulations < 1 << 32, "study.simulations", "must be between 1 and 2**32 - 1")
    if study.sampler == "list":
        _require(study.parameter_values is not None, "study.parameter_values", "required by sampler 'list'")
    if study.parameter_values is not None:
        _require(study.sampler == "list", "study.parameter_values", "only used with sampler 'list'")
        _require(
            len(study.parameter_values) == study.simulations,
            "study.parameter_values",
            f"{len(study.parameter_values)} rows for {study.simulations} simulations",
        )
        for i, row in enumerate(study.parameter_values):
            _require(
                len(row) == len(study.parameters),
                f"study.parameter_values[{i}]",
                f"{len(row)} values for {len(study.parameters)} parameters",
            )
    _require(study.seed >= 0, "study.seed", "must not be negative")
    if study.time_steps is not None:
        _require(0 < study.time_steps < 1 << 32, "study.time_steps", "must be between 1 and 2**32 - 1")
    _require(0 <= server.handshake_port < 1 << 16, "server.handshake_port", "not a port number")
    _require(server.max_message_bytes > 0, "server.max_message_bytes", "must be positive")
    _require(server.receive_queue_bytes > 0, "server.receive_queue_bytes", "must be positive")
    _require(server.status_interval > 0, "server.status_interval", "must be positive")
    _require(server.control_interval > 0, "server.control_interval", "must be positive")
    _require(
        buffer.capacity_samples is not None or buffer.capacity_bytes is not None,
        "buffer.capacity_samples",
        "give capacity_samples, capacity_bytes or both",
    )
    for key in ("capacity_samples", "capacity_bytes"):
        value = getattr(buffer, key)
        _require(value is None or value > 0, f"buffer.{key}", "must be positive")
    _require(buffer.per_server_watermark >= 1, "buffer.per_server_watermark", "must be at least 1")
    if buffer.capacity_samples is not None:
        _require(
            buffer.per_server_watermark <= buffer.capacity_samples,
            "buffer.per_server_watermark",
            f"{buffer.per_server_watermark} is above capacity_samples={buffer.capacity_samples}",
        )
    _require(buffer.pseudo_epochs >= 1, "buffer.pseudo_epochs", "must be at least 1")
    training = config.training
    if training is not None:
        _require(training.batch_size >= 1, "training.batch_size", "must be at least 1")
        if buffer.capacity_samples is not None:
            _require(
                training.batch_size <= buffer.capacity_samples,
                "training.batch_size",
                f"{training.batch_size} is above buffer.capacity_samples={buffer.capacity_samples}",
            )
        _require(training.stall_timeout > 0, "training.stall_timeout", "must be positive")
        _require((config.base_dir / training.module).is_file(), "training.module", f"no file {training.module}")
        for key in ("nb_batches_update", "log_interval", "validation_batch_size", "keep_checkpoints"):
            _require(getattr(training, key) >= 1, f"training.{key}", "must be at least 1")
        _require(training.checkpoint_interval >= 0, "training.checkpoint_interval", "must not be negative")
    _require(len(launcher.command) > 0, "launcher.command", "must not be empty")
    _require(launcher.client_ranks >= 1, "launcher.client_ranks", "must be at least 1")
    _require(
        launcher.scheduler != "local" or launcher.client_ranks == 1,
        "launcher.client_ranks",
        "more than one client rank needs scheduler 'mpirun' or 'slurm'",
    )
    _require(launcher.job_limit >= 1, "launcher.job_limit", "must be at least 1")
    _require(launcher.simulation_timeout > 0, "launcher.simulation_timeout", "must be positive")
    _require(launcher.max_retries >= 0, "launcher.max_retries", "must not be negative")
    _require(launcher.client_timeout > 0, "launcher.client_timeout", "must be positive")
    _require(launcher.send_queue_bytes > 0, "launcher.send_queue_bytes", "must be positive")
    _require(launcher.server_timeout > 0, "launcher.server_timeout", "must be positive")
    _require(launcher.max_server_restarts >= 0, "launcher.max_server_restarts", "must not be negative")


def parse_config(data: Any, base_dir: Path) -> Config:
    """Build and check a Config from decoded JSON."""
    if not isinstance(data, dict):
        raise ConfigError("(top level): expected an object")
    config = _build(Config, data, "")
    config.base_dir = base_dir
    _check(config)
    return config


def load_config(path: str | Path) -> Config:
    """Read a JSON config file; relative paths in it are relative to its folder."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise ConfigError(f"{path}: cannot read ({error.strerror})") from None
    except UnicodeDecodeError as error:
        raise ConfigError(f"{path}: not UTF-8 text ({error.reason} at byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: invalid JSON at line {error.lineno} column {error.colno}: {error.msg}") from None
    return parse_config(data, path.resolve().parent)
