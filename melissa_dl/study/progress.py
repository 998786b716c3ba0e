"""Rank 0's view of a running study: the status line or live bar, the status file, the progress history.

Every ``server.status_interval`` seconds rank 0 writes ``<output>/status.json``
atomically (what ``melissa-server --status OUTPUT_DIR`` prints, from any
shell or a login node), appends the same numbers to ``<output>/progress.jsonl``
(what the plots of ``plots.py`` draw over time), and shows them: a live
``tqdm`` bar when its stderr is a terminal, a plain log line otherwise (under
``mpirun``, whose ranks write into pipes, or into a file).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from melissa_dl.runtime.files import write_atomic
from melissa_dl.runtime.status import HISTORY, STATUS, read_history, runs, server_gone
from melissa_dl.wire.rejections import merge_rejections

if TYPE_CHECKING:  # their modules import torch, which --status must not wait for
    from melissa_dl.ingest.receiver import ReceiverReport
    from melissa_dl.study.study import Study

logger = logging.getLogger(__name__)

MB = 1e6


class StatusBoard:
    """Rank 0's progress: ``update`` every round, at most one status per ``interval`` seconds; ``finish`` at the end."""

    def __init__(
        self,
        output: Path,
        interval: float,
        start: float,
        expected_samples: int | None,
        refusals: Callable[[], dict[str, int]] = dict,
        buffer_limits: dict[str, int | None] | None = None,
    ) -> None:
        self.output = output
        self.refusals = refusals  # of what is not a rank's receiver: the handshake socket's
        self.buffer_limits = buffer_limits  # a rank's capacity in samples and watermark, which buffers.png draws
        self.interval = interval
        self.start = start
        self.expected_samples = expected_samples
        self._last: tuple[float, int, int] = (start, 0, 0)  # time, bytes received, batches
        self._first_batches: int | None = None  # at the first status: a resumed run's rates count its own
        self._share_before_start = 0.0  # done before this run's first simulation started (a resumed run's)
        self._latest: dict[str, Any] | None = None
        self._bar: Any = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=100, unit="%", bar_format="{l_bar}{bar}| {elapsed}<{remaining} {postfix}")

    def update(
        self,
        now: float,
        study: Study,
        reports: Sequence[ReceiverReport],
        consumed: int,
        training: dict[str, Any] | None,
    ) -> None:
        if study.first_start is None:  # every round until then: what a resumed run restored
            self._share_before_start = share_done(study, reports, self.expected_samples)
        if now - self._last[0] >= self.interval:
            self._publish(self.status(now, study, reports, consumed, training, "running"))

    def finish(
        self,
        study: Study,
        reports: Sequence[ReceiverReport],
        consumed: int,
        training: dict[str, Any] | None,
        report: tuple[dict[str, Any], Path] | None = None,
    ) -> None:
        """The last status; with the final report (and its path), the report's figures."""
        status = self.status(time.monotonic(), study, reports, consumed, training, "finished")
        self._publish(status if report is None else with_report(status, *report))
        if self._bar is not None:
            self._bar.close()

    def stopped(self) -> None:
        """The study stopped on request: the latest status says so (a restart resumes it)."""
        if self._latest is not None:
            self._latest.update(state="stopped", updated=time.time())
            write_atomic(self.output / STATUS, (json.dumps(self._latest) + "\n").encode())
        if self._bar is not None:
            self._bar.close()

    def status(
        self,
        now: float,
        study: Study,
        reports: Sequence[ReceiverReport],
        consumed: int,
        training: dict[str, Any] | None,
        state: str,
    ) -> dict[str, Any]:
        """What ``status.json`` holds: counts, rates since the last status, the share done and the time left (at
        the pace since this run's first simulation started: the server's start-up is not the study's)."""
        batches = training["batches"] if training else 0
        if self._first_batches is None:
            self._first_batches = batches
        # rates since the last status; the last one's over the whole run
        then, bytes_then, batches_then = self._last if state == "running" else (self.start, 0, self._first_batches)
        elapsed, interval = now - self.start, max(now - then, 1e-9)
        received, nbytes = sum(r.samples for r in reports), sum(r.bytes_received for r in reports)
        counts, ending = study.counts(), study.ending()
        counts.update(running=counts["running"] - ending, ending=ending)
        share = 1.0 if state == "finished" else share_done(study, reports, self.expected_samples)
        self._last = (now, nbytes, batches)
        return {
            "state": state,
            "updated": time.time(),
            "elapsed_s": round(elapsed, 1),
            "percent": round(100 * share, 1),
            "eta_s": self._time_left(now, study.first_start, share),
            "simulations": {**counts, "total": len(study.simulations)},
            "samples": {"received": received, "expected": self.expected_samples, "consumed": consumed},
            "MB_per_s": round((nbytes - bytes_then) / interval / MB, 6),  # kB/s of small fields kept
            "buffers": [r.buffer_size for r in reports],
            "buffer_limits": self.buffer_limits,
            "refused": merge_rejections([*(r.rejected for r in reports), self.refusals()]),
            "training": None
            if training is None
            else {
                **training,
                "batches_per_s": round((batches - batches_then) / interval, 2),
                "after_data": after_data(reports),
            },
        }

    def _time_left(self, now: float, first_start: float | None, share: float) -> float | None:
        progress = share - self._share_before_start
        if first_start is None or not 0 < share < 1 or progress <= 0:
            return None
        return round((now - first_start) * (1 - share) / progress, 1)

    def _publish(self, status: dict[str, Any]) -> None:
        self._latest = status
        text = json.dumps(status)
        write_atomic(self.output / STATUS, (text + "\n").encode())
        with open(self.output / HISTORY, "a") as history:
            history.write(text + "\n")
        if self._bar is None:
            logger.info("%s", " | ".join(describe(status)))
            return
        self._bar.n = status["percent"]
        self._bar.set_postfix_str(" | ".join(describe(status)[1:]), refresh=True)


