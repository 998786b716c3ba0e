"""Every document the code and the docs cite is in the repository, down to the heading.

A citation is a path ending in ``.md``, with an optional ``#anchor`` (as mkdocs makes it from a heading:
lowercase, punctuation dropped, spaces to dashes). In code (any file but a Markdown page) it is a path with a
folder, such as docs/explanation/design.md#glossary, found from the repository's root, from ``docs/`` or from the
citing file's folder; a bare file name there (``"RESULTS.md"`` in ``BENCH / "RESULTS.md"``) is code, not a
citation. In a Markdown page a link's target is found from the page's folder, as mkdocs finds it; a path in its
text, bare page names included, as in code. Each must name a file inside the repository (``../`` out of it is an
error), and its anchor a heading of that file. No file cites the design notes kept outside the repository by
their old section numbers. URLs are not citations.
"""

from __future__ import annotations

import re
import unicodedata
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("melissa_dl", "launcher", "melissa_api", "native", "bench", "scripts", "examples", "tests", "docs")
SCANNED_FILES = ("README.md",)
SKIPPED_FOLDERS = {"__pycache__", "build", "site", "output", "node_modules"}  # and hidden ones, *.egg-info
# Paths that name a pattern, not a page: reference.py turns ``docs/X.md`` in an option's text into a link.
NOT_CITATIONS = {("melissa_dl/reference.py", "docs/X.md")}

