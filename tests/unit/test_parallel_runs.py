"""What ``make test TEST_WORKERS=n`` relies on: pytest-xdist's ``--dist loadgroup`` runs the tests of one
``xdist_group`` (the Slurm and host clusters' tests) on one worker. With pytest 9.2 it silently stopped
(pytest-xdist issue 1386): the clusters' tests spread over the workers, each building clusters of its own."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

GROUPED = """
import pytest

pytestmark = [pytest.mark.timeout(60), pytest.mark.xdist_group("clusters")]


@pytest.mark.parametrize("i", range(6))
def test_grouped(i):
    pass
"""


def test_the_tests_of_a_group_run_on_one_worker(tmp_path: Path) -> None:
    (tmp_path / "test_grouped.py").write_text(GROUPED)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "3", "--dist", "loadgroup", "-p", "no:cacheprovider", "-v"],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    ran = re.findall(r"^\[(gw\d+)\] .*PASSED test_grouped.py::test_grouped\[(\d)\]", done.stdout, re.MULTILINE)
    assert sorted(int(i) for _, i in ran) == list(range(6)), done.stdout
    assert len({worker for worker, _ in ran}) == 1, done.stdout
