"""Pictures of a study, next to its report: losses, intake, buffers, and simulations over time.

Drawn by rank 0 at the end of a study, and on demand (``melissa-server --plot
OUTPUT_DIR``), from what the study left in its output folder: rank 0's status
history (``progress.jsonl``, one line per status interval) and rank 0's
TensorBoard events (the loss of every logged batch, with its wall time).
TensorBoard stays the place for live curves; these are the record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")  # files only: no display on a compute node

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from melissa_dl.runtime.metrics import TRAIN_LOSS, VALIDATION_LOSS  # noqa: E402
from melissa_dl.runtime.status import HISTORY, read_history, runs  # noqa: E402

LOSS, INTAKE, BUFFERS, SIMULATIONS = "loss.png", "intake.png", "buffers.png", "simulations.png"
STATES = ("done", "running", "queued", "failed")


def draw(output: Path) -> list[Path]:
    """Write the study's PNGs into ``output``; returns their paths (the loss only when something was trained)."""
    history = read_history(output / HISTORY)
    if not history:
        raise FileNotFoundError(f"{output / HISTORY} is empty")
    start = history[0]["updated"] - history[0]["elapsed_s"]
    scale, unit = time_unit(history[-1]["updated"] - start)
    times, history = with_restarts_apart(history, start, scale)
    figures = {
        INTAKE: intake(times, unit, history),
        BUFFERS: buffers(times, unit, history),
        SIMULATIONS: simulations(times, unit, history),
    }
    losses = read_losses(output / "tensorboard" / "rank0", start, scale)
    if losses:
        figures[LOSS] = loss(losses, unit)
    paths = []
    for name, figure in figures.items():
        figure.savefig(output / name, dpi=100)
        plt.close(figure)
        paths.append(output / name)
    return paths


def with_restarts_apart(
    history: list[dict[str, Any]], start: float, scale: float
) -> tuple[list[float], list[dict[str, Any]]]:
    """The statuses' times since ``start`` in units of ``scale``, and the statuses, with a point of no time
    (NaN: matplotlib ends a line there) between two server runs, so that no line joins the last status before a
    crash to the first after the restart."""
    times: list[float] = []
    kept: list[dict[str, Any]] = []
    for number, run in enumerate(runs(history)):
        if number:
            times.append(float("nan"))
            kept.append(run[0])
        times.extend((status["updated"] - start) / scale for status in run)
        kept.extend(run)
    return times, kept


def time_unit(seconds: float) -> tuple[float, str]:
    """Seconds per unit and the axis label that keep a study's duration readable."""
    if seconds < 180:
        return 1.0, "wall time (s)"
    return (60.0, "wall time (min)") if seconds < 3 * 3600 else (3600.0, "wall time (h)")


def read_losses(events: Path, start: float, scale: float) -> dict[str, tuple[list[int], list[float], list[float]]]:
    """The training and validation losses of rank 0's events: batches, times since the start, values."""
    if not events.is_dir():
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})  # 0: every point
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    return {
        tag: ([e.step for e in points], [(e.wall_time - start) / scale for e in points], [e.value for e in points])
        for tag in (TRAIN_LOSS, VALIDATION_LOSS)
        if tag in tags
        for points in [accumulator.Scalars(tag)]
    }


def loss(losses: dict[str, tuple[list[int], list[float], list[float]]], unit: str) -> Figure:
    figure, (by_batch, by_time) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for tag, (batches, times, values) in losses.items():
        label = "training (rank 0)" if tag == TRAIN_LOSS else "validation"
        style: dict[str, Any] = {"marker": "o", "markersize": 3} if tag == VALIDATION_LOSS else {"linewidth": 1}
        by_batch.plot(batches, values, label=label, **style)
        by_time.plot(times, values, label=label, **style)
    for axes, xlabel in ((by_batch, "batches"), (by_time, unit)):
        axes.set(xlabel=xlabel, ylabel="loss", yscale="log")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    figure.suptitle("Loss")
    return figure


