"""Unit tests of the heat-equation example (solver and instrumented script).

The solver must be a correct PDE solver, because the integration tests train
on its output, and its row decomposition must reproduce the P=1 field. The
script is run against a stub ``melissa_dl`` (its ``Client``) in a subprocess, since the
crash option calls ``os._exit``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

EXAMPLE_DIR = Path(__file__).resolve().parents[3] / "examples" / "heat_pde"

# Loaded by path under a unique name: examples are not a package, and a bare
# ``import solver`` could collide with another test's module.
_spec = importlib.util.spec_from_file_location("heat_pde_solver", EXAMPLE_DIR / "solver.py")
assert _spec is not None and _spec.loader is not None
_solver = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_solver)
PARAMETER_NAMES = _solver.PARAMETER_NAMES
HeatSolver = _solver.HeatSolver
split_rows = _solver.split_rows

pytestmark = pytest.mark.timeout(60)


class FakeComm:
    """Stand-in communicator: the solver only asks for its rank and size."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def Get_rank(self) -> int:  # noqa: N802 - mpi4py spelling
        return self.rank

    def Get_size(self) -> int:  # noqa: N802 - mpi4py spelling
        return self.size


def run(solver: HeatSolver, steps: int) -> list[np.ndarray]:
    return [solver.step() for _ in range(steps)]


def dense_backward_euler(
    params: tuple[float, ...], nx: int, ny: int, dt: float, alpha: float, steps: int
) -> list[np.ndarray]:
    """Textbook reference: assemble I - dt*alpha*Laplacian and solve each step."""
    initial, left, right, bottom, top = params
    hx2, hy2 = (nx - 1) ** -2, (ny - 1) ** -2
    mx, my = nx - 2, ny - 2
    matrix = np.eye(mx * my)
    for i in range(mx):
        for j in range(my):
            k = i * my + j
            matrix[k, k] += dt * alpha * (2 / hx2 + 2 / hy2)
            for di, dj, h2 in ((1, 0, hx2), (-1, 0, hx2), (0, 1, hy2), (0, -1, hy2)):
                if 0 <= i + di < mx and 0 <= j + dj < my:
                    matrix[k, (i + di) * my + j + dj] -= dt * alpha / h2
    u = np.full((mx, my), float(initial))
    out = []
    for _ in range(steps):
        rhs = u.copy()
        rhs[0, :] += dt * alpha * left / hx2
        rhs[-1, :] += dt * alpha * right / hx2
        rhs[:, 0] += dt * alpha * bottom / hy2
        rhs[:, -1] += dt * alpha * top / hy2
        u = np.linalg.solve(matrix, rhs.ravel()).reshape(mx, my)
        out.append(u)
    return out


# --------------------------------------------------------------- the solver


def test_parameter_names() -> None:
    assert PARAMETER_NAMES == ("initial", "left", "right", "bottom", "top")


@pytest.mark.parametrize("value", [0.0, 0.7, -3.25])
@pytest.mark.parametrize("dt", [1e-3, 10.0])
def test_constant_field_stays_constant(value: float, dt: float) -> None:
    solver = HeatSolver([value] * 5, nx=17, ny=23, dt=dt)
    for field in run(solver, 50):
        np.testing.assert_allclose(field, np.float32(value), rtol=0, atol=1e-5)


@pytest.mark.parametrize("dt", [1e-3, 0.05, 5.0])
def test_heating_is_monotone_and_bounded(dt: float) -> None:
    """Boundaries at 1, interior at 0: backward Euler is monotone for any dt."""
    solver = HeatSolver([0.0, 1.0, 1.0, 1.0, 1.0], nx=24, ny=20, dt=dt)
    eps = 1e-6
    previous = np.zeros(solver.local_shape, dtype=np.float32)
    previous[0, :] = previous[-1, :] = previous[:, 0] = previous[:, -1] = 1.0
    for field in run(solver, 60):
        assert field.min() >= -eps and field.max() <= 1 + eps
        assert np.all(field >= previous - eps)
        previous = field
    assert previous[1:-1, 1:-1].min() > 0.0


