"""The study's simulations as the ``launcher`` package runs them: the scheduler and the launcher that the
``launcher`` section describes. That package imports nothing of ``melissa_dl``, so its parts are built here, from
the sections, by their constructors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from launcher import Launcher, Scheduler
from launcher.placeholders import Placeholders, unknown_placeholder
from launcher.schedulers import JobTemplate
from launcher.workers import WorkerScheduler
from melissa_dl.config.registry import SCHEDULERS, load
from melissa_dl.config.sections import Config
from melissa_dl.errors import ConfigError
from melissa_dl.study.sampling import breeding

NextWork = Callable[[str, str | None], dict[str, Any]]
"""What a persistent worker runs next, asked by its name and the run it ended (``WorkerScheduler.next_for``)."""


def simulation_job(config: Config) -> JobTemplate:
    """What a scheduler needs to run this study's simulations."""
    launcher = config.launcher
    options = launcher.options_of.get(launcher.scheduler)  # the scheduler's own section, if it has one
    return JobTemplate(
        launcher.command, config.base_dir, launcher.client_ranks, options, f"melissa-{config.output_path.name}"
    )


def scheduler_from_config(config: Config, kind: str | None = None) -> Scheduler:
    """The scheduler ``launcher.scheduler`` names (or ``kind``: a trial runs on this host), its module loaded now."""
    found: type[Scheduler] = load(SCHEDULERS, kind or config.launcher.scheduler, "launcher.scheduler")
    return found.from_job(simulation_job(config))


def check_settings(config: Config) -> None:
    """What the configuration's own checks cannot tell without the launcher's parts and the study's pace: the
    adaptive sampler's resolved settings, then the placeholders (the order of the sections). ``--check``, every
    run and ``melissa-launcher`` ask first."""
    study = config.study
    if study.sampler == "adaptive":
        breeding(study.adaptive, config.launcher.job_limit, len(study.parameters))
    placeholders_from_config(config)


def placeholders_from_config(config: Config) -> Placeholders:
    """``launcher.command`` and ``launcher.env`` as written, which the launcher fills for each attempt; a
    ``ConfigError`` for a placeholder that no attempt could fill, found here (``--check``), not at a start."""
    section = config.launcher
    unknown = unknown_placeholder(section.command, section.env, config.study.parameter_names, section.persistent)
    if unknown is not None:
        raise ConfigError(f"{unknown[0]}: {unknown[1]}")
    return Placeholders(section.command, section.env)


def launcher_from_config(config: Config) -> tuple[Launcher, NextWork | None]:
    """The launcher of the study's attempts: one process each, or (``launcher.persistent``) persistent workers,
    with what the handshake tells a worker to run next."""
    section, scheduler, placeholders = config.launcher, scheduler_from_config(config), placeholders_from_config(config)
    log_dir = config.output_path / "simulations"
    if not section.persistent:
        return Launcher(scheduler, section.job_limit, log_dir, placeholders), None
    workers = WorkerScheduler(scheduler, placeholders)
    return Launcher(workers, section.job_limit, log_dir), workers.next_for
