"""Pictures of a study, next to its report: losses, intake, buffers, and simulations over time.

Drawn by rank 0 at the end of a study, and on demand (``melissa-server --plot
OUTPUT_DIR``), from what the study left in its output folder: rank 0's status
history (``progress.jsonl``, one line per status interval) and rank 0's
TensorBoard events (the loss of every logged batch, with its wall time).
TensorBoard stays the place for live curves; these are the record.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
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
SMOOTHING = 5  # status intervals a rate on intake.png is averaged over
STATES = ("done", "running", "queued", "failed")


def draw(output: Path) -> list[Path]:
    """Write the study's PNGs into ``output``; returns their paths (the loss only when something was trained)."""
    history = read_history(output / HISTORY)
    if not history:
        raise FileNotFoundError(f"{output / HISTORY} is empty")
    start = history[0]["updated"] - history[0]["elapsed_s"]
    scale, unit = time_unit(history[-1]["updated"] - start)
    unit += f" since the server started, {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(start))}"
    restarts = [(run[0]["updated"] - run[0]["elapsed_s"] - start) / scale for run in runs(history)[1:]]
    times, history = with_restarts_apart(history, start, scale)
    figures = {
        INTAKE: intake(times, unit, history),
        BUFFERS: buffers(times, unit, history),
        SIMULATIONS: simulations(times, unit, history),
    }
    losses = read_losses(output / "tensorboard" / "rank0", start, scale)
    if losses:
        figures[LOSS] = loss(losses, unit, restarts)
    study = f"{output.resolve().parent.name}/{output.name}"
    paths = []
    for name, figure in figures.items():
        figure.suptitle(f"{study}: {figure.get_suptitle()}")
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


def loss(
    losses: dict[str, tuple[list[int], list[float], list[float]]], unit: str, restarts: Sequence[float] = ()
) -> Figure:
    """Against batches and against time, each line broken where a restarted run took over (``restarts``: its
    start, in the time axis' unit)."""
    figure, (by_batch, by_time) = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for tag, (batches, times, values) in losses.items():
        label = "training (rank 0)" if tag == TRAIN_LOSS else "validation"
        style: dict[str, Any] = {"marker": "o", "markersize": 3} if tag == VALIDATION_LOSS else {"linewidth": 1}
        breaks = np.flatnonzero(np.diff(np.searchsorted(restarts, times))) + 1  # where another run's points begin
        apart = [np.insert(np.asarray(v, float), breaks, np.nan) for v in (batches, times, values)]
        by_batch.plot(apart[0], apart[2], label=label, **style)
        by_time.plot(apart[1], apart[2], label=label, **style)
    for axes, xlabel in ((by_batch, "batches"), (by_time, unit)):
        axes.set(xlabel=xlabel, ylabel="loss", yscale="log")
        axes.grid(True, which="both", alpha=0.3)
        axes.legend()
    figure.suptitle("Loss")
    return figure


def intake(times: list[float], unit: str, history: list[dict[str, Any]]) -> Figure:
    """One panel per quantity: samples received, samples consumed (a sample may be consumed many times), and the
    data's and the training's rates, each the mean over ``SMOOTHING`` status intervals (one interval's rate
    swings between 0 and its peak as the simulations' steps arrive in bursts)."""
    figure, panels = plt.subplots(2, 2, figsize=(11, 6.5), constrained_layout=True, sharex=True)
    received = [h["samples"]["received"] for h in history]
    consumed = [h["samples"]["consumed"] for h in history]
    data = smoothed([h["MB_per_s"] * 1000 for h in history], times)
    trained = smoothed([h["training"]["batches_per_s"] if h["training"] else float("nan") for h in history], times)
    for axes, values, color, title in (
        (panels[0, 0], received, "tab:blue", "samples received"),
        (panels[0, 1], consumed, "tab:orange", "samples consumed (all ranks)"),
        (panels[1, 0], data, "tab:red", f"kB/s received (mean of {SMOOTHING} status intervals)"),
        (panels[1, 1], trained, "tab:green", f"training batches/s (mean of {SMOOTHING} status intervals)"),
    ):
        axes.plot(times, values, color=color)
        axes.set(title=title)
        axes.grid(True, alpha=0.3)
    for axes in panels[1]:
        axes.set(xlabel=unit)
    figure.suptitle("Intake")
    return figure


def smoothed(values: list[float], times: list[float]) -> list[float]:
    """The mean of each value and the ``SMOOTHING`` - 1 before it, within its run (a NaN time, a restart, starts
    another; a NaN value is left out, and stays NaN)."""
    out, first = [], 0
    for i, (value, when) in enumerate(zip(values, times)):
        if np.isnan(when):
            first = i + 1
        window = [v for v in values[max(first, i - SMOOTHING + 1) : i + 1] if not np.isnan(v)]
        out.append(float(np.mean(window)) if window and not np.isnan(value) else float("nan"))
    return out


def buffers(times: list[float], unit: str, history: list[dict[str, Any]]) -> Figure:
    """Each rank's fill, against a rank's capacity (in samples) and its watermark, the fill a rank trains from."""
    figure, axes = plt.subplots(figsize=(7, 4), constrained_layout=True)
    limits = history[-1].get("buffer_limits") or {}
    for name, value, style in (
        ("capacity", limits.get("capacity_samples"), "-"),
        ("watermark", limits.get("watermark"), ":"),
    ):
        if value is not None:
            axes.axhline(value, color="black", linestyle=style, linewidth=1, label=f"{name} ({value})")
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
    axes.set(xlabel=unit, ylabel="samples held")
    figure.suptitle("Buffer fill per rank")
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
    axes.set(xlabel=unit, ylabel="simulations", ylim=(0, history[0]["simulations"]["total"]))
    figure.suptitle("Simulations by state")
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