def test_default_run_visibly_evolves_but_is_not_steady() -> None:
    """The documented default (dt=1e-3, 100 steps, t=0.1) is a useful data set."""
    solver = HeatSolver([0.0, 1.0, 1.0, 1.0, 1.0])
    assert solver.local_shape == (32, 32)
    center = [float(f[16, 16]) for f in run(solver, 100)]
    assert center[0] < 0.01
    assert 0.5 < center[-1] < 0.95


@pytest.mark.parametrize("nx,ny,dt,alpha", [(12, 9, 1e-3, 1.0), (9, 14, 0.3, 2.5)])
def test_matches_dense_backward_euler(nx: int, ny: int, dt: float, alpha: float) -> None:
    params = (0.3, 1.0, -0.5, 2.0, 0.7)
    solver = HeatSolver(params, nx=nx, ny=ny, dt=dt, alpha=alpha)
    for field, ref in zip(run(solver, 25), dense_backward_euler(params, nx, ny, dt, alpha, 25)):
        np.testing.assert_allclose(field[1:-1, 1:-1], ref, rtol=0, atol=1e-5)


def test_a_sixth_parameter_is_the_diffusivity() -> None:
    params = (0.3, 1.0, -0.5, 2.0, 0.7)
    np.testing.assert_array_equal(
        run(HeatSolver((*params, 2.5), nx=9, ny=7), 5), run(HeatSolver(params, nx=9, ny=7, alpha=2.5), 5)
    )


def test_refined_solve_sends_the_coarse_points_of_the_fine_field() -> None:
    """Refining the mesh changes the field by the discretisation error only, and the fine solve is
    the textbook scheme on the fine grid restricted to every refine-th point."""
    params = (0.3, 1.0, -0.5, 2.0, 0.7)
    coarse, refined = run(HeatSolver(params, nx=9, ny=7), 10), run(HeatSolver(params, nx=9, ny=7, refine=3), 10)
    fine = dense_backward_euler(params, 25, 19, 1e-3, 1.0, 10)
    for c, r, f in zip(coarse, refined, fine):
        assert r.shape == (9, 7)
        np.testing.assert_allclose(r[1:-1, 1:-1], f[2::3, 2::3], rtol=0, atol=1e-5)
        assert 0 < np.abs(r - c).max() < 0.1  # of a field spanning 2.5


def test_refined_rank_blocks_concatenate_to_full_field() -> None:
    params = (0.2, 1.0, -1.0, 0.5, 2.0)
    full = HeatSolver(params, nx=11, ny=6, refine=2).step()
    blocks = [HeatSolver(params, nx=11, ny=6, refine=2, comm=FakeComm(rank, 3)).step() for rank in range(3)]
    np.testing.assert_allclose(np.concatenate(blocks), full, rtol=0, atol=1e-6)


def test_boundaries_and_corners() -> None:
    """Edges hold their parameter; a corner holds the mean of its two edges."""
    initial, left, right, bottom, top = 0.5, 1.0, 2.0, 3.0, 4.0
    field = HeatSolver([initial, left, right, bottom, top], nx=8, ny=6).step()
    np.testing.assert_array_equal(field[0, 1:-1], left)
    np.testing.assert_array_equal(field[-1, 1:-1], right)
    np.testing.assert_array_equal(field[1:-1, 0], bottom)
    np.testing.assert_array_equal(field[1:-1, -1], top)
    corners = [field[0, 0], field[0, -1], field[-1, 0], field[-1, -1]]
    assert corners == [2.0, 2.5, 2.5, 3.0]


def test_step_output_dtype_shape_and_freshness() -> None:
    solver = HeatSolver([0.0, 1.0, 0.0, 0.5, 0.25], nx=11, ny=7, comm=FakeComm(1, 3))
    assert solver.local_shape == (4, 7)
    a, b = solver.step(), solver.step()
    for field in (a, b):
        assert field.dtype == np.float32
        assert field.shape == solver.local_shape
        assert field.flags.c_contiguous
    assert not np.shares_memory(a, b)
    assert solver.time_step == 2


