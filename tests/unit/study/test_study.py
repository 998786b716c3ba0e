"""Rank 0's study bookkeeping, driven through a fake launcher and hand-made rank reports."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np
import pytest

from launcher import NOT_RUNNABLE, START_FAILED, Sampler
from launcher.samplers import AdaptiveSampler, Breeding, HaltonSampler, UniformSampler
from melissa_dl.config.sections import parse_config
from melissa_dl.ingest.assembly import Progress
from melissa_dl.ingest.receiver import ReceiverReport
from melissa_dl.study.report import final_report
from melissa_dl.study.study import EXIT_GRACE, GIVE_UP_AFTER, INTERRUPTED, LEARNING_GRACE, State, Study

pytestmark = pytest.mark.timeout(60)

TIMEOUT = 10.0
RANKS = 2  # server ranks: each simulation's progress has one entry per rank


class FakeLauncher:
    """Records submissions and kills; the test decides what runs and what ended."""

    def __init__(self) -> None:
        self.submitted: list[tuple[int, int, dict[str, str]]] = []
        self.killed: list[int] = []
        self.waiting: list[int] = []
        self.active: set[int] = set()
        self.ended: list[tuple[int, int]] = []
        self.outputs: dict[tuple[int, int], str] = {}  # (simulation, attempt) -> the end of its log
        self.named: dict[int, dict[str, float]] = {}  # simulation -> its parameters by name, for the placeholders
        self.finished = False  # told the study submits nothing more

    def submit(
        self, simulation_id: int, attempt: int, env: dict[str, str], parameters: dict[str, float] | None = None
    ) -> None:
        self.submitted.append((simulation_id, attempt, env))
        self.named[simulation_id] = parameters or {}
        self.waiting.append(simulation_id)

    def poll(self) -> list[tuple[int, int]]:
        ended, self.ended = self.ended, []
        return ended

    def finish(self) -> None:
        self.finished = True

    def output_tail(self, simulation_id: int, attempt: int) -> str:
        return self.outputs.get((simulation_id, attempt), "")

    def log_path(self, simulation_id: int, attempt: int) -> Path:
        return Path(f"simulations/simulation{simulation_id}.attempt{attempt}.log")

    def kill(self, simulation_id: int) -> None:
        self.killed.append(simulation_id)
        self.active.discard(simulation_id)
        self.waiting = [s for s in self.waiting if s != simulation_id]

    def drop_unstarted(self, simulation_id: int) -> None:
        if simulation_id not in self.active:
            self.kill(simulation_id)

    def running(self) -> set[int]:
        return set(self.active)

    def queued(self) -> list[int]:
        return list(self.waiting)

    # what the test does to the jobs
    def start(self, *simulation_ids: int) -> None:
        self.waiting = [s for s in self.waiting if s not in simulation_ids]
        self.active.update(simulation_ids)

    def exit(self, simulation_id: int, code: int) -> None:
        self.waiting = [s for s in self.waiting if s != simulation_id]  # START_FAILED: ended without running
        self.active.discard(simulation_id)
        self.ended.append((simulation_id, code))

    def attempts(self, simulation_id: int) -> list[int]:
        return [attempt for s, attempt, _ in self.submitted if s == simulation_id]


def restored_state(simulations: list[dict], total: int) -> dict:
    """A checkpoint's study part in which every simulation was drawn, from each one's saved fields."""
    return {
        "simulations": simulations,
        "sampler": {"drawn": total, "rng": np.random.default_rng(0).bit_generator.state},
        "parameters": np.zeros((total, 1)),
        "losses": {"steps": {}, "final": {}},
    }


class Harness:
    """The study on a fake launcher, ticked as the bookkeeping rounds do: each tick's news are taken after it."""

    def __init__(
        self,
        simulations: int = 2,
        max_retries: int = 2,
        restored: list[dict] | dict | None = None,
        job_limit: int = 1 << 20,
        sampler: Sampler | None = None,
        held_out: np.ndarray | None = None,
    ) -> None:
        self.launcher = FakeLauncher()
        self.expected: list[tuple[int, int | None]] = []
        self.study = Study(
            simulations,
            RANKS,
            self.launcher,  # type: ignore[arg-type]
            sampler or UniformSampler([0.0], [1.0], 0, simulations),
            environment=lambda sim, attempt, parameters: {"SIM": str(sim), "ATTEMPT": str(attempt)},
            expect=lambda sim, attempt: self.expected.append((sim, attempt)),
            max_retries=max_retries,
            timeout=TIMEOUT,
            job_limit=job_limit,
            held_out=held_out,
        )
        if restored is not None:
            self.study.load_state_dict(
                restored
                if isinstance(restored, dict)
                else restored_state(restored + [{}] * (simulations - len(restored)), simulations)
            )
        self.study.start()
        self.tick(0.0)  # the parameters drawn, then sent to the ranks
        self.tick(0.0)  # and the simulations launched

    def tick(self, now: float, *reports: ReceiverReport) -> None:
        self.study.tick(list(reports) or [ReceiverReport() for _ in range(RANKS)], now=now)
        self.news = self.study.take_news()

    def state(self, sim: int) -> State:
        return self.study.simulations[sim].state

    def running(self, now: float, *sims: int) -> None:
        """Start the jobs and let a tick see them."""
        self.launcher.start(*sims)
        self.tick(now)
        assert all(self.state(s) is State.RUNNING for s in sims)


