"""``melissa-server --try-simulation config.json``: one simulation against a throwaway local server.

The quickest way to debug a simulation's instrumentation before a long
study: it runs the study's command once (the first parameter set, or given
ones) on this machine, receives what it sends through the same handshake,
receiver and checks as a study's (on one rank, no MPI), and prints what
arrived: the steps, each field's dtype, shape and min/max/mean, and any
error (refused frames, missing or repeated steps, the exit code and the end
of the simulation's output). Nothing is trained and no checkpoint is written.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from launcher import Launcher
from melissa_dl.buffers.kinds import make_buffer
from melissa_dl.buffers.sample import Sample
from melissa_dl.config.sections import Config
from melissa_dl.ingest.assembly import StreamSpec
from melissa_dl.ingest.handshake import HandshakeServer
from melissa_dl.ingest.receiver import Receiver
from melissa_dl.study.jobs import placeholders_from_config, scheduler_from_config
from melissa_dl.study.sampling import sampler_from_config
from melissa_dl.study.study import EXIT_GRACE, simulation_environment
from melissa_dl.wire.security import Security

POLL = 0.05  # seconds between two looks at the buffer and the job
HOST = "127.0.0.1"
LOGS = "try-simulation"  # folder of the output directory holding a folder per try, with its simulation's log


def _own_folder(logs: Path) -> Path:
    """This try's log folder: ``try-simulation/1``, ``2``, ... (a log per try, the latest numbered highest)."""
    tries = [int(path.name) for path in logs.iterdir() if path.name.isdigit()] if logs.is_dir() else []
    return logs / str(max(tries, default=0) + 1)


@dataclass
class FieldSummary:
    dtype: str
    shape: tuple[int, ...]
    low: float = np.inf
    high: float = -np.inf
    total: float = 0.0
    values: int = 0

    def add(self, array: np.ndarray) -> None:
        self.low, self.high = min(self.low, float(array.min())), max(self.high, float(array.max()))
        self.total += float(array.sum(dtype=np.float64))
        self.values += array.size


@dataclass
class Trial:
    """What one simulation sent, and what went wrong."""

    parameters: list[float]
    steps: list[int] = field(default_factory=list)
    fields: dict[str, FieldSummary] = field(default_factory=dict)
    layouts: set[tuple[str, str, tuple[int, ...]]] = field(default_factory=set)  # field, dtype, shape seen
    exit_code: int | None = None
    announced: int | None = None  # steps the client announced in finalize
    problems: list[str] = field(default_factory=list)
    log: Path | None = None

    def take(self, sample: Sample) -> None:
        self.steps.append(sample.time_step)
        for name, array in sample.fields.items():
            self.layouts.add((name, array.dtype.name, array.shape))
            summary = self.fields.setdefault(name, FieldSummary(array.dtype.name, array.shape))
            summary.add(array)


def try_simulation(config: Config, parameters: list[float] | None = None, timeout: float | None = None) -> Trial:
    """Run simulation 0 of ``config`` (with ``parameters`` if given) against a local one-rank server."""
    table = (
        sampler_from_config(config.study, 1, config.base_dir).ask(1)
        if parameters is None  # the study's first
        else np.array([parameters], dtype=np.float64)
    )
    token = secrets.token_bytes(32)
    security = Security.generate(config.server.security, token, config.launcher.client_timeout)
    buffer = make_buffer("fifo", capacity_samples=1024, capacity_bytes=None, watermark=1, seed=0)
    spec = StreamSpec.from_config(config.server, config.study, table, token, 0, 1)
    receiver = Receiver.from_config(config.server, spec, buffer, HOST, security)
    receiver.start_and_bind()
    handshake = HandshakeServer.from_config(
        config.server, config.study, config.launcher, token, [receiver.endpoints(HOST)], HOST, security
    )
    trial = Trial(table[0].tolist())
    scheduler = "mpirun" if config.launcher.client_ranks > 1 else "local"  # here, not through a batch system
    launcher = Launcher(
        scheduler_from_config(config, scheduler),
        1,
        _own_folder(config.output_path / LOGS),
        placeholders_from_config(config),
    )
    try:
        server = f"tcp://{HOST}:{handshake.start_and_bind()}"
        handshake.expect(0, 0)
        launcher.submit(
            0,
            0,
            simulation_environment(
                config.launcher, server, token, security, 0, 0, table[0], config.study.parameter_names
            ),
            dict(zip(config.study.parameter_names, table[0].tolist())),
        )
        _follow(trial, launcher, receiver, handshake, timeout or config.launcher.simulation_timeout)
        trial.log = launcher.log_path(0, 0)
        _judge(trial, config, receiver, launcher.output_tail(0, 0))
    finally:
        launcher.shutdown()
        handshake.stop()
        receiver.stop()
    return trial