def with_report(status: dict[str, Any], report: dict[str, Any], path: Path) -> dict[str, Any]:
    """A finished study's status as its report says it: rates over the study's whole duration (restarts included),
    where the report and the model are, and how many times lower the validation loss ended than it began."""
    finished = {**status, "MB_per_s": report["throughput_MB_per_s"], "report": str(path)}
    trained = report.get("training")
    if trained is not None and status["training"] is not None:
        first, last = trained["first_validation_loss"], trained["last_validation_loss"]
        finished["training"] = {
            **status["training"],
            "batches_per_s": trained["batches_per_s"],
            "model": trained["model"],
            "validation_gain": round(first / last, 2) if first and last else None,
        }
    return finished


def share_done(study: Study, reports: Sequence[ReceiverReport], expected_samples: int | None) -> float:
    """The study's share done: samples received of those expected, or simulations ended of all."""
    if expected_samples:
        return min(sum(r.samples for r in reports) / expected_samples, 1.0)
    counts = study.counts()
    return min((counts["done"] + counts["failed"]) / len(study.simulations), 1.0)


def describe(status: dict[str, Any]) -> list[str]:
    """A status as short lines: progress, simulations, samples, training."""
    sims, samples, training = status["simulations"], status["samples"], status["training"]
    eta = status["eta_s"]
    lines = [
        f"{status['percent']:.0f}% done, {_duration(status['elapsed_s'])} elapsed"
        + (f", about {_duration(max(eta, 1))} left" if eta is not None else ""),
        f"simulations {sims['done']} done, {sims['running']} running, {sims.get('ending', 0)} ending, "
        f"{sims['queued']} queued, {sims['failed']} failed of {sims['total']}",
        f"samples {samples['received']} received"
        + (f" of {samples['expected']}" if samples["expected"] else "")
        + f", {samples['consumed']} consumed | {rate(status['MB_per_s'])} | buffers {sum(status['buffers'])} "
        f"samples | {_refused(status['refused'])}",
    ]
    if training is not None:
        loss = training.get("loss")
        validation = training.get("validation_loss")
        lines.append(
            f"training {training['batches']} batches, {training['batches_per_s']:.1f} batch/s"
            + (f", loss {loss:.4g}" if loss is not None else "")
            + (f", validation loss {validation:.4g}" if validation is not None else "")
            + (f" ({gain:.1f}x lower than the first)" if (gain := training.get("validation_gain")) else "")
            + _after_data(status.get("state", "running"), training.get("after_data"))
        )
    if "report" in status:
        model = training.get("model") if training is not None else None
        lines.append(f"report {status['report']}" + (f" | model {model}" if model else ""))
    return lines