def reports(
    progress: dict[int, Iterable[tuple[int, int | None] | None]] | None = None,
    active: Iterable[int] = (),
    blocked: bool = False,
) -> list[ReceiverReport]:
    """One report per rank; ``progress[sim]`` gives (received, expected) per rank, None where it did not change."""
    per_rank: list[ReceiverReport] = [ReceiverReport() for _ in range(RANKS)]
    for sim, ranks in (progress or {}).items():
        for rank, entry in enumerate(ranks):
            if entry is not None:
                per_rank[rank].progress[sim] = Progress(*entry)
                per_rank[rank].active.add(sim)
    for sim in active:
        per_rank[0].active.add(sim)
    per_rank[0].blocked = blocked
    return per_rank


@pytest.fixture
def h() -> Harness:
    return Harness()


def test_start_submits_every_simulation_as_attempt_0_once_the_ranks_have_its_parameters() -> None:
    launcher = FakeLauncher()
    study = Study(
        2,
        RANKS,
        launcher,
        UniformSampler([0.0, 5.0], [1.0, 6.0], 0, 2),  # type: ignore[arg-type]
        environment=lambda sim, attempt, parameters: {"P": str(parameters.tolist())},
        expect=lambda sim, attempt: None,
        max_retries=1,
        timeout=TIMEOUT,
        job_limit=4,
    )
    study.start()
    study.tick([ReceiverReport()] * RANKS, now=0.0)
    attempts, ended, parameters = study.take_news()
    drawn = UniformSampler([0.0, 5.0], [1.0, 6.0], 0, 2).ask(2)
    assert (attempts, ended, launcher.submitted) == ({}, [], []) and sorted(parameters) == [0, 1]
    np.testing.assert_array_equal(np.stack([parameters[0], parameters[1]]), drawn)
    study.tick([ReceiverReport()] * RANKS, now=0.2)  # the round after: every rank has them
    assert study.take_news()[0] == {0: 0, 1: 0}
    assert [(sim, env["P"]) for sim, _, env in launcher.submitted] == [
        (0, str(drawn[0].tolist())),
        (1, str(drawn[1].tolist())),
    ]
    assert launcher.named == {s: {"0": drawn[s][0], "1": drawn[s][1]} for s in (0, 1)}  # unnamed: by position


def test_start_submits_every_simulation_as_attempt_0(h: Harness) -> None:
    assert h.launcher.submitted == [(0, 0, {"SIM": "0", "ATTEMPT": "0"}), (1, 0, {"SIM": "1", "ATTEMPT": "0"})]
    assert h.expected == [(0, 0), (1, 0)]
    assert [s.attempts for s in h.study.simulations] == [1, 1]
    assert h.study.counts() == {"queued": 2, "running": 0, "done": 0, "failed": 0}
    assert not h.study.over


def test_queued_becomes_running_when_its_job_runs(h: Harness) -> None:
    h.tick(0.0)
    assert h.study.counts()["queued"] == 2 and h.study.first_start is None
    h.running(1.0, 1)
    assert (h.state(0), h.state(1)) == (State.QUEUED, State.RUNNING)
    assert h.study.first_start == 1.0  # the time left counts from it
    h.tick(100.0, *reports(active=[1]))  # a queued simulation waiting for a slot never times out
    assert h.state(0) is State.QUEUED and h.launcher.killed == [] and h.launcher.queued() == [0]
    assert h.study.first_start == 1.0
    assert len(h.launcher.submitted) == 2


