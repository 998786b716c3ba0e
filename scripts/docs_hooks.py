"""mkdocs hooks of the docs site (``mkdocs.yml``).

The figures that the benches and the examples draw live beside them
(``bench/``, ``examples/``); the site serves them under ``assets/figures/``
from there, so that no copy in ``docs/`` goes stale when a bench redraws one.

The site's name carries the package's version (``melissa_dl 0.1.0`` in the
header and the pages' titles), read from ``pyproject.toml`` rather than from the
installed package's metadata, which an editable install leaves at the version it
was installed with; ``extra.package_version`` holds it for templates (not
``extra.version``: Material reads that as a versioning provider's settings).
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
FIGURES = {  # the site's path -> the file in the repository
    "assets/figures/online_vs_offline.png": "bench/online_vs_offline.png",
    "assets/figures/active_sampling.png": "bench/active_sampling.png",
    "assets/figures/heat_loss.png": "examples/heat_pde/loss.png",
}


def package_version() -> str:
    """The version ``pyproject.toml`` gives the package."""
    with (ROOT / "pyproject.toml").open("rb") as file:
        return str(tomllib.load(file)["project"]["version"])


def on_config(config: Any) -> Any:
    version = package_version()
    config["extra"]["package_version"] = version
    if not config["site_name"].endswith(f" {version}"):  # once, should a config object be built on twice
        config["site_name"] = f"{config['site_name']} {version}"
    return config


def on_files(files: Files, config: Any) -> Files:
    for uri, source in FIGURES.items():
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / source)))
    return files
