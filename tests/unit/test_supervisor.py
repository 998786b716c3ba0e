"""The supervisor's decisions, on real processes standing in for the server: no stop signal is lost, whatever the
supervisor is doing when it comes; a server failing the same way after a restart is not restarted again."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from melissa_dl import supervisor as supervisor_module
from melissa_dl.errors import ConfigError
from melissa_dl.runtime.mpi import STOP_SIGNALS
from melissa_dl.runtime.status import EXIT_STOPPED, FAILURE, read_failure, record_failure
from melissa_dl.supervisor import Supervisor

pytestmark = pytest.mark.timeout(60)

# A server that fails at once, its cause (argv[2], if any) recorded as a failing rank records it.
FAILING = (
    "import sys; from pathlib import Path; from melissa_dl.runtime.status import record_failure; "
    "sys.argv[2:] and record_failure(Path(sys.argv[1]), ValueError(sys.argv[2]), None); sys.exit(1)"
)
# A server that says it is ready (its handlers installed), then exits 75 after exactly one signal argv[2] (1 after
# none within 20 s, more than one: a stop passed on twice, or another signal).
STOPPABLE = (
    "import signal, sys, time; from pathlib import Path; got = []; "
    "[signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGTERM, signal.SIGUSR1)]; "
    "Path(sys.argv[1]).touch(); deadline = time.monotonic() + 20\n"
    "while not got and time.monotonic() < deadline: time.sleep(0.01)\n"
    "time.sleep(0.3); sys.exit(75 if got == [int(sys.argv[2])] else 1)"
)

# A server killed by the stop before its ranks could checkpoint (mpirun's start, a rank's start-up): it dies of it.
DYING = "import sys, time; from pathlib import Path; Path(sys.argv[1]).touch(); time.sleep(20); sys.exit(1)"


@pytest.fixture
def own_signals() -> Iterator[None]:
    """The supervisor installs its handlers in this process: put pytest's back."""
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def supervisor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runs: list[list[str]], restarts: int = 3) -> Supervisor:
    """A supervisor whose n-th start runs ``runs[n]`` instead of the server, looking at it every 10 ms."""
    config = {
        "study": {"fields": ["u"], "parameters": [{"name": "a", "low": 0, "high": 1}], "simulations": 1},
        "launcher": {"command": ["true"], "max_server_restarts": restarts},
        "output_dir": "out",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "out").mkdir()
    made = Supervisor(str(tmp_path / "config.json"), 1, fresh=False)
    started = iter(runs)
    monkeypatch.setattr(made, "command", lambda fresh: next(started))
    monkeypatch.setattr(supervisor_module, "POLL", 0.01)
    return made


def failing(tmp_path: Path, cause: str | None) -> list[str]:
    return [sys.executable, "-c", FAILING, str(tmp_path / "out"), *([cause] if cause else [])]


def signalled_during_start(ready: Path, skipped: int) -> type[subprocess.Popen[bytes]]:
    """``Popen`` whose call number ``skipped`` (from 0), once its process is ready, makes this process receive
    SIGTERM before it returns: what the supervisor meets when a stop comes while it starts a server (its handler
    sees only the run before's process, or none)."""
    calls = iter(range(skipped + 1))

    class Popen(subprocess.Popen[bytes]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if next(calls, None) != skipped:
                return
            deadline = time.monotonic() + 20
            while not ready.exists():
                assert time.monotonic() < deadline, "the stand-in server never got ready"
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler before the next line

    return Popen


@pytest.mark.parametrize("restart", [False, True], ids=["first start", "restart"])
@pytest.mark.parametrize("stop_as", [None, signal.SIGUSR1], ids=["mpirun", "srun"])
def test_a_stop_that_comes_while_a_server_starts_reaches_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, own_signals: None, restart: bool, stop_as: signal.Signals | None
) -> None:
    """Through srun a stop is passed on as SIGUSR1 (srun answers SIGTERM by killing its tasks)."""
    ready = tmp_path / "ready"
    stoppable = [sys.executable, "-c", STOPPABLE, str(ready), str(int(stop_as or signal.SIGTERM))]
    made = supervisor(tmp_path, monkeypatch, [failing(tmp_path, None), stoppable] if restart else [stoppable])
    made.stop_as = stop_as  # what the launching scheduler says (``command``, replaced here, sets it)
    monkeypatch.setattr(supervisor_module.subprocess, "Popen", signalled_during_start(ready, int(restart)))
    assert made.run() == EXIT_STOPPED  # the stand-in got exactly one stop, the right one, and nothing was restarted
    assert made.stop == signal.SIGTERM and ready.exists()


def test_a_server_that_a_stop_ended_before_it_could_checkpoint_makes_the_supervisor_exit_75(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, own_signals: None
) -> None:
    ready = tmp_path / "ready"
    made = supervisor(tmp_path, monkeypatch, [[sys.executable, "-c", DYING, str(ready)]])
    monkeypatch.setattr(supervisor_module.subprocess, "Popen", signalled_during_start(ready, 0))
    with caplog.at_level(logging.INFO, logger="melissa-launcher"):
        assert made.run() == EXIT_STOPPED  # not restarted, and the code that says "resume"
    assert [r.getMessage().split(";")[0] for r in caplog.records] == ["server stopped on request (its exit code -15)"]