def test_done_needs_every_rank_to_hold_every_announced_step(h: Harness) -> None:
    h.running(0.0, 0)
    h.tick(1.0, *reports({0: [(3, 3), (2, None)]}))
    assert h.state(0) is State.RUNNING
    h.tick(2.0, *reports({0: [None, (2, 3)]}))
    assert h.state(0) is State.RUNNING and h.study.simulations[0].received == 5
    h.tick(3.0, *reports({0: [None, (3, 3)]}))  # rank 0's last report still holds
    assert h.state(0) is State.DONE and h.study.simulations[0].received == 6
    assert h.expected[-1] == (0, None)
    assert h.news == ({}, [0], {})  # the ranks free what it holds
    assert h.study.counts() == {"queued": 1, "running": 0, "done": 1, "failed": 0}
    assert h.launcher.killed == [] and h.launcher.attempts(0) == [0]


@pytest.mark.parametrize(
    "code, progress, state, attempts, reason",
    [
        (0, [(3, 3), (2, 2)], State.DONE, [0], ""),
        (5, [(3, 3), (2, 2)], State.DONE, [0], ""),  # all data is in: the exit code does not matter
        (0, [(3, 3), (1, 2)], State.QUEUED, [0, 1], "exited with steps missing"),
        (5, [(3, 3), (1, 2)], State.QUEUED, [0, 1], "exit code 5"),
        (5, [(0, None), (0, None)], State.QUEUED, [0, 1], "exit code 5"),
        (0, [(3, 3), (1, None)], State.RUNNING, [0], ""),  # frames may still be in flight: wait
    ],
)
def test_fate_of_an_ended_job(
    h: Harness, code: int, progress: list[tuple[int, int | None]], state: State, attempts: list[int], reason: str
) -> None:
    h.running(0.0, 0)
    h.launcher.exit(0, code)
    h.tick(1.0, *reports({0: progress}))
    sim = h.study.simulations[0]
    assert (sim.state, h.launcher.attempts(0), sim.reason) == (state, attempts, reason)
    assert h.launcher.killed == []
    if len(attempts) > 1:
        assert h.launcher.submitted[-1] == (0, 1, {"SIM": "0", "ATTEMPT": "1"})
        assert h.expected == [(0, 0), (1, 0), (0, 1)] and sim.exit_code is None


def test_exit_0_without_finalize_is_relaunched_after_a_short_grace_not_the_timeout(h: Harness) -> None:
    h.running(0.0, 0)
    h.launcher.exit(0, 0)
    h.tick(EXIT_GRACE - 1, *reports(active=[0]))  # its last frames may still be on their way
    h.tick(2 * EXIT_GRACE - 1.5, *reports(blocked=True))  # and back-pressure may hold them
    h.tick(2 * EXIT_GRACE - 2)
    assert h.state(0) is State.RUNNING
    h.tick(3 * EXIT_GRACE - 1)
    assert h.state(0) is State.QUEUED and h.launcher.attempts(0) == [0, 1]
    assert h.study.simulations[0].reason == "exited 0 without finalize"


def test_the_grace_after_an_exit_counts_from_the_exit_not_from_the_last_frame(h: Harness) -> None:
    """A simulation that waited long before its last steps: its exit and its announcements are seen a round
    apart (a rank's report was gathered before its FINALIZE was read); it had failed at once, long after its
    previous frame."""
    h.running(0.0, 0)
    h.launcher.exit(0, 0)
    h.tick(10 * EXIT_GRACE)  # nothing new from the ranks in this round
    assert h.state(0) is State.RUNNING
    h.tick(10 * EXIT_GRACE + 0.2, *reports({0: [(3, 3), (2, 2)]}))
    assert h.state(0) is State.DONE and h.launcher.attempts(0) == [0]


def test_silent_simulation_is_killed_and_relaunched_after_the_timeout(h: Harness) -> None:
    h.running(0.0, 0, 1)
    h.tick(TIMEOUT, *reports(active=[1]))
    assert h.launcher.killed == []
    h.tick(TIMEOUT + 0.5)
    assert h.launcher.killed == [0]
    assert (h.state(0), h.state(1)) == (State.QUEUED, State.RUNNING)
    assert h.launcher.attempts(0) == [0, 1] and h.launcher.attempts(1) == [0]
    assert h.study.simulations[0].reason == "no data for 10 s"


