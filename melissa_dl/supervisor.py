"""``melissa-launcher config.json``: run the server under mpirun (srun inside a Slurm allocation) and restart
it when it dies.

The server (``mpirun -n K melissa-server config.json``) runs in its own
session. It is restarted from its checkpoints, up to
``launcher.max_server_restarts`` times, when it exits with an unexpected code
(a crash, a killed rank) or when rank 0 has not touched the heartbeat file
for ``launcher.server_timeout`` seconds (a hung rank). A run's start, until
its first bookkeeping round touches the file, may take ``START_TIMEOUT`` if
that is longer: importing torch from a cluster's shared filesystem, MPI's
start and a restore are slow, not hung, and a busy node makes them slower
still (a restarted server whose start took longer than a 30 s timeout was
killed at every restart). Exit codes that a
restart cannot change end the supervisor with the same code: 0 (done),
2 (configuration, or an output folder that is full or not writable), 3
(simulations failed), 75 (stopped by a signal). So does a restarted server
that fails with the same error as the run before (the cause its failing rank
recorded, ``status.FAILURE``: type, message and the line that raised it), in
one line naming it: the first restart is always made, for a transient failure.

Before each restart every process of the dead run is killed: each run's
processes (mpirun, the server ranks and the simulations they started, which
inherit the server's environment) carry a marker variable, so none is left
running and no two servers ever work on the same study. SIGTERM or SIGINT to
the supervisor is passed on to the server, which checkpoints and stops (as
SIGUSR1 through ``srun``, which kills its tasks on SIGTERM); one that comes
while a server is being started reaches that server. After a stop
the supervisor exits 75, whatever the code of a server stopped before its ranks
could checkpoint (mpirun's own, 128 + the signal), unless the study had ended
(0, 2, 3).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from launcher.schedulers import RUN_MARKER, die_with_parent, venv_mpirun
from melissa_dl.config.registry import SCHEDULERS, load
from melissa_dl.config.sections import load_config
from melissa_dl.errors import ConfigError
from melissa_dl.runtime.files import check_writable
from melissa_dl.runtime.mpi import STOP_SIGNALS
from melissa_dl.runtime.status import (
    EXIT_CONFIG,
    EXIT_FAILED_SIMULATIONS,
    EXIT_STOPPED,
    FAILURE,
    HEARTBEAT,
    read_failure,
)
from melissa_dl.study.jobs import check_settings

logger = logging.getLogger("melissa-launcher")

ENDED_CODES = frozenset({0, EXIT_CONFIG, EXIT_FAILED_SIMULATIONS})  # neither a restart nor a stop changes them
POLL = 0.5  # seconds between two looks at the server
START_TIMEOUT = 300.0  # seconds a run may take to its first heartbeat, if launcher.server_timeout is shorter


def marked_processes(marker: str) -> list[int]:
    """Pids of the processes whose environment holds ``RUN_MARKER=marker`` (Linux /proc)."""
    needle = f"{RUN_MARKER}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone, or not ours
            continue
        if needle in environ.split(b"\0"):
            pids.append(int(entry.name))
    return pids


def kill_run(marker: str, timeout: float = 30.0) -> None:
    """SIGKILL every process of one run and wait until none is left."""
    deadline = time.monotonic() + timeout
    while pids := marked_processes(marker):
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes {pids} of the dead server survive SIGKILL")
        time.sleep(0.1)


class Supervisor:
    def __init__(self, config_path: str, ranks: int, fresh: bool) -> None:
        config = load_config(config_path)
        check_settings(config)
        check_writable(config.output_path)
        self.config_path = config_path
        self.ranks = ranks
        self.fresh = fresh
        self.output = config.output_path
        self.heartbeat = config.output_path / HEARTBEAT
        self.timeout = config.launcher.server_timeout
        self.max_restarts = config.launcher.max_server_restarts
        self.scheduler = load(SCHEDULERS, config.launcher.scheduler, "launcher.scheduler")
        self.process: subprocess.Popen[bytes] | None = None
        self.stop: int | None = None  # the stop signal received, if one was
        self.stop_as: signal.Signals | None = None  # how a stop reaches the server's launcher (None: as it came)
        self._stopped: subprocess.Popen[bytes] | None = None  # the last process a stop signal was passed to

    def command(self, fresh: bool) -> list[str]:
        """``mpirun -n K`` the server; inside a batch system's allocation, what that scheduler starts ranks with
        (``Scheduler.server_launch``: Slurm's ``srun``, on the allocation's nodes), and the signal that passes a
        stop on to it (``stop_as``)."""
        launch, self.stop_as = [venv_mpirun(), "-n", str(self.ranks)], None
        for kind in SCHEDULERS:
            try:
                scheduler = load(SCHEDULERS, kind, f"scheduler {kind!r}, not this study's")
            except ConfigError as error:  # the study's own scheduler loaded: this one is only asked, not used
                logger.warning("%s; not asked whether the server runs in one of its allocations", error)
                continue
            if (inside := scheduler.server_launch(self.ranks)) is not None:
                launch, self.stop_as = inside, scheduler.server_stop_signal
                break
        return [*launch, sys.executable, "-m", "melissa_dl", self.config_path, *(["--fresh"] if fresh else [])]

    def run(self) -> int:
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._forward)
        restarts, cause = 0, None
        while True:
            marker = uuid.uuid4().hex
            code = self._run_once(marker, fresh=self.fresh and restarts == 0)
            self._end_run(marker)
            if code in ENDED_CODES:
                return code
            if code == EXIT_STOPPED or self.stop is not None:  # whatever the server's code: 128 + n stopped early
                logger.warning(
                    "server stopped on request (its exit code %d); run the same command again to resume from %s",
                    code,
                    self.output / "checkpoints",
                )
                return EXIT_STOPPED
            previous, cause = cause, read_failure(self.output)
            if cause is not None and cause == previous:  # a restart would meet it again
                logger.error(
                    "server failed again (exit code %d) with the error of the run before, not restarting it: %s. "
                    "Fix its cause, then run the same command to resume, or add --fresh to start over "
                    "(tracebacks in %s)",
                    code,
                    cause,
                    self.output / "logs",
                )
                return code
            if restarts == self.max_restarts:
                logger.error("server failed (exit code %d) after %d restarts; giving up", code, restarts)
                return code
            restarts += 1
            logger.warning(
                "server died (exit code %d); restarting it from its checkpoints (restart %d of %d)",
                code,
                restarts,
                self.max_restarts,
            )

    def _run_once(self, marker: str, fresh: bool) -> int:
        started = time.time()
        if self.stop is not None:  # a signal between two runs
            return EXIT_STOPPED
        (self.output / FAILURE).unlink(missing_ok=True)  # an earlier run's cause is not this one's
        command = self.command(fresh)  # and stop_as, the signal of a stop for it
        # start_new_session: a terminal's Ctrl-C reaches the server once, through _forward;
        # die_with_parent: a supervisor killed outright stops its server (which checkpoints) too
        self.process = subprocess.Popen(
            command,
            env={**os.environ, RUN_MARKER: marker},
            start_new_session=True,
            preexec_fn=die_with_parent(self.stop_as or signal.SIGTERM),
        )
        while (code := self.process.poll()) is None:
            self._pass_on_stop()
            time.sleep(POLL)
            try:
                beat = self.heartbeat.stat().st_mtime
            except OSError:  # not written yet
                beat = 0.0
            silent = time.time() - max(started, beat)
            if beat > started and silent > self.timeout:
                logger.error("no heartbeat from the server for %.0f s (launcher.server_timeout): killing it", silent)
                kill_run(marker)
            elif beat <= started and silent > max(self.timeout, START_TIMEOUT):
                logger.error("the server has not started in %.0f s (no first heartbeat): killing it", silent)
                kill_run(marker)
        return code

    def _end_run(self, marker: str) -> None:
        """Kill what is left of a run: a hung rank, the simulations of a dead server (batch jobs: cancelled)."""
        try:
            self.scheduler.end_run(marker)
        except OSError as error:
            logger.warning("could not end the jobs of the ended server's simulations: %s", error)
        kill_run(marker)

    def _forward(self, signum: int, frame: Any) -> None:
        """Pass a stop request on to the server (it checkpoints and exits 75); no restart follows. Each signal
        is passed on once, as it comes: a second one may mean "exit now"."""
        self.stop = signum
        process = self.process
        if process is not None and process.poll() is None:
            self._stopped = process
            process.send_signal(self.stop_as or signum)

    def _pass_on_stop(self) -> None:
        """Pass on a stop that came while the server was being started (in ``Popen``, when the handler saw only
        the run before's, dead process) to the server that was passed none. A signal handled in between is passed
        on by the handler as well: a second signal, sent as a second one."""
        process = self.process
        if self.stop is not None and process is not None and self._stopped is not process:
            self._stopped = process
            process.send_signal(self.stop_as or self.stop)


def make_parser() -> argparse.ArgumentParser:
    """``melissa-launcher``'s options (the CLI reference is generated from them)."""
    parser = argparse.ArgumentParser(prog="melissa-launcher", description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("config", help="the study's JSON configuration")
    parser.add_argument("-n", "--ranks", type=int, default=1, help="server ranks (default 1)")
    parser.add_argument("--fresh", action="store_true", help="start over instead of resuming (first start only)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error("--ranks must be at least 1")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s melissa-launcher %(levelname)s %(message)s", datefmt="%H:%M:%S"
    )
    try:
        supervisor = Supervisor(args.config, args.ranks, args.fresh)
    except ConfigError as error:
        sys.stderr.write(f"melissa-launcher: {args.config}: {error}\n")
        return EXIT_CONFIG
    return supervisor.run()


if __name__ == "__main__":
    sys.exit(main())
