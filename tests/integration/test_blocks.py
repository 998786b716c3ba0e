"""Fields split in blocks along any axes (issue 54, item 1): whole studies whose MPI simulations send uneven 2-D and
3-D blocks, compared value for value with the same simulation run on one rank; blocks that cannot tile refused."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import HERE, run_server, study_config

pytestmark = pytest.mark.timeout(240)

BLOCK_SIM = str(HERE / "block_sim.py")
SIMULATIONS, STEPS = 2, 3


def recorded_study(tmp_path: Path, name: str, command: list[str], client_ranks: int) -> dict[tuple[int, int], Any]:
    """Run a study of ``command`` on ``client_ranks`` ranks per simulation; the fields of every sample received."""
    folder = tmp_path / name
    (folder / "samples").mkdir(parents=True)
    config = study_config(
        folder / "output",
        command,
        study={"fields": ["p"], "simulations": SIMULATIONS, "time_steps": STEPS},
        launcher={"scheduler": "mpirun", "client_ranks": client_ranks, "max_retries": 0},
        training={
            "module": str(HERE / "recorder.py"),
            "class_name": "Recorder",
            "options": {"directory": str(folder / "samples")},
            "batch_size": 1,
            "device": "cpu",
        },
    )
    run = run_server(folder, config, ranks=2)
    assert run.code == 0 and run.report is not None, run.log[-3000:]
    assert run.report["rejected"] == {} and run.report["simulations"]["done"] == SIMULATIONS
    samples = {tuple(map(int, path.stem.split("_"))): np.load(path) for path in (folder / "samples").iterdir()}
    assert sorted(samples) == [(s, t) for s in range(SIMULATIONS) for t in range(STEPS)]
    return {key: sample["p"] for key, sample in samples.items()}


def expected(simulation: int, step: int, whole: tuple[int, ...]) -> np.ndarray:
    """What every block program sends: 10 s + 0.5 t + sum_d (d + 1) 0.01 i_d at global index i."""
    indices = np.meshgrid(*(np.arange(n) for n in whole), indexing="ij")
    return (10 * simulation + 0.5 * step + sum((d + 1) * 0.01 * i for d, i in enumerate(indices))).astype(np.float32)


def assert_blocks_make_one_ranks_fields(
    tmp_path: Path, command: Callable[[tuple[int, ...]], list[str]], dims: tuple[int, ...], whole: tuple[int, ...]
) -> None:
    """The study of ``command(dims)`` on the ranks of ``dims`` receives, value for value, what the same program on
    one rank sends, and that is the global array the program computes."""
    blocked = recorded_study(tmp_path, "blocks", command(dims), int(np.prod(dims)))
    single = recorded_study(tmp_path, "one", command((1,) * len(dims)), 1)
    for (s, t), field in single.items():
        assert field.shape == whole and field.dtype == np.float32
        np.testing.assert_array_equal(blocked[s, t], field, err_msg=f"simulation {s}, step {t}")
        np.testing.assert_allclose(field, expected(s, t, whole), rtol=1e-6, err_msg=f"simulation {s}, step {t}")


@pytest.mark.parametrize(
    "dims, whole, layout",
    [((2, 2), (13, 9), []), ((2, 2, 2), (7, 6, 5), ["--fortran"])],
    ids=["2-D 2x2, C order", "3-D 2x2x2, Fortran order"],
)
def test_uneven_blocks_of_a_python_simulation_make_the_fields_of_one_rank(
    tmp_path: Path, dims: tuple[int, ...], whole: tuple[int, ...], layout: list[str]
) -> None:
    """Each rank sends the interior of its array with a halo (a non-contiguous view, Fortran-ordered in 3-D)."""
    command = [sys.executable, BLOCK_SIM, "--global", *map(str, whole), "--steps", str(STEPS), *layout, "--dims"]
    assert_blocks_make_one_ranks_fields(tmp_path, lambda grid: [*command, *map(str, grid)], dims, whole)


@pytest.mark.parametrize("program", ["block_client", "block_client_f"], ids=["C", "Fortran, column-major"])
@pytest.mark.parametrize("dims, whole", [((2, 2), (13, 9)), ((2, 2, 2), (7, 6, 5))], ids=["2-D 2x2", "3-D 2x2x2"])
def test_uneven_blocks_of_a_c_or_fortran_simulation_make_the_fields_of_one_rank(
    tmp_path: Path, native: Path, program: str, dims: tuple[int, ...], whole: tuple[int, ...]
) -> None:
    """melissa_dl_init_block: the C program sends its blocks in C order, the Fortran one the interior of its array
    with halos as the compiler passes the section, column-major, in its own axis order."""
    command = [str(native / program), str(STEPS), str(len(whole)), *map(str, whole)]
    assert_blocks_make_one_ranks_fields(tmp_path, lambda grid: [*command, *map(str, grid)], dims, whole)


def test_overlapping_blocks_fail_the_simulation_at_the_handshake_with_one_line_naming_the_ranks_and_region(
    tmp_path: Path, output: Path
) -> None:
    command = [sys.executable, BLOCK_SIM, "--global", "13", "9", "--dims", "2", "2", "--overlap"]
    config = study_config(
        output,
        command,
        study={"fields": ["p"], "simulations": 1, "time_steps": STEPS},
        launcher={"scheduler": "mpirun", "client_ranks": 4, "max_retries": 2},
    )
    run = run_server(tmp_path, config, ranks=1)
    assert run.report is not None, run.log[-3000:]
    [simulation] = run.report["per_simulation"]
    assert simulation["state"] == "failed" and simulation["attempts"] == 1  # deterministic: not relaunched
    reason = "field 'p': the blocks of client ranks 0 and 1 overlap in [0:7, 4:5]"
    assert reason in simulation["reason"] and "\n" not in simulation["reason"], simulation["reason"]
