"""The docs' Python is real code: every ```python block of README.md and docs/tutorials/*.md compiles, the README's
training module trains on samples, its simulation uses only what melissa_dl has, and its relative links reach files.

A block that is intentionally partial (a fragment that cannot compile alone, such as a loop body shown without its
loop) is marked by the comment ``<!-- snippet: partial -->`` on the line just before its fence, and is not
compiled. Keep such blocks few: none is marked today.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch

import melissa_dl
from melissa_dl import Client, Sample, TrainingModule

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs" / "tutorials").glob("*.md"))]
PARTIAL = "<!-- snippet: partial -->"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```python[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


class Block(NamedTuple):
    line: int
    code: str
    partial: bool


def blocks(path: Path) -> list[Block]:
    """The ```python blocks of a Markdown file (indented ones in list items too), with the line of their fence."""
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1].strip()
        found.append(Block(text.count("\n", 0, match.start()) + 1, textwrap.dedent(match["body"]), before == PARTIAL))
    return found


def readme_block(marker: str) -> str:
    (code,) = [block.code for block in blocks(README) if marker in block.code]
    return code


@pytest.mark.parametrize("path", PAGES, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_python_block_compiles(path: Path) -> None:
    found = blocks(path)
    assert found or path != README, "the README has no ```python block"
    for block in found:
        if not block.partial:
            compile(block.code, f"{path.relative_to(ROOT)}:{block.line}", "exec")


def test_the_block_finder_sees_indented_and_partial_blocks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("text\n\n- item:\n\n    ```python\n    x = 1\n    ```\n\n" + PARTIAL + "\n```python\n    y\n```\n")
    assert blocks(page) == [Block(5, "x = 1\n", False), Block(10, "y\n", True)]


def test_the_readme_training_module_trains_on_samples() -> None:
    namespace: dict[str, object] = {}
    exec(compile(readme_block("TrainingModule"), "README.md", "exec"), namespace)
    (module_class,) = [
        value
        for value in namespace.values()
        if isinstance(value, type) and issubclass(value, TrainingModule) and value is not TrainingModule
    ]
    module = module_class()
    optimizer = module.configure_optimizer()
    rng = np.random.default_rng(0)
    samples = [
        Sample(s, t, rng.uniform(100, 500, 2), {"temperature": rng.random((32, 32), np.float32)})
        for s, t in [(0, 0), (1, 5)]
    ]
    for sample in samples:
        sample.fields["temperature"].flags.writeable = False  # as a received field may be
    processed = [module.process(sample) for sample in samples]
    batch = tuple(torch.stack(parts) for parts in zip(*processed))
    loss = module.training_step(batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    optimizer.step()


def public_attributes(cls: type) -> set[str]:
    """The public names of a class: its own and those its methods assign to ``self``."""
    assigned = {
        target.attr
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls))))
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
    }
    return {name for name in {*dir(cls), *assigned} if not name.startswith("_")}


def test_the_readme_simulation_uses_only_what_melissa_dl_has() -> None:
    tree = ast.parse(readme_block("Client("))
    imported = {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module == "melissa_dl"
        for alias in node.names
    }
    assert "Client" in imported and imported <= set(melissa_dl.__all__)
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "client"
    }
    assert used and used <= public_attributes(Client), used - public_attributes(Client)


def test_every_relative_link_of_the_readme_reaches_a_file() -> None:
    targets = [match["target"] for match in LINK.finditer(README.read_text())]
    relative = [target.split("#")[0] for target in targets if not re.match(r"[a-z]+:", target) and target[0] != "#"]
    assert relative, "the README links to nothing"
    missing = [target for target in relative if not (ROOT / target).exists()]
    assert not missing, f"the README links to missing files: {missing}"
