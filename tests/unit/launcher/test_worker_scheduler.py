"""``launcher.workers``: attempts handed to persistent workers, what a worker is told, a dead worker replaced."""

from __future__ import annotations

from pathlib import Path

from launcher.placeholders import Placeholders
from launcher.workers import ENV_WORKER, WorkerScheduler


class FakeProcess:
    """A worker process the test ends by hand."""

    def __init__(self, env: dict[str, str], command: list[str] | None) -> None:
        self.env, self.command = env, command
        self.code: int | None = None
        self.terminated = False
        self.label = "fake"

    def poll(self) -> int | None:
        return self.code

    def started(self, fresh: bool = False) -> bool:
        return True

    def terminate(self) -> None:
        self.terminated = True

    def finish_kill(self, deadline: float) -> bool:
        self.code = -15 if self.code is None else self.code
        return True

    def kill(self, deadline: float | None = None) -> None:
        self.finish_kill(0.0)


class FakeScheduler:
    def __init__(self) -> None:
        self.processes: list[FakeProcess] = []

    def start(
        self, simulation_id: int, attempt: int, env: dict[str, str], log_path: Path, command: list[str] | None = None
    ) -> FakeProcess:
        self.processes.append(FakeProcess(env, command))
        return self.processes[-1]

    def close(self) -> None:
        pass


def attempt_env(simulation: int, attempt: int = 0) -> dict[str, str]:
    return {"MELISSA_SERVER": "tcp://x", "MELISSA_SIMULATION_ID": str(simulation), "MELISSA_ATTEMPT": str(attempt)}


def pool() -> tuple[WorkerScheduler, FakeScheduler]:
    inner = FakeScheduler()
    return WorkerScheduler(inner, Placeholders(["worker", "--gpu={slot}"], {"GPU": "{slot}"})), inner  # type: ignore[arg-type]


def test_a_worker_is_told_its_next_simulation_once_and_asking_again_ends_it(tmp_path: Path) -> None:
    workers, inner = pool()
    first = workers.start(0, 0, attempt_env(0), tmp_path / "simulation0.attempt0.log")
    [process] = inner.processes
    assert process.command == ["worker", "--gpu=0"] and process.env["GPU"] == "0" and process.env[ENV_WORKER] == "0:0"
    assert (tmp_path / "simulation0.attempt0.log").readlink() == Path("worker0.start0.log")
    assert first.poll() is None
    assert workers.next_for("0:0") == {"env": {}}  # it started with simulation 0's environment
    assert workers.next_for("0:0") == {"env": {}}  # asked again without saying it got it: the answer was lost
    assert first.poll() is None
    assert [workers.next_for("0:0", "0:0") for _ in range(8)] == [  # simulation 0 over, nothing more yet: asked again
        {"wait": wait}
        for wait in (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.2, 0.2)  # soon, then less and less often
    ]
    assert first.poll() == 0
    second = workers.start(1, 0, attempt_env(1), tmp_path / "simulation1.attempt0.log")
    assert len(inner.processes) == 1  # the same worker
    assert workers.next_for("0:0", "0:0") == {"env": {"MELISSA_SIMULATION_ID": "1"}}  # what differs from its own
    assert second.poll() is None
    workers.next_for("0:0", "1:0")
    assert second.poll() == 0


def test_two_attempts_at_once_get_two_workers_and_each_its_own_slot(tmp_path: Path) -> None:
    workers, inner = pool()
    workers.start(0, 0, attempt_env(0), tmp_path / "a.log")
    workers.start(1, 0, attempt_env(1), tmp_path / "b.log")
    assert [p.env[ENV_WORKER] for p in inner.processes] == ["0:0", "1:0"]
    assert [p.command for p in inner.processes] == [["worker", "--gpu=0"], ["worker", "--gpu=1"]]
    assert workers.next_for("1:0") == {"env": {}}


def test_a_dead_worker_ends_its_attempt_with_its_code_and_is_started_again(tmp_path: Path) -> None:
    workers, inner = pool()
    handed = workers.start(0, 0, attempt_env(0), tmp_path / "a.log")
    workers.next_for("0:0")
    inner.processes[0].code = 1
    assert handed.poll() == 1
    workers.start(0, 1, attempt_env(0, 1), tmp_path / "b.log")
    assert [p.env[ENV_WORKER] for p in inner.processes] == ["0:0", "0:1"]  # slot 0, started again
    assert workers.next_for("0:0") == {"over": True}  # the dead start's process, were it still asking
    assert workers.next_for("0:1") == {"env": {}}


def test_killing_an_attempt_kills_its_worker_and_frees_its_slot_only_once_dead(tmp_path: Path) -> None:
    workers, inner = pool()
    handed = workers.start(0, 0, attempt_env(0), tmp_path / "a.log")
    handed.terminate()
    assert inner.processes[0].terminated
    workers.start(1, 0, attempt_env(1), tmp_path / "b.log")  # slot 0 is dying: slot 1
    assert inner.processes[1].env[ENV_WORKER] == "1:0"
    assert handed.finish_kill(0.0)
    workers.start(2, 0, attempt_env(2), tmp_path / "c.log")
    assert inner.processes[2].env[ENV_WORKER] == "0:1"


def test_a_finished_attempt_killed_late_leaves_its_worker_alone(tmp_path: Path) -> None:
    workers, inner = pool()
    handed = workers.start(0, 0, attempt_env(0), tmp_path / "a.log")
    workers.next_for("0:0")
    workers.next_for("0:0", "0:0")
    handed.terminate()
    assert not inner.processes[0].terminated and handed.finish_kill(0.0)


def test_at_the_end_workers_are_told_the_study_is_over_and_the_rest_killed(tmp_path: Path) -> None:
    workers, inner = pool()
    workers.start(0, 0, attempt_env(0), tmp_path / "a.log")
    inner.processes[0].code = 0  # it heard "over" and exited
    workers.start(1, 0, attempt_env(1), tmp_path / "b.log")
    workers.close()
    assert workers.next_for("1:0") == {"over": True}
    assert inner.processes[1].code == -15  # still running after the grace: killed
    assert workers.next_for("7:0") == {"over": True} and workers.next_for("junk") == {"over": True}
