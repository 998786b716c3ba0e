"""A 2-D heat-equation solver for the melissa_dl example (numpy only).

Solves ``u_t = alpha * (u_xx + u_yy)`` on the unit square with constant
Dirichlet boundaries, on an ``nx`` by ``ny`` grid that includes the boundary
points. Field row index ``i`` is x (``x = i / (nx - 1)``), column ``j`` is y.

Parameters (``PARAMETER_NAMES``): the initial temperature of the interior,
then the temperatures of the edges x=0 ("left"), x=1 ("right"), y=0
("bottom") and y=1 ("top"); optionally a sixth, the diffusivity ``alpha``
(``DIFFUSIVITY``), which makes the field depend non-linearly on the
parameters (the decay rates), so that a surrogate needs many simulations.
Corner rule: a corner holds the mean of its two edges. The 5-point stencil
never reads corners, so the rule only affects what is sent, not the dynamics.

``refine``: the equation is solved on a grid ``refine`` times finer in each
direction (``(n - 1) * refine + 1`` points) and the field is sent at the
``nx`` by ``ny`` points of the coarse grid, which the fine one contains: a
more accurate field for a cost that grows as ``refine**3`` per step (about
8 ms a step at 64x64 with refine 8 on one core), as a solver whose accuracy
needs a fine mesh costs more than what it outputs.

Scheme: backward Euler in time, 5-point Laplacian in space, solved exactly by
*fast diagonalisation*. The discrete Dirichlet Laplacian is separable,
``-A = Kx (x) I + I (x) Ky``, and the orthonormal sine vectors diagonalise each
1-D factor, so ``(I - dt*alpha*A)^-1`` is a diagonal scaling in that basis.
Writing ``u = u_s + w`` with ``u_s`` the steady state, each step is
``w_hat *= g`` with ``g = 1 / (1 + dt*alpha*(mu_x + mu_y))``. Why this rather
than a dense factor or ADI: it is the exact backward-Euler solution (no
splitting error, monotone for every dt, so the maximum principle holds), it
needs nothing beyond numpy matrix products, and it decomposes with no
communication at all (see below).

Cost, with ``m = n - 2`` interior points per direction: setup builds the two
``m x m`` sine matrices and transforms the initial and steady states,
``O(m^3)`` (about a millisecond at 64x64). A step on a rank owning ``r`` rows
costs ``O(r * m^2)`` (two matrix products), so ``O(n^3 / P)`` per rank.

Domain decomposition: with a communicator of P ranks, rank r owns the
contiguous rows ``split_rows(nx, P, r)`` (boundary rows included). The
spectral coefficients ``w_hat`` (``m x m`` floats) are small and are computed
identically on every rank from the five parameters during setup; each step
then rebuilds only the rank's own rows, ``u_s[rows] + Sx[rows] @ w_hat @
Sy.T``. Ranks therefore never exchange data; the communicator is used only
for its rank and size, and the blocks concatenated in rank order equal the
P=1 field to rounding (the same products over a subset of rows). This works
because the operator is linear with constant coefficients and boundaries; a
PDE without a known eigenbasis would need a halo exchange instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

PARAMETER_NAMES: tuple[str, ...] = ("initial", "left", "right", "bottom", "top")
DIFFUSIVITY = "diffusivity"  # the optional sixth parameter

DEFAULT_DT: float = 1e-3
"""With alpha=1 and 100 steps the run ends at t=0.1: the slowest mode has
decayed to about 14 %, so the field has visibly moved toward the boundary
values but is not yet steady."""


def split_rows(nx: int, size: int, rank: int) -> tuple[int, int]:
    """Return the ``[start, stop)`` rows owned by ``rank`` among ``size`` ranks.

    Blocks are contiguous and in rank order; the ``nx % size`` leftover rows go
    one each to the first ranks, so block sizes differ by at most one.
    """
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in a communicator of size {size}")
    if nx < 0:
        raise ValueError(f"nx must be >= 0, got {nx}")
    base, extra = divmod(nx, size)
    start = rank * base + min(rank, extra)
    stop = start + base + (1 if rank < extra else 0)
    return start, stop


def local_shape(nx: int, ny: int, comm: Any = None) -> tuple[int, int]:
    """Shape of the rows this rank owns, known before the parameters are.

    Lets a client declare its field slice before building the solver (the
    parameters come from the client itself).
    """
    rank, size = (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())
    start, stop = split_rows(nx, size, rank)
    return stop - start, ny


def _sine_basis(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Return ``(S, mu)`` for the 1-D Dirichlet Laplacian on ``n`` grid points.

    ``S`` is ``(n, n-2)``: orthonormal eigenvectors over the interior, padded
    with zero rows at the two boundary points so that ``S @ c`` is a full
    column vanishing on the boundary. ``mu`` holds the eigenvalues of the
    positive operator ``-d2/dx2`` with spacing ``h = 1/(n-1)``.
    """
    m = n - 2
    h = 1.0 / (n - 1)
    k = np.arange(1, m + 1)
    s = np.zeros((n, m))
    s[1:-1] = np.sqrt(2.0 / (m + 1)) * np.sin(np.pi * np.outer(k, k) / (m + 1))
    mu = (4.0 / h**2) * np.sin(np.pi * k / (2 * (m + 1))) ** 2
    return s, mu


