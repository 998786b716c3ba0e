"""The code's shape (docs/explanation/design.md#layout): wings by concern, no module or wing imports another that
imports it back, and functions stay short."""

from __future__ import annotations

import ast
import graphlib
import tomllib
from pathlib import Path

import pytest
import setuptools

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("melissa_dl", "launcher", "melissa_api")
LONGEST = 50  # lines of a function, docstring included
# The judged exceptions to LONGEST: ``"melissa_dl.server.Server.run": (64, "why it reads better whole")``, its
# qualified name, the length it may reach, a one-line reason. The limit is a warning sign: a function past it is split
# where its logic splits, never in the middle of it; one whose logic does not split is listed here, by the change that
# grows it. An entry whose function is gone or back under LONGEST fails the test: the list holds only what is needed.
LONG_FUNCTIONS: dict[str, tuple[int, str]] = {}
TOP_MODULES = 8  # modules directly under melissa_dl/ beside its wings (``__init__`` not counted)


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def wing(module: str) -> str:
    """The node a module counts for among wings: its subpackage of ``melissa_dl`` (``melissa_dl.ingest``), the
    ``launcher`` package, or itself (a module at the top of ``melissa_dl``)."""
    parts = module.split(".")
    if parts[0] == "launcher":
        return "launcher"
    if len(parts) > 2 or (ROOT / "melissa_dl" / parts[-1]).is_dir():
        return ".".join(parts[:2])
    return module


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """Every project module ``path`` imports, wherever the import stands (``TYPE_CHECKING`` and functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(known)
            found |= submodules or {node.module}
    return found & set(known)


def test_no_module_imports_another_that_imports_it_back() -> None:
    known = modules()
    graph = {name: imports(path, known) - {name} for name, path in known.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        pytest.fail(f"import cycle: {' -> '.join(error.args[1])}")


def test_no_wing_imports_another_that_imports_it_back() -> None:
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        graph.setdefault(wing(name), set()).update(wing(other) for other in imports(path, known) - {name})
    graph = {node: targets - {node} for node, targets in graph.items()}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as error:
        pytest.fail(f"import cycle between wings: {' -> '.join(error.args[1])}")


def test_the_package_is_a_few_modules_beside_its_wings() -> None:
    top = sorted(path.stem for path in (ROOT / "melissa_dl").glob("*.py") if path.stem != "__init__")
    assert len(top) <= TOP_MODULES, f"{len(top)} modules at the top of melissa_dl/: {', '.join(top)}"
    wings = [path for path in (ROOT / "melissa_dl").iterdir() if (path / "__init__.py").is_file()]
    assert len(wings) >= 6, wings
    for path in wings:
        assert ast.get_docstring(ast.parse((path / "__init__.py").read_text())), f"{path.name}/__init__.py says nothing"


def test_the_launcher_imports_nothing_of_melissa_dl() -> None:
    known = modules()
    leaks = {
        name: sorted(m for m in imports(path, known) if m.split(".")[0] == "melissa_dl")
        for name, path in known.items()
        if wing(name) == "launcher"
    }
    assert not any(leaks.values()), leaks


def test_only_the_slurm_scheduler_names_slurm_in_code() -> None:
    """Names and imports, not prose: a docstring may say that Slurm exists."""
    named = []
    for name, path in modules().items():
        if name == "launcher.slurm":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            words = {
                ast.Name: lambda n: [n.id],
                ast.Attribute: lambda n: [n.attr],
                ast.ImportFrom: lambda n: [n.module or "", *(a.name for a in n.names)],
                ast.Import: lambda n: [a.name for a in n.names],
            }.get(type(node), lambda n: [])(node)
            named += [f"{name}:{node.lineno} {word}" for word in words if "slurm" in word.lower()]
    assert not named, named


def test_the_cycle_check_sees_a_cycle_under_type_checking(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from b import B\n")
    (tmp_path / "b.py").write_text("def f():\n    import a\n")
    known = {"a": tmp_path / "a.py", "b": tmp_path / "b.py"}
    graph = {name: imports(path, known) for name, path in known.items()}
    with pytest.raises(graphlib.CycleError):
        graphlib.TopologicalSorter(graph).prepare()


def function_lengths(name: str, body: list[ast.stmt]) -> list[tuple[str, int]]:
    """The lines of every function in ``body``, nested ones and methods too, by qualified name (a property's getter
    and setter share theirs)."""
    found = []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qualified = f"{name}.{node.name}"
            if not isinstance(node, ast.ClassDef):
                found.append((qualified, node.end_lineno - node.lineno + 1))  # type: ignore[operator]
            found += function_lengths(qualified, node.body)
        else:  # a function under ``if``, ``for``, ``try``, ``with`` or ``match``
            for field in ("body", "orelse", "finalbody", "handlers", "cases"):
                found += function_lengths(name, getattr(node, field, []))
    return found


def test_functions_are_short() -> None:
    """Short, unless judged otherwise (``LONG_FUNCTIONS``); an exception stays only while it is needed."""
    longest: dict[str, int] = {}
    for module, path in modules().items():
        for name, lines in function_lengths(module, ast.parse(path.read_text()).body):
            longest[name] = max(lines, longest.get(name, 0))
    long = [
        f"{name} ({lines} lines)"
        for name, lines in longest.items()
        if lines > LONG_FUNCTIONS.get(name, (LONGEST, ""))[0]
    ]
    assert not long, f"functions over {LONGEST} lines (or their exception's length): {', '.join(long)}"
    stale = [name for name in LONG_FUNCTIONS if longest.get(name, 0) <= LONGEST]
    assert not stale, f"exceptions no longer needed (gone, or back under {LONGEST} lines): {', '.join(stale)}"
    assert all(reason for _, reason in LONG_FUNCTIONS.values()), "every exception says why"


def test_the_dockerfile_copies_every_package_the_wheel_includes() -> None:
    """``pip install .`` in the image installs what was copied; a package left out is missing without an error."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    wheel = {package.split(".")[0] for package in setuptools.find_packages(ROOT, include=include)}
    copied = {line.split()[1] for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")}
    assert set(PACKAGES) <= wheel <= copied
