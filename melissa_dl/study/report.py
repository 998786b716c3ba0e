"""The study's final report."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from melissa_dl.ingest.receiver import ReceiverReport
from melissa_dl.runtime.files import write_atomic
from melissa_dl.study.progress import rate
from melissa_dl.study.study import State, Study
from melissa_dl.wire.rejections import merge_rejections

logger = logging.getLogger(__name__)

MB = 1e6


def final_report(
    study: Study,
    reports: Sequence[ReceiverReport],
    handshake_rejections: dict[str, int],
    consumed: int,
    duration: float,
    time_steps: int | None,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything a user checks after a study, as JSON-ready data."""
    received = sum(r.samples for r in reports)
    bytes_received = sum(r.bytes_received for r in reports)
    counts = study.counts()
    expected = len(study.simulations) * time_steps if time_steps is not None else None
    held_out = study.simulations[study.trained :]
    return {
        "simulations": counts,
        "held_out": {"simulations": len(held_out), "samples": sum(s.received for s in held_out)},
        "samples_received": received,
        "samples_expected": expected,
        "samples_consumed": consumed,
        "duplicate_frames_dropped": sum(r.duplicate_frames for r in reports),
        "rejected": merge_rejections([*(r.rejected for r in reports), handshake_rejections]),
        "duration_s": round(duration, 3),
        "bytes_received": bytes_received,
        "throughput_MB_per_s": round(bytes_received / duration / MB, 6) if duration > 0 else 0.0,
        "per_rank_samples": [r.samples for r in reports],
        "stopped_early": study.gave_up or None,
        "per_simulation": [
            {
                "id": s.id,
                "state": s.state.value,
                "attempts": s.attempts,
                "samples": s.received,
                "reason": s.reason,
                "log": s.log or None,
                "output": s.output or None,
                **study.describe(s.id),
            }
            for s in study.simulations
        ],
        **(extra or {}),
    }


def write_report(report: dict[str, Any], path: Path) -> None:
    """Save the report as JSON and log its summary, listing every unsuccessful simulation."""
    write_atomic(path, (json.dumps(report, indent=2) + "\n").encode())
    sims = report["simulations"]
    total = sum(sims.values())
    expected = report["samples_expected"]
    held_out = report["held_out"]["simulations"]
    logger.info(
        "final report: %d/%d simulations done%s, %d failed; %d samples received%s; %d consumed; "
        "%d duplicate frames dropped; refused: %s; %.1f s, %s (written to %s)",
        sims[State.DONE.value],
        total,
        f" ({held_out} held out)" if held_out else "",
        sims[State.FAILED.value],
        report["samples_received"],
        f" (expected {expected})" if expected is not None else "",
        report["samples_consumed"],
        report["duplicate_frames_dropped"],
        report["rejected"] or "none",
        report["duration_s"],
        rate(report["throughput_MB_per_s"]),
        path,
    )
    training = report.get("training")
    if training is not None:
        first, last = training["first_validation_loss"], training["last_validation_loss"]
        logger.info(
            "training: %d batches (%.1f batch/s), %d samples; validation loss %s; %s",
            training["batches"],
            training["batches_per_s"],
            training["samples_trained"],
            f"{first:.4g} -> {last:.4g} ({first / last:.1f}x lower)" if first and last else "not measured",
            f"model saved to {training['model']}" if training["model"] else "no model written: no simulation succeeded",
        )
        if training.get("rollout"):  # with windows: the held-out trajectories rolled out
            batches, errors = training["rollout"][-1]
            said = ", ".join(f"{error:.4g} at {horizon}" for horizon, error in errors.items())
            logger.info("rollout error (relative L2) after %d batches: %s", batches, said)
    for sim in report["per_simulation"]:
        if sim["state"] != State.DONE.value or sim["attempts"] > 1:
            logger.info(
                "simulation %d: %s after %d attempts, %d samples%s",
                sim["id"],
                sim["state"],
                sim["attempts"],
                sim["samples"],
                f" (last failure: {sim['reason']})" if sim["reason"] else "",
            )