URL = re.compile(r"\b[a-zA-Z][\w+.-]*://\S+|\bmailto:\S+")
PATH = re.compile(r"(?<![\w./-])(?P<path>(?:\.\.?/)*\w[\w.-]*(?:/[\w.-]+)*\.md)\b(?:#(?P<anchor>[\w.-]*\w))?")
LINK = re.compile(r"\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
OUTSIDE = re.compile(r"\bDESIGN(?:\.md|\s*§)")  # the design notes kept outside the repository, by section number
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(?P<text>.+?)\s*#*\s*$")
ATTR_ID = re.compile(r"\{[^}]*#(?P<id>[\w-]+)[^}]*\}\s*$")
HTML_ID = re.compile(r"\bid=\"(?P<id>[\w.-]+)\"")
AUTODOC = re.compile(r"^:::\s*(?P<name>[\w.]+)", re.MULTILINE)


def slugify(text: str) -> str:
    """The anchor mkdocs (Python-Markdown's toc, its default slugify) gives a heading of this text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


@cache
def anchors(page: Path) -> frozenset[str]:
    """The anchors of a Markdown page: its headings' (outside code blocks, made unique as toc does), explicit ids."""
    found: set[str] = set()
    fenced = False
    text = page.read_text(encoding="utf-8")
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if fenced:
            continue
        found.update(match["id"] for match in HTML_ID.finditer(line))
        if (heading := HEADING.match(line)) is None:
            continue
        if (explicit := ATTR_ID.search(heading["text"])) is not None:
            found.add(explicit["id"])
            continue
        anchor = slug = slugify(heading["text"])
        count = 0
        while anchor in found:
            count += 1
            anchor = f"{slug}_{count}"
        found.add(anchor)
    found.update(match["name"] for match in AUTODOC.finditer(text))  # mkdocstrings' objects
    return frozenset(found)


def has_anchor(page: Path, anchor: str) -> bool:
    names = anchors(page)
    return anchor in names or any(anchor.startswith(f"{name}.") for name in names if "." in name)


def scanned_files(root: Path) -> list[Path]:
    files: list[Path] = [root / name for name in SCANNED_FILES if (root / name).is_file()]
    for name in SCANNED:
        for path in sorted((root / name).rglob("*")):
            parts = path.relative_to(root).parts
            if any(p.startswith(".") or p in SKIPPED_FOLDERS or p.endswith(".egg-info") for p in parts[:-1]):
                continue
            # not this file: its examples of wrong citations are not citations
            if path.is_file() and not path.name.startswith(".") and path.resolve() != Path(__file__).resolve():
                files.append(path)
    return files


def text_of(path: Path) -> str | None:
    if path.stat().st_size > 2_000_000:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        return None  # not text


def check(root: Path, cited: Path, anchor: str | None) -> str | None:
    """Why this citation is wrong, or None."""
    root = root.resolve()
    cited = cited.resolve()
    if not cited.is_relative_to(root):
        return "is outside the repository"
    if not cited.is_file():
        return "is no file of the repository"
    if anchor and not has_anchor(cited, anchor):
        return f"has no heading #{anchor} (its anchors: {', '.join(sorted(anchors(cited)))})"
    return None


def citations(root: Path, path: Path, text: str) -> list[str]:
    """What is wrong with the citations in ``text`` of file ``path``: one line each."""
    name = path.relative_to(root).as_posix()
    problems: list[str] = []
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if OUTSIDE.search(line):
            problems.append(f"{name}:{number}: cites the design notes outside the repository: {line.strip()}")
    markdown = path.suffix == ".md"
    for number, line in enumerate(lines, 1):
        line = URL.sub(" ", line)
        if markdown:
            for link in LINK.finditer(line):
                target, _, anchor = link["target"].partition("#")
                if ":" in target:
                    continue  # mailto:, a scheme
                cited = (path.parent / target) if target else path
                # only documents: figures may be served from beside the code that draws them (scripts/docs_hooks.py)
                if (target.endswith(".md") or not target) and (why := check(root, cited, anchor or None)):
                    problems.append(f"{name}:{number}: link {link['target']} {why}")
            line = LINK.sub("] ", line)
        for match in PATH.finditer(line):
            cited_path, anchor = match["path"], match["anchor"]
            if (name, cited_path) in NOT_CITATIONS or ("/" not in cited_path and not markdown):
                continue
            bases = (root, root / "docs", path.parent)
            whys = [check(root, base / cited_path, anchor) for base in bases]
            if all(whys):
                shown = cited_path + (f"#{anchor}" if anchor else "")
                why = next((w for w in whys if w and w.startswith("has no heading")), whys[0])
                problems.append(f"{name}:{number}: {shown} {why}")
    return problems


def problems(root: Path) -> list[str]:
    found: list[str] = []
    for path in scanned_files(root):
        if (text := text_of(path)) is not None:
            found += citations(root, path, text)
    return found


def test_every_cited_document_is_in_the_repository() -> None:
    found = problems(ROOT)
    assert not found, "citations of documents that are not in the repository:\n" + "\n".join(found)


def test_a_bad_citation_is_found(tmp_path: Path) -> None:
    """The check itself: each kind of wrong citation is reported, each right one is not."""
    root = tmp_path / "repo"
    (root / "docs" / "how-to").mkdir(parents=True)
    (root / "docs" / "how-to" / "x.md").write_text(
        "# X page\n\n## What it does, briefly\n\n```\n# not a heading\n```\n\n"
        "[ok](x.md#what-it-does-briefly) [self](#x-page) [bad](y.md) [bad anchor](x.md#not-a-heading)\n"
        "See https://example.org/y.md and `docs/how-to/x.md#x-page`.\n"
    )
    (root / "melissa_dl").mkdir()
    (root / "melissa_dl" / "m.py").write_text(
        '"""Cites docs/how-to/x.md#what-it-does-briefly, docs/how-to/missing.md, docs/how-to/x.md#nowhere,\n'
        "../outside/notes.md and the " + "DESIGN" + ' §5 notes; PAGE = ROOT / "page.md" is code."""\n'
    )
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "notes.md").write_text("# Notes\n")
    found = "\n".join(problems(root))
    assert "docs/how-to/x.md:9: link y.md is no file" in found
    assert "docs/how-to/x.md:9: link x.md#not-a-heading has no heading" in found
    assert "melissa_dl/m.py:1: docs/how-to/missing.md is no file" in found
    assert "melissa_dl/m.py:1: docs/how-to/x.md#nowhere has no heading #nowhere" in found
    assert "melissa_dl/m.py:2: ../outside/notes.md is outside the repository" in found
    assert "melissa_dl/m.py:2: cites the design notes outside the repository" in found
    assert len(found.splitlines()) == 6, found  # and nothing else: not the right ones, the URL, "page.md" in code


def test_slugify_is_mkdocs() -> None:
    assert slugify("What keeps 10,000 simulations going") == "what-keeps-10000-simulations-going"
    assert slugify("Liveness and delivery without ZeroMQ") == "liveness-and-delivery-without-zeromq"
    assert slugify("Done, failed, relaunched") == "done-failed-relaunched"
    assert slugify("The `Client` API") == "the-client-api"