def _follow(trial: Trial, launcher: Launcher, receiver: Receiver, handshake: HandshakeServer, timeout: float) -> None:
    """Collect what arrives until the job has ended and its last frames are in, or it stays silent too long."""
    ended_at = None
    last_activity = time.monotonic()
    while True:
        receiver.check()
        while sample := receiver.buffer.get_batch(1, timeout=POLL):
            assert isinstance(sample[0], Sample)  # its buffer takes steps, not windows
            trial.take(sample[0])
            last_activity = time.monotonic()
        report = receiver.report()
        if report.active:
            last_activity = time.monotonic()
        if report.progress.get(0) is not None and report.progress[0].expected is not None:
            trial.announced = report.progress[0].expected
        if report.refused:
            trial.problems.append(f"frames refused: {report.refused[0][1]}")
        trial.problems += [f"handshake refused: {reason}" for _, reason in handshake.take_failures()]
        for _, code in launcher.poll():
            trial.exit_code, ended_at = code, time.monotonic()
        now = time.monotonic()
        if ended_at is not None and (now - ended_at > EXIT_GRACE or len(trial.steps) == trial.announced):
            return
        if ended_at is None and now - last_activity > timeout:
            launcher.kill(0)
            trial.problems.append(f"no data for {timeout:g} s: killed")
            return


def _judge(trial: Trial, config: Config, receiver: Receiver, output: str) -> None:
    """What a study would hold against this simulation."""
    steps = sorted(trial.steps)
    if trial.exit_code not in (0, None):
        trial.problems.append(f"exit code {trial.exit_code}" + (f"; output: {output}" if output else ""))
    if trial.exit_code == 0 and trial.announced is None:
        trial.problems.append("exited 0 without finalize")
    if trial.announced is not None and len(steps) != trial.announced:
        trial.problems.append(f"finalize announced {trial.announced} steps, {len(steps)} arrived whole")
    if steps and steps != list(range(steps[-1] + 1)):
        missing = sorted(set(range(steps[-1] + 1)) - set(steps))
        trial.problems.append(f"steps are not numbered 0, 1, 2, ...: missing {missing[:10]}")
    if config.study.time_steps is not None and len(steps) != config.study.time_steps:
        trial.problems.append(f"{len(steps)} steps arrived, study.time_steps is {config.study.time_steps}")
    for name in config.study.field_names:
        layouts = {(dtype, shape) for field_name, dtype, shape in trial.layouts if field_name == name}
        if len(layouts) > 1:
            trial.problems.append(f"field '{name}' changed layout between steps: {sorted(layouts)}")
    if not steps:
        trial.problems.append("no step arrived whole")
    rejected = receiver.report().rejected
    if rejected:
        trial.problems.append(f"refused by kind: {rejected}")


def describe(trial: Trial) -> str:
    """The trial as the lines ``--try-simulation`` prints."""
    steps = sorted(trial.steps)
    lines = [
        f"simulation 0 with parameters {trial.parameters}: exit code {trial.exit_code}, log {trial.log}",
        f"steps: {len(steps)} arrived" + (f" ({steps[0]} to {steps[-1]})" if steps else ""),
    ]
    for name, summary in trial.fields.items():
        mean = summary.total / summary.values if summary.values else float("nan")
        lines.append(
            f"field '{name}': {summary.dtype}{list(summary.shape)}, min {summary.low:.6g}, "
            f"max {summary.high:.6g}, mean {mean:.6g}"
        )
    lines += [f"problem: {problem}" for problem in trial.problems] or ["no problem found"]
    return "\n".join(lines)