def intake(times: list[float], unit: str, history: list[dict[str, Any]]) -> Figure:
    """Samples received and consumed, each on its own axis (a sample may be consumed many times); the training's
    and the data's rates, each on its own axis (batches/s and kB/s differ by orders of magnitude)."""
    figure, (samples, batches) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    consumed, data = samples.twinx(), batches.twinx()
    samples.plot(times, [h["samples"]["received"] for h in history], color="tab:blue", label="received")
    consumed.plot(times, [h["samples"]["consumed"] for h in history], color="tab:orange", label="consumed (all ranks)")
    samples.set(xlabel=unit, ylabel="samples received", title="Samples")
    consumed.set(ylabel="samples consumed")
    trained = [(m, h["training"]["batches_per_s"]) for m, h in zip(times, history) if h["training"]]
    if trained:
        batches.plot(*zip(*trained), color="tab:green", label="training batches/s")
    data.plot(times, [h["MB_per_s"] * 1000 for h in history], color="tab:red", label="received kB/s")
    batches.set(xlabel=unit, ylabel="batches/s", title="Rates over each status interval")
    data.set(ylabel="kB/s received")
    for left, right in ((samples, consumed), (batches, data)):
        left.grid(True, alpha=0.3)
        lines = left.get_lines() + right.get_lines()
        left.legend(lines, [line.get_label() for line in lines], loc="upper left")
    return figure


def buffers(times: list[float], unit: str, history: list[dict[str, Any]]) -> Figure:
    figure, axes = plt.subplots(figsize=(7, 4), constrained_layout=True)
    for rank in range(max(len(h["buffers"]) for h in history)):  # a restart may change the number of ranks
        fill = [h["buffers"][rank] if rank < len(h["buffers"]) else float("nan") for h in history]
        axes.plot(
            times,
            fill,
            label=f"rank {rank}",
            marker="o",
            markersize=3,  # styles: equal fills stay visible
            linestyle=("-", "--", ":", "-.")[rank % 4],
        )
    axes.set(xlabel=unit, ylabel="samples held", title="Buffer fill per rank")
    axes.grid(True, alpha=0.3)
    axes.legend()
    return figure


def simulations(times: list[float], unit: str, history: list[dict[str, Any]]) -> Figure:
    figure, axes = plt.subplots(figsize=(7, 4), constrained_layout=True)
    axes.stackplot(
        times,
        *([h["simulations"][state] for h in history] for state in STATES),
        labels=STATES,
        colors=("tab:green", "tab:blue", "tab:gray", "tab:red"),
        alpha=0.8,
    )
    axes.set(
        xlabel=unit, ylabel="simulations", title="Simulations by state", ylim=(0, history[0]["simulations"]["total"])
    )
    axes.grid(True, alpha=0.3)
    axes.legend(loc="upper left")
    return figure


def generation(
    number: int,
    bred_fraction: float,
    names: list[str],
    drawn: np.ndarray,
    bred: np.ndarray,
    known: np.ndarray,
    statistics: np.ndarray,
) -> Figure:
    """Where a generation's simulations were put (crosses: bred, plus signs: from the base sampler) among the
    simulations whose loss statistic was known then (dots, coloured by it); one parameter: against the
    statistic."""
    figure, ax = plt.subplots(figsize=(4.8, 3.6), constrained_layout=True)
    one = len(names) == 1
    if len(known):
        dots = ax.scatter(known[:, 0], statistics if one else known[:, 1], c=statistics, cmap="viridis", s=14)
        figure.colorbar(dots, ax=ax, label="loss statistic")
    for chosen, marker, label in ((bred, "x", "bred"), (~bred, "+", "base")):
        if chosen.any():
            y = np.zeros(chosen.sum()) if one else drawn[chosen, 1]
            ax.scatter(drawn[chosen, 0], y, marker=marker, c="red" if label == "bred" else "black", s=30, label=label)
    ax.set(
        xlabel=names[0],
        ylabel="loss statistic" if one else names[1],
        title=f"generation {number}: {bred_fraction:.0%} bred",
    )
    ax.legend(loc="best", fontsize="small")
    return figure