def test_activity_resets_the_timeout_clock(h: Harness) -> None:
    h.running(0.0, 0)
    h.tick(8.0, *reports(active=[0]))
    h.tick(15.0, *reports({0: [(1, None), (0, None)]}))  # progress counts as activity too
    h.tick(25.0)
    assert h.state(0) is State.RUNNING and h.launcher.killed == []
    h.tick(25.5)
    assert h.launcher.killed == [0] and h.state(0) is State.QUEUED


def test_backpressure_suspends_the_timeout(h: Harness) -> None:
    h.running(0.0, 0)
    for now in (5.0, 14.0, 23.0, 40.0):
        h.tick(now, *reports(blocked=True))  # the server made the receiver wait: not the simulation's fault
    assert h.state(0) is State.RUNNING and h.launcher.killed == []
    h.tick(50.0)
    assert h.state(0) is State.RUNNING
    h.tick(50.5)
    assert h.launcher.killed == [0]


@pytest.mark.parametrize("max_retries", [0, 1, 3])
def test_retries_exhausted_fail_the_simulation_with_its_reason(max_retries: int) -> None:
    h = Harness(simulations=1, max_retries=max_retries)
    for attempt in range(max_retries + 1):
        assert h.state(0) is State.QUEUED
        h.running(float(attempt), 0)
        h.launcher.exit(0, 9)
        h.tick(attempt + 0.5)
    sim = h.study.simulations[0]
    assert (sim.state, sim.reason, sim.attempts) == (State.FAILED, "exit code 9", max_retries + 1)
    assert h.launcher.attempts(0) == list(range(max_retries + 1))
    assert h.expected == [(0, a) for a in range(max_retries + 1)] + [(0, None)]
    assert h.study.counts() == {"queued": 0, "running": 0, "done": 0, "failed": 1}
    assert h.study.over
    h.tick(100.0)
    assert len(h.launcher.submitted) == max_retries + 1 and sim.state is State.FAILED


def test_timeout_on_the_last_attempt_fails_after_killing() -> None:
    h = Harness(simulations=1, max_retries=0)
    h.running(0.0, 0)
    h.tick(TIMEOUT + 1)
    assert h.launcher.killed == [0]
    assert h.state(0) is State.FAILED and h.study.simulations[0].reason == "no data for 10 s"


def test_late_frames_complete_a_queued_relaunch(h: Harness) -> None:
    h.running(0.0, 0)
    h.launcher.exit(0, 1)
    h.tick(1.0)
    assert h.state(0) is State.QUEUED and h.launcher.attempts(0) == [0, 1]
    h.tick(2.0, *reports({0: [(3, 3), (2, 2)]}))  # the first attempt's frames were only delayed
    assert h.state(0) is State.DONE
    assert h.launcher.killed == [0] and h.launcher.queued() == [1]  # the useless relaunch is dropped


def test_over_only_when_all_terminal_and_nothing_runs(h: Harness) -> None:
    h.running(0.0, 0, 1)
    h.tick(1.0, *reports({0: [(1, 1), (1, 1)]}))
    assert h.state(0) is State.DONE and not h.study.over
    h.tick(2.0, *reports({1: [(2, 2), (0, 0)]}))
    assert h.study.counts() == {"queued": 0, "running": 0, "done": 2, "failed": 0}
    assert not h.study.over  # both jobs are still exiting
    h.launcher.exit(1, 0)
    h.tick(3.0)
    assert not h.study.over and h.launcher.killed == [] and not h.launcher.finished
    h.tick(2.0 + TIMEOUT + 0.5)  # a done simulation whose process hangs is killed after the timeout
    assert h.launcher.killed == [0]
    assert h.study.over and h.launcher.finished  # persistent workers are told at once


def test_attempt_that_could_not_start_is_retried(h: Harness) -> None:
    h.launcher.exit(0, START_FAILED)
    h.tick(1.0)
    assert h.launcher.attempts(0) == [0, 1]
    assert h.study.simulations[0].reason == f"exit code {START_FAILED}"