def after_data(reports: Sequence[ReceiverReport]) -> dict[str, Any] | None:
    """Once the data has ended, with ``training.epochs_after_data``: the passes each rank finished, of how many."""
    passes = [report.passes for report in reports if report.passes is not None]
    if not passes:
        return None
    return {"passes": passes[0][1], "passes_done": [done for done, _ in passes]}


def _after_data(state: str, passes: dict[str, Any] | None) -> str:
    """What training does once the data has ended, and at the end why it ended."""
    if state == "running":
        if passes is None:
            return ""
        under_way = min(min(passes["passes_done"]) + 1, passes["passes"])  # every rank done: the last, ending
        return f", after the data: pass {under_way} of {passes['passes']}"
    if state != "finished":
        return ""
    if passes is None:
        return (
            "; ended when the data ran out (every simulation ended, the buffers drained: "
            "training.epochs_after_data trains more passes over what they held)"
        )
    return (
        f"; ended when a rank finished its {passes['passes']} passes over what its buffer held when the data ended "
        f"(passes per rank: {', '.join(map(str, passes['passes_done']))})"
    )


def _refused(counts: dict[str, int] | int) -> str:
    """``3 refused (data_cut 2, handshake_auth 1)``: the most frequent kinds first (an older status: a total)."""
    if isinstance(counts, int):
        return f"{counts} refused"
    kinds = sorted(counts.items(), key=lambda item: (-item[1], item[0]))
    shown = ", ".join(f"{kind} {n}" for kind, n in kinds[:3]) + (", ..." if len(kinds) > 3 else "")
    return f"{sum(counts.values())} refused" + (f" ({shown})" if kinds else "")


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours else f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def earlier_runs_seconds(output: Path, began: float) -> float:
    """The seconds the server's runs before the one that began at wall time ``began`` took, from their last
    statuses (a crash loses at most a status interval of its run)."""
    try:
        history = read_history(output / HISTORY)
    except FileNotFoundError:
        return 0.0
    return sum(run[-1]["elapsed_s"] for run in runs(history) if run[-1]["updated"] - run[-1]["elapsed_s"] < began - 1)


def rate(mb_per_s: float) -> str:
    """A data rate readable at any size: small fields arrive at kB/s, which "0.0 MB/s" would hide."""
    return f"{mb_per_s:.1f} MB/s" if mb_per_s >= 0.1 or mb_per_s == 0 else f"{mb_per_s * 1000:.1f} kB/s"


def show_status(output: Path) -> str:
    """``melissa-server --status OUTPUT_DIR``: the latest status, as lines; ``FileNotFoundError`` if none."""
    status = json.loads((output / STATUS).read_text())
    age = time.time() - status["updated"]
    head = f"study in {output}: {status['state']}, status of {_duration(age)} ago"
    if status["state"] == "running" and server_gone(output):
        head = (
            f"study in {output}: not running (its last status, of {_duration(age)} ago, says running: the server "
            "was killed or crashed; the same command resumes it)"
        )
    return "\n".join([head, *(f"  {line}" for line in describe(status))])
