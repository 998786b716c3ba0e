"""The harness of tests/mpi: a test that fails on one rank ends every rank instead of leaving them in a collective."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import HERE, MPIRUN, clean_environment

# alone: under a parallel run's load, hydra twice ended the job (exit 1, the abort's) before it forwarded the
# aborting rank's message, which this test reads; never in 32 runs of the same job side by side outside pytest
pytestmark = [pytest.mark.timeout(120), pytest.mark.alone]

FAILS_ON_RANK_1 = """
from mpi4py import MPI


def test_rank_one_fails_then_rank_zero_waits() -> None:
    assert MPI.COMM_WORLD.Get_rank() == 0, "rank 1 fails on purpose"
    MPI.COMM_WORLD.Barrier()
"""


def test_a_failure_on_one_rank_aborts_every_rank_at_once(tmp_path: Path) -> None:
    shutil.copy(HERE.parent / "mpi" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_fails.py").write_text(FAILS_ON_RANK_1)
    done = subprocess.run(
        [
            MPIRUN,
            "-n",
            "2",
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "timeout=600",
            str(tmp_path),
        ],
        cwd=tmp_path,
        env=clean_environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )  # rank 0 would wait 600 s in the barrier
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "rank 1: test_fails.py::test_rank_one_fails_then_rank_zero_waits failed, aborting every rank" in output, (
        done.returncode,
        output,
    )
    assert "rank 1 fails on purpose" in output