def test_a_relaunch_is_not_judged_on_the_last_attempts_announcements(h: Harness) -> None:
    h.running(0.0, 0)
    h.launcher.exit(0, 0)
    h.tick(1.0, *reports({0: [(3, 3), (1, 2)]}))  # attempt 0 announced 3 + 2 steps, one is missing
    assert h.launcher.attempts(0) == [0, 1]
    h.running(2.0, 0)
    h.launcher.exit(0, 0)  # attempt 1 ends before any rank has read its frames (back-pressure)
    h.tick(3.0)
    sim = h.study.simulations[0]
    assert sim.state is State.RUNNING and h.launcher.attempts(0) == [0, 1]  # waits for the new announcements
    h.tick(4.0, *reports({0: [(3, 3), (2, 2)]}))
    assert sim.state is State.DONE


def test_a_restored_study_relaunches_only_what_was_not_finished() -> None:
    h = Harness(simulations=3, max_retries=1)
    h.running(0.0, 0, 1, 2)
    h.launcher.exit(1, 1)  # one failure of simulation 1: its retry is spent
    h.tick(1.0)
    h.tick(2.0, *reports({0: [(5, 5), (5, 5)]}))
    saved = h.study.state_dict()
    assert [s["state"] for s in saved["simulations"]] == ["done", "queued", "running"]
    restored = Harness(simulations=3, max_retries=1, restored=saved)
    assert [(sim, attempt) for sim, attempt, _ in restored.launcher.submitted] == [(1, 1), (2, 1)]
    assert restored.expected == [(1, 1), (2, 1)]
    assert restored.state(0) is State.DONE and restored.study.simulations[1].failures == 1
    restored.launcher.start(1)
    restored.tick(3.0)
    restored.launcher.exit(1, 1)
    restored.tick(4.0)
    assert restored.state(1) is State.FAILED  # the failure before the restart still counts


def test_simulations_that_a_job_wide_stop_ends_are_no_failures_and_run_again_on_resume() -> None:
    """``scancel`` signals the simulations with the server: while the server stops, an attempt that ends is left
    unfinished, not failed (none retry is spent, even with none to spend), and nothing new is launched."""
    h = Harness(simulations=3, max_retries=0, job_limit=1)  # 0 and 1 launched (one wave ahead), 2 drawn later
    h.running(0.0, 0, 1)
    h.launcher.exit(0, -15)
    h.launcher.exit(1, 143)
    h.study.tick([ReceiverReport()] * RANKS, now=1.0, stopping=True)
    h.study.tick([ReceiverReport()] * RANKS, now=2.0, stopping=True)
    assert [h.state(s) for s in range(3)] == [State.RUNNING, State.RUNNING, State.QUEUED]
    assert [sim.failures for sim in h.study.simulations] == [0, 0, 0]
    assert [(sim, attempt) for sim, attempt, _ in h.launcher.submitted] == [(0, 0), (1, 0)]  # 2 not launched
    restored = Harness(simulations=3, max_retries=0, job_limit=1, restored=h.study.state_dict())
    assert sorted((sim, attempt) for sim, attempt, _ in restored.launcher.submitted) == [(0, 1), (1, 1), (2, 0)]
    said = "relaunched: the server's run ended while attempt 0 ran (a crash, a kill or a stop)"
    assert [sim.reason for sim in restored.study.simulations] == [said, said, ""]  # 2 never ran: no relaunch


def test_a_simulation_waiting_for_its_retry_keeps_its_failures_reason_on_resume() -> None:
    """Only a simulation that ran when the server's run ended is said to be relaunched for it."""
    h = Harness(simulations=2, max_retries=2)
    h.running(0.0, 0, 1)
    h.launcher.outputs[(0, 0)] = "ValueError: grid too coarse"
    h.launcher.exit(0, 1)
    h.tick(1.0)  # simulation 0 failed, queued for its retry; 1 runs
    failed = h.study.simulations[0].reason
    assert failed.startswith("exit code 1") and h.state(0) is State.QUEUED, failed
    restored = Harness(simulations=2, max_retries=2, restored=h.study.state_dict())
    assert restored.study.simulations[0].reason == failed
    assert (
        restored.study.simulations[1].reason == f"relaunched: the server's run ended while attempt 0 ran {INTERRUPTED}"
    )


