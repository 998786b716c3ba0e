"""The study's PNGs: drawn from its status history and rank 0's TensorBoard events (issue 13, item 4)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import matplotlib.image
import pytest
from matplotlib.figure import Figure
from torch.utils.tensorboard import SummaryWriter

from melissa_dl.runtime.metrics import TRAIN_LOSS, VALIDATION_LOSS
from melissa_dl.runtime.status import HISTORY
from melissa_dl.study.plots import (
    BUFFERS,
    INTAKE,
    LOSS,
    SIMULATIONS,
    SMOOTHING,
    buffers,
    draw,
    intake,
    loss,
    read_losses,
    simulations,
    smoothed,
    with_restarts_apart,
)

pytestmark = pytest.mark.timeout(60)

START = 1_700_000_000.0


def status(second: float, done: int, received: int, batches: int | None) -> dict:
    return {
        "state": "running",
        "updated": START + second,
        "elapsed_s": second,
        "percent": 0,
        "eta_s": None,
        "simulations": {"queued": 4 - done - 1, "running": 1, "done": done, "failed": 0, "total": 4},
        "samples": {"received": received, "expected": 40, "consumed": received},
        "MB_per_s": 1.5,
        "buffers": [received % 7, received % 5],
        "refused": 0,
        "training": None
        if batches is None
        else {"batches": batches, "batches_per_s": 10.0, "loss": 0.1, "validation_loss": None},
    }


def study_output(tmp_path: Path, trained: bool) -> Path:
    history = [status(s, done, 10 * done, 20 * s if trained else None) for s, done in ((1, 0), (2, 1), (3, 2))]
    (tmp_path / HISTORY).write_text("".join(json.dumps(h) + "\n" for h in history))
    if trained:
        writer = SummaryWriter(str(tmp_path / "tensorboard" / "rank0"))
        for batch in range(0, 60, 10):
            writer.add_scalar(TRAIN_LOSS, 1.0 / (batch + 1), batch, walltime=START + 1 + batch / 20)
        for batch in (0, 30, 60):
            writer.add_scalar(VALIDATION_LOSS, 2.0 / (batch + 1), batch, walltime=START + 1 + batch / 20)
        writer.close()
    return tmp_path


@pytest.mark.parametrize("trained", [True, False])
def test_draw_writes_readable_pngs_next_to_the_report(tmp_path: Path, trained: bool) -> None:
    output = study_output(tmp_path, trained)
    with open(output / HISTORY, "a") as history:
        history.write('{"state": "runn')  # torn by a server killed while appending: skipped
    paths = draw(output)
    expected = [INTAKE, BUFFERS, SIMULATIONS, *([LOSS] if trained else [])]
    assert [path.name for path in paths] == expected
    for path in paths:
        height, width, _ = matplotlib.image.imread(path).shape
        assert width >= 600 and height >= 300, path


def test_the_figures_hold_the_curves_with_labelled_axes(tmp_path: Path) -> None:
    output = study_output(tmp_path, trained=True)
    history = [json.loads(line) for line in (output / HISTORY).read_text().splitlines()]
    losses = read_losses(output / "tensorboard" / "rank0", START, 1.0)
    assert losses[TRAIN_LOSS][0] == [0, 10, 20, 30, 40, 50]
    assert losses[VALIDATION_LOSS][1] == pytest.approx([1.0, 2.5, 4.0])  # seconds since the start
    by_batch, by_time = loss(losses, "wall time (s)").axes
    assert (by_batch.get_xlabel(), by_batch.get_ylabel(), by_time.get_xlabel()) == ("batches", "loss", "wall time (s)")
    assert [list(line.get_ydata()) for line in by_batch.get_lines()][1] == pytest.approx([2.0, 2.0 / 31, 2.0 / 61])
    (axes,) = buffers([1, 2, 3], "wall time (s)", history).axes
    assert [list(line.get_ydata()) for line in axes.get_lines()] == [[0, 3, 6], [0, 0, 0]]
    assert (axes.get_ylabel(), [text.get_text() for text in axes.get_legend().get_texts()]) == (
        "samples held",
        ["rank 0", "rank 1"],
    )
    history[0]["buffers"] = [4]  # before a restart on more ranks
    (axes,) = buffers([1, 2, 3], "wall time (s)", history).axes
    first, second = (list(line.get_ydata()) for line in axes.get_lines())
    assert first == [4, 3, 6] and second == pytest.approx([float("nan"), 0, 0], nan_ok=True)
    (axes,) = simulations([1, 2, 3], "wall time (s)", history).axes
    assert axes.get_ylim() == (0, 4) and [t.get_text() for t in axes.get_legend().get_texts()] == [
        "done",
        "running",
        "queued",
        "failed",
    ]


def test_a_restart_breaks_the_lines_and_received_and_consumed_have_their_own_axes() -> None:
    """No line joins the last status before a crash to the first after the restart; a sample consumed many
    times does not flatten the received curve."""
    before = [status(1, 0, 10, 5), status(2, 1, 20, 10)]
    after = [status(1, 1, 20, 12), status(2, 2, 30, 15)]  # the restarted run's elapsed time starts again
    for h in after:
        h["updated"] += 100
        h["samples"]["consumed"] = 1000 * h["samples"]["received"]
    times, history = with_restarts_apart(before + after, START, 1.0)
    assert times[:2] == [1.0, 2.0] and math.isnan(times[2]) and times[3:] == [101.0, 102.0]
    assert [h["samples"]["received"] for h in history] == [10, 20, 20, 20, 30]
    samples, consumed, data, rates = intake(times, "wall time (s)", history).axes  # a panel per quantity
    assert [axes.get_title() for axes in (samples, consumed)] == ["samples received", "samples consumed (all ranks)"]
    assert consumed.get_ylim()[1] > 10 * samples.get_ylim()[1]
    assert data.get_title() == f"kB/s received (mean of {SMOOTHING} status intervals)"
    assert list(data.get_lines()[0].get_ydata())[0] == 1500.0  # 1.5 MB/s
    assert math.isnan(list(rates.get_lines()[0].get_xdata())[2])  # the restart's gap


def test_rates_are_the_mean_of_the_last_status_intervals_and_a_restart_breaks_the_loss_lines() -> None:
    """One interval's rate swung between 0 and its peak; the wall-time panel of the loss drew a straight line
    across a restart (issue 57, item 4)."""
    times = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, float("nan"), 21.0, 22.0]  # a restart after 6 s
    values = [0.0, 10.0, 0.0, 10.0, 0.0, 10.0, 10.0, 4.0, float("nan")]
    assert smoothed(values, times) == pytest.approx(
        [0.0, 5.0, 10 / 3, 5.0, 4.0, 6.0, float("nan"), 4.0, float("nan")], nan_ok=True
    )  # a window of 5 (fewer at first and after the restart); a value missing stays so
    losses = {TRAIN_LOSS: ([10, 20, 30, 40], [1.0, 2.0, 11.0, 12.0], [0.4, 0.3, 0.2, 0.1])}
    by_batch, by_time = loss(losses, "wall time (s)", restarts=[10.0]).axes
    assert list(by_time.get_lines()[0].get_xdata()) == pytest.approx([1.0, 2.0, float("nan"), 11.0, 12.0], nan_ok=True)
    assert list(by_batch.get_lines()[0].get_xdata()) == pytest.approx([10, 20, float("nan"), 30, 40], nan_ok=True)


def test_the_buffers_show_a_ranks_capacity_and_watermark_and_every_figure_its_study_and_time_origin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    output = study_output(tmp_path, trained=True)
    history = [json.loads(line) for line in (output / HISTORY).read_text().splitlines()]
    history[-1]["buffer_limits"] = {"capacity_samples": 40, "watermark": 8}
    (axes,) = buffers([1, 2, 3], "wall time (s)", history).axes
    assert [text.get_text() for text in axes.get_legend().get_texts()] == [
        "capacity (40)",
        "watermark (8)",
        "rank 0",
        "rank 1",
    ]
    saved: dict[str, tuple[str, str]] = {}  # file name: the figure's title, its last panel's x label

    def save(figure: Figure, path: Path, **options: object) -> None:
        saved[Path(path).name] = (figure.get_suptitle(), figure.axes[-1].get_xlabel())

    monkeypatch.setattr(Figure, "savefig", save)
    draw(output)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(START))
    study = f"{output.resolve().parent.name}/{output.name}"
    assert saved == {
        INTAKE: (f"{study}: Intake", f"wall time (s) since the server started, {started}"),
        BUFFERS: (f"{study}: Buffer fill per rank", f"wall time (s) since the server started, {started}"),
        SIMULATIONS: (f"{study}: Simulations by state", f"wall time (s) since the server started, {started}"),
        LOSS: (f"{study}: Loss", f"wall time (s) since the server started, {started}"),
    }