class HeatSolver:
    """Backward-Euler heat solver that yields this rank's rows of the field.

    ``comm`` is an mpi4py communicator or ``None`` (one rank owns everything).
    Only ``Get_rank()`` and ``Get_size()`` are called on it, so any object
    with those two methods works (the unit tests use a stand-in).
    """

    def __init__(
        self,
        params: Sequence[float],
        nx: int = 32,
        ny: int = 32,
        dt: float = DEFAULT_DT,
        alpha: float = 1.0,
        comm: Any = None,
        refine: int = 1,
    ) -> None:
        """``alpha`` is the diffusivity unless ``params`` has a sixth value, which then is."""
        values = [float(p) for p in params]
        if len(values) not in (len(PARAMETER_NAMES), len(PARAMETER_NAMES) + 1):
            raise ValueError(
                f"expected {len(PARAMETER_NAMES)} parameters {PARAMETER_NAMES}, or a sixth "
                f"({DIFFUSIVITY}), got {len(values)}"
            )
        if nx < 3 or ny < 3:
            raise ValueError(f"the grid needs at least 3x3 points, got {nx}x{ny}")
        if len(values) > len(PARAMETER_NAMES):
            alpha = values.pop()
        if not (dt > 0 and alpha > 0 and refine >= 1):
            raise ValueError(f"dt and alpha must be > 0 and refine >= 1, got dt={dt}, alpha={alpha}, refine={refine}")
        initial, left, right, bottom, top = values
        rank, size = (0, 1) if comm is None else (comm.Get_rank(), comm.Get_size())

        self.nx, self.ny, self.dt, self.alpha, self.refine = nx, ny, float(dt), float(alpha), refine
        self.time_step = 0
        self.start, self.stop = split_rows(nx, size, rank)
        self.local_shape: tuple[int, int] = (self.stop - self.start, ny)
        nx, ny = (nx - 1) * refine + 1, (ny - 1) * refine + 1  # the grid solved on

        sx, mux = _sine_basis(nx)
        sy, muy = _sine_basis(ny)
        mu = mux[:, None] + muy[None, :]  # eigenvalues of -A, all > 0
        hx2, hy2 = (nx - 1) ** -2, (ny - 1) ** -2

        # Boundary source b of the interior system -A u = b (steady state).
        b = np.zeros((nx - 2, ny - 2))
        b[0, :] += left / hx2
        b[-1, :] += right / hx2
        b[:, 0] += bottom / hy2
        b[:, -1] += top / hy2
        steady_hat = (sx[1:-1].T @ b @ sy[1:-1]) / mu

        # Steady state on the full grid: interior from the spectral solve,
        # boundary from the parameters (corners: mean of the two edges).
        steady = sx @ steady_hat @ sy.T
        steady[0, :], steady[-1, :] = left, right
        steady[:, 0], steady[:, -1] = bottom, top
        steady[0, 0], steady[0, -1] = (left + bottom) / 2, (left + top) / 2
        steady[-1, 0], steady[-1, -1] = (right + bottom) / 2, (right + top) / 2

        # Deviation from the steady state, in the sine basis; it decays by
        # ``gain`` per step (backward Euler: 1 / (1 + dt*alpha*mu)).
        initial_hat = sx[1:-1].T @ np.full((nx - 2, ny - 2), initial) @ sy[1:-1]
        self._w_hat = initial_hat - steady_hat
        self._gain = 1.0 / (1.0 + self.dt * self.alpha * mu)

        # The fine rows from this rank's first coarse row to its last: all computed, every refine-th sent.
        rows = slice(self.start * refine, (self.stop - 1) * refine + 1 if self.stop > self.start else 0)
        self._steady_local = np.ascontiguousarray(steady[rows])
        self._sx_local = np.ascontiguousarray(sx[rows])
        self._sy_t = np.ascontiguousarray(sy.T)

    def resume_from(self, field: np.ndarray) -> None:
        """Continue from ``field`` as if this solver had made it its next step (a surrogate's prediction in place
        of a step): the whole grid, on one rank without refinement."""
        if self.refine != 1 or self.local_shape != (self.nx, self.ny) or np.shape(field) != self.local_shape:
            raise ValueError(f"resume_from takes the whole {self.nx}x{self.ny} field of an unrefined one-rank solver")
        deviation = (np.asarray(field, dtype=np.float64) - self._steady_local)[1:-1, 1:-1]
        self._w_hat = self._sx_local[1:-1].T @ deviation @ self._sy_t.T[1:-1]  # the interior sine basis is orthonormal
        self.time_step += 1

    def step(self) -> np.ndarray:
        """Advance one time step and return this rank's rows of the new field.

        Returns a fresh float32 C-contiguous array of shape ``local_shape``
        on every call, so the caller may keep or send it asynchronously.
        """
        self._w_hat *= self._gain
        self.time_step += 1
        local = self._steady_local + self._sx_local @ self._w_hat @ self._sy_t
        return np.ascontiguousarray(local[:: self.refine, :: self.refine], dtype=np.float32)