def test_a_deterministic_refusal_fails_the_simulation_at_once_without_retry(h: Harness) -> None:
    h.running(0.0, 0, 1)
    h.study.take_news()
    h.study.fail(0, "handshake: simulation 0, field 'u': declares float64[4], the study's is float32[4]")
    sim = h.study.simulations[0]
    assert (sim.state, sim.failures, h.launcher.killed) == (State.FAILED, 1, [0])
    assert "float64[4]" in sim.reason and h.expected[-1] == (0, None)
    assert h.study.take_news() == ({}, [0], {})
    h.study.fail(0, "again")  # a second refusal of the same attempt changes nothing
    h.tick(TIMEOUT * 3, *reports(active=[1]))
    assert h.launcher.attempts(0) == [0] and sim.reason.startswith("handshake:") and h.state(1) is State.RUNNING


def test_a_failure_carries_the_end_of_the_simulations_output_and_its_log(
    h: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    """The reason a user needs is the simulation's own exception, in its log (issue 13, item 1)."""
    h.running(0.0, 0)
    h.launcher.outputs[(0, 0)] = "Traceback (most recent call last): | ValueError: grid too coarse"
    h.launcher.exit(0, 1)
    h.tick(1.0)
    sim = h.study.simulations[0]
    assert (sim.log, sim.output) == ("simulations/simulation0.attempt0.log", h.launcher.outputs[(0, 0)])
    assert (
        sim.reason == "exit code 1; output (simulations/simulation0.attempt0.log): Traceback (most recent call "
        "last): | ValueError: grid too coarse"
    )
    assert (
        "simulation 0 attempt 0: exit code 1; output (simulations/simulation0.attempt0.log): Traceback "
        "(most recent call last): | ValueError: grid too coarse; relaunching" in caplog.text
    )
    entry = final_report(h.study, reports(), {}, 0, 1.0, None)["per_simulation"][0]
    assert (entry["log"], entry["output"]) == (sim.log, sim.output)


@pytest.mark.parametrize("code", NOT_RUNNABLE)
def test_a_program_that_cannot_run_fails_at_once(h: Harness, code: int, caplog: pytest.LogCaptureFixture) -> None:
    h.launcher.outputs[(0, 0)] = "bash: sim.sh: No such file or directory"
    h.launcher.exit(0, code)
    h.tick(1.0)
    assert (h.state(0), h.launcher.attempts(0)) == (State.FAILED, [0])
    assert f"simulation 0 failed at attempt 0, not retried: exit code {code}; output" in caplog.text
    h.launcher.exit(1, code)  # without output, the line still names the log
    h.tick(2.0)
    assert f"not retried: exit code {code} (log simulations/simulation1.attempt0.log)" in caplog.text


def test_frames_refused_for_what_they_hold_fail_the_simulation_at_once(h: Harness) -> None:
    """A NaN field is sent again by a relaunch with the same parameters: the reason names the refusal."""
    h.running(0.0, 0, 1)
    refused = reports({0: [(3, 4), (0, 4)]})
    refused[1].refused[0] = ("non_finite", "simulation 0, step 3: field 'u': NaN or infinite values")
    h.launcher.exit(0, 0)
    h.tick(1.0, *refused)
    sim = h.study.simulations[0]
    assert (sim.state, h.launcher.attempts(0)) == (State.FAILED, [0])
    assert (
        sim.reason == "exited with steps missing; its frames were refused: simulation 0, step 3: field 'u': "
        "NaN or infinite values"
    )
    h.launcher.exit(1, 0)  # another kind of refusal (a stale attempt's frame) is no reason to give up the simulation
    stale = reports({1: [(1, 4), (0, 4)]})
    stale[0].refused[1] = ("routing", "simulation 1, step 0: sent to rank 0, not its owner")
    h.tick(2.0, *stale)
    assert h.launcher.attempts(1) == [0, 1]


def test_a_client_usage_error_is_not_retried(h: Harness) -> None:
    h.running(0.0, 0)
    h.launcher.outputs[(0, 0)] = (
        "Traceback | melissa_dl.errors.ClientError: field 'u': got float64[4], declared float32[4]"
    )
    h.launcher.exit(0, 1)
    h.tick(1.0)
    assert (h.state(0), h.launcher.attempts(0)) == (State.FAILED, [0])


def test_a_study_whose_first_simulations_all_fail_stops(caplog: pytest.LogCaptureFixture) -> None:
    """Instead of running every simulation to failure and writing an untrained model (issue 13, item 2)."""
    h = Harness(simulations=6, max_retries=0, job_limit=2)
    h.running(0.0, 0, 1, 2, 3)
    for sim in (0, 1):
        h.launcher.exit(sim, 1)
    h.tick(1.0)
    assert not h.study.gave_up and h.state(2) is State.RUNNING  # 2 failures: fewer than GIVE_UP_AFTER
    h.launcher.exit(2, 1)
    h.tick(2.0)
    assert h.study.gave_up == f"the first {GIVE_UP_AFTER} simulations to end all failed"
    assert [h.state(s) for s in range(3, 6)] == [State.RUNNING, State.FAILED, State.FAILED]  # 3 may still succeed
    assert h.launcher.killed == [4, 5] and h.launcher.queued() == []
    assert h.study.simulations[5].reason == "not run: the first 3 simulations to end all failed"
    assert "stopping the study" in caplog.text and not h.study.over
    h.launcher.exit(3, 1)
    h.tick(3.0)
    assert (h.state(3), h.launcher.attempts(3)) == (State.FAILED, [0])  # not relaunched
    assert h.study.over


def test_one_success_keeps_the_study_going() -> None:
    h = Harness(simulations=6, max_retries=0, job_limit=4)
    h.running(0.0, 0, 1, 2, 3)
    h.tick(0.5, *reports({0: [(2, 2), (2, 2)]}))
    for sim in (1, 2, 3):
        h.launcher.exit(sim, 1)
    h.tick(1.0)
    assert not h.study.gave_up and h.state(4) is State.QUEUED


def test_counts_follow_every_transition_of_a_large_study() -> None:
    h = Harness(simulations=1000, max_retries=1, restored=[{"state": "done"}, {"state": "failed"}])

    def recounted() -> dict[str, int]:
        return {state.value: sum(s.state is state for s in h.study.simulations) for state in State}

    assert h.study.counts() == recounted() == {"queued": 998, "running": 0, "done": 1, "failed": 1}
    h.running(0.0, 2, 3, 4, 5)
    h.launcher.exit(3, 1)  # relaunched: queued again
    h.launcher.exit(4, 1)
    h.tick(1.0, *reports({2: [(1, 1), (0, 0)]}))  # done
    h.running(2.0, 4)
    h.launcher.exit(4, 1)  # its last retry: failed
    h.tick(3.0)
    assert h.study.counts() == recounted() == {"queued": 995, "running": 1, "done": 2, "failed": 2}
    assert not h.study.over


def waiting_study() -> Harness:
    """Two simulations drawn, done with 3 steps each; the next generation waits for their statistics."""
    breeding = Breeding(population=2, breed_after=2, lag=0, window=2, sigma=[0.1], start=1.0, end=1.0, breakpoint=1)
    h = Harness(simulations=4, sampler=AdaptiveSampler([0.0], [1.0], 0, 4, breeding, HaltonSampler))
    h.running(0.0, 0, 1)
    for sim in (0, 1):
        h.launcher.exit(sim, 0)
    h.tick(1.0, *reports({0: [(2, 2), (1, 1)], 1: [(2, 2), (1, 1)]}))
    assert h.state(0) is State.DONE and h.state(1) is State.DONE and h.study.sampler.drawn == 2
    return h


def losses(sim: int, steps: range, loss: float) -> tuple[np.ndarray, np.ndarray]:
    return np.array([[sim, t] for t in steps]), np.full(len(steps), loss)


def test_a_learning_sampler_is_told_a_simulation_once_every_step_has_its_loss() -> None:
    h = waiting_study()
    h.study.learn([losses(0, range(3), 2.0), losses(1, range(2), 1.0)])
    h.tick(2.0)
    assert h.study.simulations[0].statistic == 2.0 and h.study.simulations[1].statistic is None
    assert h.study.sampler.drawn == 2  # simulation 1 has a step untrained: the generation waits
    h.study.learn([losses(1, range(2, 3), 4.0)])
    h.tick(3.0)
    assert h.study.simulations[1].statistic == pytest.approx(2.0) and h.study.sampler.drawn == 4


def test_a_waiting_sampler_gets_partial_statistics_only_when_training_has_stopped_bringing_losses() -> None:
    h = waiting_study()
    h.study.learn([losses(0, range(1), 2.0)])
    h.tick(2.0)
    h.tick(2.0 + LEARNING_GRACE - 0.1)  # nothing runs, but training may still bring the rest
    assert h.study.sampler.drawn == 2 and h.study.simulations[0].statistic is None
    h.tick(2.0 + LEARNING_GRACE)
    assert h.study.sampler.drawn == 4  # what they have: simulation 0 one step, simulation 1 none
    assert h.study.simulations[0].statistic == 2.0 and h.study.simulations[1].statistic is None


def test_a_generation_is_pictured_once_the_study_has_drawn_all_of_it() -> None:
    breeding = Breeding(population=2, breed_after=4, lag=0, window=4, sigma=[0.1], start=1.0, end=1.0, breakpoint=1)
    h = Harness(simulations=6, job_limit=1, sampler=AdaptiveSampler([0.0], [1.0], 0, 6, breeding, HaltonSampler))
    assert h.study.sampler.drawn == 2 and h.study.take_generations() == []  # generation 0 is simulations 0-3
    for sim in (0, 1):  # each done frees a slot: one more is drawn
        h.running(float(sim), sim)
        h.launcher.exit(sim, 0)
        h.tick(sim + 0.5, *reports({sim: [(2, 2), (1, 1)]}))
        if h.study.sampler.drawn < 4:
            assert h.study.take_generations() == []
    assert h.study.sampler.drawn == 4
    [generation] = h.study.take_generations()
    assert generation.number == 0 and not np.isnan(generation.drawn).any() and len(generation.drawn) == 4
    assert h.study.take_generations() == []


def test_a_simulation_whose_process_ended_before_its_steps_were_counted_is_ending_not_running(h: Harness) -> None:
    """Its job slot is free, so the running ones alone stay within job_limit."""
    h.running(0.0, 0, 1)
    h.launcher.exit(0, 0)
    h.tick(1.0, *reports({0: [(3, 3), (1, None)]}))  # its last announcement is still on its way
    assert (h.state(0), h.study.counts()["running"], h.study.ending()) == (State.RUNNING, 2, 1)
    h.tick(2.0, *reports({0: [None, (2, 2)]}))
    assert (h.state(0), h.study.counts()["running"], h.study.ending()) == (State.DONE, 1, 0)


def test_a_study_built_from_its_sections_takes_the_launcher_section_s_bounds_and_the_study_s_names() -> None:
    config = parse_config(
        {
            "study": {
                "fields": ["u"],
                "parameters": [{"name": "a", "low": 0, "high": 1}, {"name": "b", "low": 0, "high": 2}],
                "simulations": 3,
                "loss_statistic": "max",
            },
            "launcher": {"command": ["sim"], "max_retries": 4, "simulation_timeout": 7.5, "job_limit": 2},
        },
        Path("/studies/x"),
    )
    sampler = UniformSampler([0.0, 0.0], [1.0, 2.0], 0, 3)
    study = Study.from_config(
        config.study,
        config.launcher,
        RANKS,
        FakeLauncher(),
        sampler,
        lambda *_: {},
        lambda *_: None,  # type: ignore[arg-type]
    )
    assert len(study.simulations) == 3 and study.names == ["a", "b"] and study.losses.statistic == "max"
    assert (study._max_retries, study._timeout, study._job_limit) == (4, 7.5, 2)


def test_held_out_simulations_follow_the_study_s_run_first_and_the_sampler_never_hears_of_them() -> None:
    breeding = Breeding(population=2, breed_after=2, lag=0, window=2, sigma=[0.1], start=1.0, end=1.0, breakpoint=1)
    sampler = AdaptiveSampler([0.0], [1.0], 0, 2, breeding, HaltonSampler)
    told: list[int] = []
    sampler.tell = lambda sid, statistic: told.append(sid)  # type: ignore[method-assign]
    h = Harness(simulations=2, job_limit=1, sampler=sampler, held_out=np.array([[0.25], [0.75]]))
    assert [sim for sim, _, _ in h.launcher.submitted] == [2, 3]  # the held-out ones first, with their parameters
    assert h.launcher.named[2] == {"0": 0.25} and h.study.describe(3)["held_out"] is True
    assert not h.study.held_out_ended
    h.running(1.0, 2, 3)
    h.tick(2.0, *reports({2: [(1, 1), (1, 1)], 3: [(0, 0), (2, 2)]}))
    h.launcher.exit(2, 0)
    h.launcher.exit(3, 0)
    h.tick(3.0)
    assert h.state(2) is h.state(3) is State.DONE and h.study.held_out_ended
    h.study.conclude()
    assert told == []  # their losses are no statistic of the sampler's