@pytest.mark.parametrize(
    "params,nx,ny,dt",
    [
        ([0.0] * 4, 8, 8, 1e-3),
        ([0.0] * 7, 8, 8, 1e-3),
        ([0.0] * 6, 8, 8, 1e-3),
        ([0.0] * 5, 2, 8, 1e-3),
        ([0.0] * 5, 8, 8, 0.0),
    ],
)
def test_rejects_bad_arguments(params: list[float], nx: int, ny: int, dt: float) -> None:
    with pytest.raises(ValueError):
        HeatSolver(params, nx=nx, ny=ny, dt=dt)


# ----------------------------------------------------------- decomposition


@pytest.mark.parametrize("nx", [0, 1, 5, 32, 33, 64])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 7, 40])
def test_split_rows_covers_contiguous_balanced(nx: int, size: int) -> None:
    blocks = [split_rows(nx, size, rank) for rank in range(size)]
    assert blocks[0][0] == 0 and blocks[-1][1] == nx
    for (_, stop), (start, _) in zip(blocks, blocks[1:]):
        assert stop == start
    lengths = [stop - start for start, stop in blocks]
    assert max(lengths) - min(lengths) <= 1
    assert lengths == sorted(lengths, reverse=True)  # remainder on first ranks


@pytest.mark.parametrize("size,rank", [(0, 0), (2, 2), (2, -1)])
def test_split_rows_rejects_bad_rank(size: int, rank: int) -> None:
    with pytest.raises(ValueError):
        split_rows(10, size, rank)


@pytest.mark.parametrize("nx,size", [(32, 2), (33, 3), (17, 4), (5, 7)])
def test_rank_blocks_concatenate_to_full_field(nx: int, size: int) -> None:
    params = (0.2, 1.0, -1.0, 0.5, 2.0)
    full = run(HeatSolver(params, nx=nx, ny=13, dt=2e-3), 20)
    per_rank = [run(HeatSolver(params, nx=nx, ny=13, dt=2e-3, comm=FakeComm(rank, size)), 20) for rank in range(size)]
    for step, expected in enumerate(full):
        blocks = [fields[step] for fields in per_rank]
        for rank, block in enumerate(blocks):
            start, stop = split_rows(nx, size, rank)
            assert block.shape == (stop - start, 13)
        np.testing.assert_allclose(np.concatenate(blocks, axis=0), expected, rtol=0, atol=1e-6)


# ------------------------------------------------------ the instrumented script

STUB_CLIENT = '''
"""Stub of melissa_dl.wire.client: records what heat.py does to a JSON log per rank."""
import json, os, sys
import numpy as np


class Client:
    def __init__(self, fields, comm=None):
        self.fields = {k: (np.dtype(d).str, list(s)) for k, (d, s) in fields.items()}
        self.parameters = np.array(json.loads(os.environ["STUB_PARAMS"]))
        self.simulation_id = int(os.environ["STUB_SID"])
        self.attempt = int(os.environ["STUB_ATTEMPT"])
        rank = 0 if comm is None else comm.Get_rank()
        self.log = f"{os.environ['STUB_LOG']}.r{rank}"
        self.sent = []
        self._write(finalized=False)

    def send(self, name, time_step, array):
        assert array.flags.c_contiguous
        self.sent.append((name, time_step, array.dtype.str, list(array.shape)))
        np.save(f"{self.log}.{time_step}.npy", array)
        self._write(finalized=False)

    def finalize(self):
        self._write(finalized=True)

    def _write(self, finalized):
        with open(self.log, "w") as f:
            json.dump({"fields": self.fields, "sent": self.sent, "finalized": finalized,
                       "mpi_imported": "mpi4py" in sys.modules}, f)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            self.finalize()
'''

STUB_MPI = '''
"""Stub of mpi4py.MPI: COMM_WORLD's rank and size come from the environment."""
import os


class _Comm:
    def Get_rank(self):
        return int(os.environ["STUB_RANK"])

    def Get_size(self):
        return int(os.environ["STUB_SIZE"])


COMM_WORLD = _Comm()
'''

PARAMS = [0.0, 1.0, 1.0, 0.5, 0.5]


