"""Rank 0's status: the status file, the progress history, a log line or a live bar (issue 13, item 3)."""

from __future__ import annotations

import io
import json
import logging
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from melissa_dl.ingest.receiver import ReceiverReport
from melissa_dl.runtime.status import HEARTBEAT, HISTORY, STATUS, lock_output
from melissa_dl.study.progress import StatusBoard, earlier_runs_seconds, rate, show_status

pytestmark = pytest.mark.timeout(60)


def study(
    done: int, running: int, queued: int, failed: int = 0, ending: int = 0, first_start: float | None = None
) -> SimpleNamespace:
    """``running`` counts the ``ending`` ones, as Study.counts() does; ``first_start``: when the first job
    started."""
    counts = {"queued": queued, "running": running, "done": done, "failed": failed}
    return SimpleNamespace(
        simulations=[None] * sum(counts.values()),
        counts=lambda: dict(counts),
        ending=lambda: ending,
        first_start=first_start,
    )


def reports(samples: int) -> list[ReceiverReport]:
    return [
        ReceiverReport(bytes_received=samples * 1000, samples=samples, buffer_size=3, rejected={"dtype": 1}),
        ReceiverReport(bytes_received=0, samples=0, buffer_size=2),
    ]


def test_a_status_every_interval_with_share_eta_rates_and_training(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    start = time.monotonic()
    board = StatusBoard(
        tmp_path, interval=2.0, start=start, expected_samples=400, refusals=lambda: {"handshake_cut": 2}
    )
    board.update(
        start + 1.0,
        study(0, 4, 0, first_start=start),
        reports(50),
        20,
        {"batches": 5, "loss": 0.5, "validation_loss": None},
    )
    assert not (tmp_path / STATUS).exists()  # within the interval: nothing yet
    board.update(
        start + 4.0,
        study(1, 3, 0, ending=1, first_start=start),
        reports(100),
        80,
        {"batches": 40, "loss": 0.25, "validation_loss": 0.3},
    )
    status = json.loads((tmp_path / STATUS).read_text())
    assert (status["state"], status["percent"], status["eta_s"]) == ("running", 25.0, 12.0)
    assert status["simulations"] == {"queued": 0, "running": 2, "ending": 1, "done": 1, "failed": 0, "total": 4}
    assert status["samples"] == {"received": 100, "expected": 400, "consumed": 80}
    assert (status["MB_per_s"], status["buffers"]) == (0.025, [3, 2])
    assert status["refused"] == {"dtype": 1, "handshake_cut": 2}  # every socket's, by kind
    assert "buffers 5 samples | 3 refused (handshake_cut 2, dtype 1)" in caplog.text
    assert status["training"] == {
        "batches": 40,
        "loss": 0.25,
        "validation_loss": 0.3,
        "batches_per_s": 10.0,
        "after_data": None,  # no passes after the data (training.epochs_after_data), or the data has not ended
    }
    assert (
        "25% done, 4 s elapsed, about 12 s left | simulations 1 done, 2 running, 1 ending, 0 queued, 0 failed of 4"
    ) in caplog.text
    board.finish(study(4, 0, 0), reports(400), 500, {"batches": 90, "loss": 0.1, "validation_loss": 0.2})
    shown = show_status(tmp_path)
    assert shown.startswith(f"study in {tmp_path}: finished") and "100% done" in shown and "about" not in shown
    assert "training 90 batches" in shown and "validation loss 0.2" in shown
    assert "; ended when the data ran out (every simulation ended, the buffers drained: training.epochs_after" in shown
    assert [json.loads(line)["state"] for line in (tmp_path / HISTORY).read_text().splitlines()] == [
        "running",
        "finished",
    ]


def test_passes_after_the_data_are_shown_as_the_slowest_rank_is_and_said_at_the_end(tmp_path: Path) -> None:
    start = time.monotonic()
    board = StatusBoard(tmp_path, interval=1.0, start=start, expected_samples=None)
    ranks = [ReceiverReport(samples=10, passes=(2, 5)), ReceiverReport(samples=10, passes=(1, 5))]
    board.update(start + 2.0, study(4, 0, 0), ranks, 80, {"batches": 20, "loss": 0.5, "validation_loss": None})
    assert json.loads((tmp_path / STATUS).read_text())["training"]["after_data"] == {"passes": 5, "passes_done": [2, 1]}
    assert "training 20 batches, 10.0 batch/s, loss 0.5, after the data: pass 2 of 5" in show_status(tmp_path)
    every_rank_done = [ReceiverReport(samples=10, passes=(5, 5))] * 2  # the moment before training ends
    board.update(
        start + 4.0, study(4, 0, 0), every_rank_done, 80, {"batches": 25, "loss": 0.4, "validation_loss": None}
    )
    assert "after the data: pass 5 of 5" in show_status(tmp_path)
    ranks = [ReceiverReport(samples=10, passes=(5, 5)), ReceiverReport(samples=10, passes=(4, 5))]
    board.finish(study(4, 0, 0), ranks, 100, {"batches": 25, "loss": 0.4, "validation_loss": None})
    assert (
        "; ended when a rank finished its 5 passes over what its buffer held when the data ended (passes per rank: "
        "5, 4)"
    ) in show_status(tmp_path)


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_on_a_terminal_a_live_bar_replaces_the_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    terminal = Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    start = time.monotonic()
    board = StatusBoard(tmp_path, interval=1.0, start=start, expected_samples=None)
    board.update(start + 2.0, study(2, 2, 0), reports(10), 10, None)
    assert "50%" in terminal.getvalue() and "simulations 2 done, 2 running" in terminal.getvalue()
    assert "% done" not in caplog.text
    board.finish(study(4, 0, 0), reports(20), 20, None)
    assert "100%" in terminal.getvalue()


def test_a_stopped_study_says_so(tmp_path: Path) -> None:
    start = time.monotonic()
    board = StatusBoard(tmp_path, interval=1.0, start=start, expected_samples=None)
    board.stopped()  # before any status: nothing to say
    assert not (tmp_path / STATUS).exists()
    board.update(start + 2.0, study(1, 3, 0), reports(10), 10, None)
    board.stopped()
    assert show_status(tmp_path).startswith(f"study in {tmp_path}: stopped")


def test_a_running_status_of_a_server_that_is_gone_says_not_running(tmp_path: Path) -> None:
    """A killed server leaves "running" in its status: its lock is free and its heartbeat silent."""
    start = time.monotonic()
    board = StatusBoard(tmp_path, interval=1.0, start=start, expected_samples=None)
    board.update(start + 2.0, study(1, 3, 0), reports(10), 10, None)
    lock = lock_output(tmp_path)
    (tmp_path / HEARTBEAT).touch()
    os.utime(tmp_path / HEARTBEAT, (time.time() - 60, time.time() - 60))
    assert show_status(tmp_path).startswith(f"study in {tmp_path}: running")  # the lock is held
    lock.close()  # as the kernel does at kill -9
    assert show_status(tmp_path).startswith(
        f"study in {tmp_path}: not running (its last status, of 0 s ago, says running: the server was killed or "
        "crashed; the same command resumes it)"
    )
    (tmp_path / HEARTBEAT).touch()  # a beat of a server whose lock this node cannot see
    assert show_status(tmp_path).startswith(f"study in {tmp_path}: running")


def test_a_small_data_rate_is_shown_in_kb_per_second_not_as_zero() -> None:
    assert [rate(value) for value in (2.345, 0.1, 0.0123, 0.000004, 0.0)] == [
        "2.3 MB/s",
        "0.1 MB/s",
        "12.3 kB/s",
        "0.0 kB/s",
        "0.0 MB/s",
    ]


def test_the_runs_before_a_restart_count_in_the_studys_duration(tmp_path: Path) -> None:
    """Each run's clock starts again; its last status says how long it ran (a torn last line is skipped)."""
    now = time.time()
    statuses = [(now - 500, 10.0), (now - 480, 30.0), (now - 200, 5.0), (now - 100, 105.0), (now - 5, 2.0)]
    (tmp_path / HISTORY).write_text(
        "".join(json.dumps({"updated": updated, "elapsed_s": elapsed}) + "\n" for updated, elapsed in statuses)
        + '{"updated": 1'
    )
    assert earlier_runs_seconds(tmp_path, began=now - 7) == 30.0 + 105.0  # the run of now - 7 is this one
    assert earlier_runs_seconds(tmp_path / "elsewhere", began=now) == 0.0


@pytest.mark.parametrize("restored", [0, 500])
def test_the_time_left_counts_from_the_first_simulations_start_not_the_servers(tmp_path: Path, restored: int) -> None:
    """A 10 s start-up (imports, MPI, a restore), then 1,000 samples at 50 a second (issue 57, item 2): at 20% of
    what the run has to do, the time left is within half of the truth; counted from the server's start it was 3.5
    times the truth. A resumed run (``restored`` samples received before) counts its own progress only."""
    start, expected = 100.0, 1000 + restored
    board = StatusBoard(tmp_path, interval=1.0, start=start, expected_samples=expected)
    first_start = start + 10.0
    for second in range(1, 15):
        now = start + second
        began = first_start if now >= first_start else None
        received = restored + max(0, int((now - first_start) * 50))
        board.update(now, study(0, 4, 0, first_start=began), reports(received), 0, None)
    status = json.loads((tmp_path / STATUS).read_text())
    assert status["samples"]["received"] == restored + 200  # 20% of the run's 1,000
    truth = 800 / 50
    assert abs(status["eta_s"] - truth) <= truth / 2, status


def test_a_finished_status_gives_the_reports_rates_where_the_report_and_model_are_and_the_validation_gain(
    tmp_path: Path,
) -> None:
    """The last second's rates said less than the study did (7.3 batch/s against the report's 13.3): the finished
    status takes the report's, over the study's whole duration (issue 57, item 2)."""
    start = time.monotonic()
    board = StatusBoard(tmp_path, interval=1.0, start=start, expected_samples=400)
    training = {"batches": 90, "loss": 0.1, "validation_loss": 0.005}
    report = {
        "throughput_MB_per_s": 2.5,
        "training": {
            "batches_per_s": 13.3,
            "model": str(tmp_path / "model.pt"),
            "first_validation_loss": 0.6,
            "last_validation_loss": 0.005,
        },
    }
    board.finish(study(4, 0, 0), reports(400), 500, training, (report, tmp_path / "report.json"))
    status = json.loads((tmp_path / STATUS).read_text())
    assert (status["MB_per_s"], status["report"]) == (2.5, str(tmp_path / "report.json"))
    assert status["training"]["batches_per_s"] == 13.3 and status["training"]["validation_gain"] == 120.0
    shown = show_status(tmp_path)
    assert "2.5 MB/s" in shown and "training 90 batches, 13.3 batch/s" in shown
    assert "validation loss 0.005 (120.0x lower than the first)" in shown
    assert f"report {tmp_path / 'report.json'} | model {tmp_path / 'model.pt'}" in shown
