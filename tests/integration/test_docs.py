"""The docs site builds with warnings as errors (`mkdocs build --strict`: a broken link or anchor, a page missing
from the nav, a docstring mkdocstrings cannot render), and every page of the nav is in the built site.

Skipped, with the command that installs them, when the docs extra is missing; under ``CI=true`` it must be there
(``make test`` installs it), so the test fails instead.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import ROOT, skip_unless

pytestmark = pytest.mark.timeout(300)

MKDOCS = Path(sys.executable).parent / "mkdocs"


def nav_pages(nav: Any) -> list[str]:
    """The Markdown files a mkdocs ``nav`` names, however deeply nested."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in nav_pages(value)]
    return [page for item in nav for page in nav_pages(item)]


def test_the_docs_site_builds_strictly_with_every_nav_page(tmp_path: Path) -> None:
    ready = all(importlib.util.find_spec(name) for name in ("mkdocs", "material", "mkdocstrings"))
    skip_unless(ready and MKDOCS.exists(), "needs the docs extra: run `.venv/bin/pip install -e '.[docs]'`")
    import yaml  # mkdocs's own dependency

    site = tmp_path / "site"
    done = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's end-of-life notice, printed on every build
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    pages = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert len(pages) >= 30 and "reference/configuration.md" in pages
    missing = [
        page for page in pages if not (site / page.removesuffix(".md").removesuffix("index") / "index.html").is_file()
    ]
    assert not missing, f"nav pages not built: {missing}"
    assert (site / "assets" / "figures" / "online_vs_offline.png").is_file()  # served from bench/ by the hook
    assert "melissa_dl.wire.client.Client.send" in (site / "reference" / "python-api" / "index.html").read_text()
    assert_search_finds(site, "per_server_watermark", "reference/configuration/")
    assert_search_finds(site, "nb_batches_update", "reference/configuration/")
    assert_search_finds(site, "melissa_dl_init", "reference/c-fortran-api/")


def assert_search_finds(site: Path, query: str, page: str) -> None:
    """Every word the site's search makes of ``query`` is a word of ``page``'s text (issue 57, item 5): the
    browser's search splits both with the index's own separator (the text's markup, ``<code>``, apart)."""
    index = json.loads((site / "search" / "search_index.json").read_text())
    separator = re.compile(index["config"]["separator"])
    texts = [re.sub(r"<[^>]*>", " ", doc["text"]) for doc in index["docs"] if doc["location"].startswith(page)]
    words = {word.lower() for text in texts for word in separator.split(text)}
    wanted = {word.lower() for word in separator.split(query) if word}
    assert len(wanted) > 1 and wanted <= words, (query, wanted - words)
