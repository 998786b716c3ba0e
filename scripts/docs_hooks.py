"""mkdocs hooks of the docs site (``mkdocs.yml``).

The figures that the benches and the examples draw live beside them
(``bench/``, ``examples/``); the site serves them under ``assets/figures/``
from there, so that no copy in ``docs/`` goes stale when a bench redraws one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
FIGURES = {  # the site's path -> the file in the repository
    "assets/figures/online_vs_offline.png": "bench/online_vs_offline.png",
    "assets/figures/active_sampling.png": "bench/active_sampling.png",
    "assets/figures/heat_loss.png": "examples/heat_pde/loss.png",
}


def on_files(files: Files, config: Any) -> Files:
    for uri, source in FIGURES.items():
        files.append(File.generated(config, uri, abs_src_path=str(ROOT / source)))
    return files
