"""The rank's one TensorBoard writer: points before it opens wait, sources join every point, a restart purges."""

from __future__ import annotations

import logging
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from melissa_dl.runtime.metrics import Metrics  # noqa: E402


def read(folder: Path) -> EventAccumulator:
    events = EventAccumulator(str(folder))
    events.Reload()
    return events


def steps(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(event.step, event.value) for event in events.Scalars(tag)]


def test_points_given_before_open_are_written_when_it_opens_and_a_figure_is_drawn_only_then(tmp_path: Path) -> None:
    drawn: list[int] = []

    def draw() -> object:
        drawn.append(1)
        return plt.figure()

    metrics = Metrics(tmp_path)
    metrics.scalar("sampling/bred_fraction", 0.5, 1)
    metrics.figure("sampling/generations", draw, 1)
    assert drawn == [] and not any(tmp_path.iterdir())
    metrics.open(purge_step=1)
    metrics.scalar("sampling/bred_fraction", 0.75, 2)
    metrics.close()
    assert drawn == [1]
    events = read(tmp_path)
    assert steps(events, "sampling/bred_fraction") == [(1, 0.5), (2, 0.75)]
    assert events.Tags()["images"] == ["sampling/generations"]


def test_every_source_is_read_with_each_training_point(tmp_path: Path) -> None:
    reads = iter(range(10))
    metrics = Metrics(tmp_path, [lambda: {"buffer/size": float(next(reads))}, lambda: {"receive/bytes_per_s": 7.0}])
    metrics.open(purge_step=1)
    for step in (1, 2):
        metrics.point(step, {"train/loss": 1.0 / step})
    metrics.close()
    events = read(tmp_path)
    assert steps(events, "train/loss") == [(1, 1.0), (2, 0.5)]
    assert steps(events, "buffer/size") == [(1, 0.0), (2, 1.0)]
    assert steps(events, "receive/bytes_per_s") == [(1, 7.0), (2, 7.0)]


@pytest.mark.parametrize("torn", [False, True])
def test_a_resumed_run_replaces_what_the_dead_one_logged_after_its_checkpoint_without_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, torn: bool
) -> None:
    """TensorBoard dropped the dead run's late points itself, warning "Detected out of order event.step likely
    caused by a TensorFlow restart" at every load (issue 57, item 1); a killed writer may leave a torn record."""
    dead = Metrics(tmp_path)
    dead.open(purge_step=1)
    for step in range(1, 6):
        dead.scalar("train/loss", float(step), step)
    dead.close()
    if torn:
        (events,) = tmp_path.glob("*tfevents*")
        events.write_bytes(events.read_bytes()[:-5])  # the last point, cut
    resumed = Metrics(tmp_path)
    resumed.open(purge_step=4)  # its checkpoint was taken after batch 3
    for step in range(4, 7):
        resumed.scalar("train/loss", 10.0 * step, step)
    resumed.close()
    caplog.set_level(logging.WARNING)
    assert steps(read(tmp_path), "train/loss") == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_a_rank_that_does_not_train_writes_and_keeps_nothing(tmp_path: Path) -> None:
    metrics = Metrics(None, [lambda: {"buffer/size": 1.0}])
    metrics.scalar("validation/loss", 1.0, 0)
    metrics.point(1, {"train/loss": 1.0})
    metrics.open(purge_step=1)
    metrics.close()
    assert metrics._waiting == [] and not any(tmp_path.iterdir())


def test_points_given_after_close_are_dropped_not_kept(tmp_path: Path) -> None:
    metrics = Metrics(tmp_path)
    metrics.open(purge_step=1)
    metrics.scalar("train/loss", 1.0, 1)
    metrics.close()
    metrics.scalar("train/loss", 2.0, 2)
    metrics.close()  # a second close does nothing
    assert metrics._waiting == [] and steps(read(tmp_path), "train/loss") == [(1, 1.0)]