def run_heat(
    tmp_path: Path, *args: str, sid: int = 3, attempt: int = 0, rank: int = 0, size: int = 1
) -> tuple[int, dict, str]:
    """Run heat.py against the stubs; return its exit code, log and log prefix."""
    stub = tmp_path / "stub"
    stubs = (
        ("melissa_dl", "client", STUB_CLIENT, "from melissa_dl.client import Client\n"),
        ("mpi4py", "MPI", STUB_MPI, ""),
    )
    for package, module, text, init in stubs:
        (stub / package).mkdir(parents=True, exist_ok=True)
        (stub / package / "__init__.py").write_text(init)
        (stub / package / f"{module}.py").write_text(textwrap.dedent(text))
    log = f"{tmp_path}/log-{sid}-{attempt}"
    env = dict(
        os.environ,
        PYTHONPATH=str(stub),
        STUB_PARAMS=json.dumps(PARAMS),
        STUB_SID=str(sid),
        STUB_ATTEMPT=str(attempt),
        STUB_LOG=log,
        STUB_RANK=str(rank),
        STUB_SIZE=str(size),
    )
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE_DIR / "heat.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert proc.returncode in (0, 1), proc.stderr
    prefix = f"{log}.r{rank}"
    return proc.returncode, json.loads(Path(prefix).read_text()), prefix


def test_heat_script_sends_every_step(tmp_path: Path) -> None:
    code, record, log = run_heat(tmp_path, "--nx", "10", "--ny", "6", "--steps", "7")
    assert code == 0
    assert record["fields"] == {"temperature": ["<f4", [10, 6]]}
    assert record["sent"] == [["temperature", t, "<f4", [10, 6]] for t in range(7)]
    assert record["finalized"] and not record["mpi_imported"]
    expected = run(HeatSolver(PARAMS, nx=10, ny=6), 7)
    for t in range(7):  # time step t is the field after t+1 solver steps
        np.testing.assert_array_equal(np.load(f"{log}.{t}.npy"), expected[t])


def test_heat_script_mpi_ranks_send_their_row_blocks(tmp_path: Path) -> None:
    """With --mpi each rank declares and sends its slice; slices stack to P=1."""
    args = ("--mpi", "--nx", "11", "--ny", "5", "--steps", "3")
    logs = []
    for rank in range(2):
        code, record, log = run_heat(tmp_path, *args, rank=rank, size=2)
        rows = 6 if rank == 0 else 5
        assert code == 0 and record["finalized"] and record["mpi_imported"]
        assert record["fields"] == {"temperature": ["<f4", [rows, 5]]}
        assert [shape for *_, shape in record["sent"]] == [[rows, 5]] * 3
        logs.append(log)
    expected = run(HeatSolver(PARAMS, nx=11, ny=5), 3)
    for t in range(3):
        stacked = np.concatenate([np.load(f"{log}.{t}.npy") for log in logs], axis=0)
        np.testing.assert_allclose(stacked, expected[t], rtol=0, atol=1e-6)


def test_heat_script_crashes_once_mid_run(tmp_path: Path) -> None:
    crash = ("--steps", "6", "--nx", "8", "--crash-at", "4", "--crash-simulation", "3")
    code, record, _ = run_heat(tmp_path, *crash, sid=3, attempt=0)
    assert code == 1
    assert [t for _, t, _, _ in record["sent"]] == [0, 1, 2, 3]
    assert not record["finalized"]
    for sid, attempt in ((3, 1), (4, 0)):  # the relaunch and other simulations run fully
        code, record, _ = run_heat(tmp_path, *crash, sid=sid, attempt=attempt)
        assert code == 0 and len(record["sent"]) == 6 and record["finalized"]


def test_a_solver_resumed_from_another_s_step_goes_on_as_that_one_does() -> None:
    parameters = [300.0, 150.0, 450.0, 250.0, 350.0]
    made, resumed = HeatSolver(parameters, 9, 7), HeatSolver(parameters, 9, 7)
    for _ in range(3):
        resumed.step()
    fields = [made.step() for _ in range(4)]
    resumed.resume_from(fields[-1])  # its fourth step, made by another
    assert resumed.time_step == 4
    np.testing.assert_allclose(resumed.step(), made.step(), rtol=1e-5)
    with pytest.raises(ValueError, match="whole 9x7 field"):
        resumed.resume_from(fields[-1][:4])