@pytest.mark.parametrize(
    "causes, runs, line",
    [
        (
            ["boom", "boom"],
            2,
            "server failed again (exit code 1) with the error of the run before, not restarting it: "
            "ValueError: boom. Fix its cause",
        ),
        (["boom", "bang", "bang"], 3, "with the error of the run before, not restarting it: ValueError: bang. Fix"),
        (["boom", None, "boom", None], 4, "server failed (exit code 1) after 3 restarts; giving up"),
        ([None, None, None, None], 4, "server failed (exit code 1) after 3 restarts; giving up"),
        (["a", "b", "c", "d"], 4, "server failed (exit code 1) after 3 restarts; giving up"),
    ],
    ids=["same twice", "same after another", "a run without a cause between", "no cause", "other causes"],
)
def test_a_server_that_fails_again_with_the_cause_of_the_run_before_is_not_restarted_into_it(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    own_signals: None,
    causes: list[str | None],
    runs: int,
    line: str,
) -> None:
    """The first restart is always made (a transient failure); a record an earlier run left is removed at every
    start, so that a run which recorded nothing never matches it."""
    made = supervisor(tmp_path, monkeypatch, [failing(tmp_path, cause) for cause in causes])
    with caplog.at_level(logging.INFO, logger="melissa-launcher"):
        assert made.run() == 1
    restarting = [r for r in caplog.records if r.getMessage().startswith("server died (exit code 1); restarting")]
    assert len(restarting) == runs - 1
    assert line in caplog.records[-1].getMessage() and caplog.records[-1].levelno == logging.ERROR
    assert (tmp_path / "out" / FAILURE).exists() == (causes[runs - 1] is not None)


def test_a_failure_is_recorded_in_one_line_with_the_line_that_raised_it(tmp_path: Path) -> None:
    def training_step() -> None:
        error = ValueError("bad\nbatch")
        error.add_note("a note")
        raise error

    try:
        training_step()
    except ValueError as error:
        record_failure(tmp_path, error, error.__traceback__)
        line = training_step.__code__.co_firstlineno + 3
    assert read_failure(tmp_path) == f"ValueError: bad batch a note ({__file__}:{line}, in training_step)"
    assert [path.name for path in tmp_path.iterdir()] == [FAILURE]  # no temporary file left
    (tmp_path / FAILURE).write_text('{"cause": "ValueError: ba')  # torn: no cause
    assert read_failure(tmp_path) is None


@pytest.mark.parametrize(
    "changes, refusal",
    [
        ({"launcher": {"command": ["sim", "{b}"]}}, "launcher.command[1]: '{b}': unknown placeholder {b}"),
        (
            {"study": {"sampler": "adaptive", "adaptive": {"lag": 9, "breed_after": 4}}, "training": {}},
            "study.adaptive.lag: 9 leaves no parent before the first bred generation (breed_after=4)",
        ),
    ],
)
def test_melissa_launcher_refuses_what_melissa_server_check_refuses_before_starting_any(
    tmp_path: Path, changes: dict[str, Any], refusal: str
) -> None:
    """Settings that need the launcher's parts or the study's pace (``study.jobs.check_settings``): refused by the
    supervisor itself, not by a server it started."""
    (tmp_path / "model.py").write_text("")
    config: dict[str, Any] = {
        "study": {"fields": ["u"], "parameters": [{"name": "a", "low": 0, "high": 1}], "simulations": 8},
        "launcher": {"command": ["sim"]},
    }
    for section, values in changes.items():
        config[section] = {**config.get(section, {}), **values}
    if "training" in config:
        config["training"] = {"module": "model.py", "class_name": "M"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        Supervisor(str(tmp_path / "config.json"), 1, fresh=False)


# A server that beats argv[2] times (touching the heartbeat file argv[1] every 0.1 s), then hangs.
BEATING = (
    "import sys, time; from pathlib import Path\n"
    "for _ in range(int(sys.argv[2])): Path(sys.argv[1]).touch(); time.sleep(0.1)\n"
    "time.sleep(60)"
)


def test_a_runs_start_may_take_the_start_timeout_and_a_hang_after_its_first_beat_the_server_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """server_timeout 1 s, START_TIMEOUT 4 s: a first run that never beats is killed once it has not started in
    4 s, not in 1; its restart, which beats and then hangs, for its silence after its beats."""
    heartbeat = str(tmp_path / "out" / "heartbeat")
    runs = [[sys.executable, "-c", BEATING, heartbeat, str(beats)] for beats in (0, 3)]
    made = supervisor(tmp_path, monkeypatch, runs, restarts=1)
    made.timeout = 1.0
    monkeypatch.setattr(supervisor_module, "START_TIMEOUT", 4.0)
    with caplog.at_level(logging.INFO, logger="melissa-launcher"):
        assert made.run() != 0
    kills = [r.getMessage() for r in caplog.records if "killing it" in r.getMessage()]
    assert len(kills) == 2, kills
    started = re.fullmatch(r"the server has not started in (\d+) s \(no first heartbeat\): killing it", kills[0])
    assert started is not None and int(started.group(1)) >= 4  # the start's 4 s, not the 1 s of a hang
    assert re.fullmatch(r"no heartbeat from the server for \d+ s \(launcher.server_timeout\): killing it", kills[1])
