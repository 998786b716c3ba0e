"""The integration tests' fixtures and hooks: the order of a parallel run, the native programs built once per
session, a study's output folder. What the tests share beside them is in ``support.py``."""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest
from support import HERE, ROOT, require_system_packages, session_folder


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """In a parallel run (``make test``'s default, ``TEST_WORKERS=4``), the clusters' tests first (one worker runs
    them one after another, mostly waiting on Slurm and on hosts cut off), then these tests, the unit tests last: the
    long studies start at once, and the many short unit tests fill the workers that are done early instead of
    leaving one study running alone at the end. A serial run keeps the files' order."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: (item.get_closest_marker("xdist_group") is None, HERE not in item.path.parents))


@pytest.fixture(scope="session")
def native(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`make native` into a fresh folder, once per test session whatever the number of workers (the first builds
    under a lock, the others wait for it); returns the folder of the programs it built."""
    require_system_packages("native")
    prefix = session_folder(tmp_path_factory) / "native"
    with open(session_folder(tmp_path_factory) / "native.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (prefix / "built").exists():
            done = subprocess.run(
                ["make", "-C", str(ROOT), "native", f"NATIVE={prefix}"], capture_output=True, text=True, timeout=300
            )
            assert done.returncode == 0, done.stdout + done.stderr
            (prefix / "built").touch()
    return prefix / "bin"


@pytest.fixture
def output(tmp_path: Path) -> Path:
    return tmp_path / "output"
