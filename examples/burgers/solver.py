"""1-D viscous Burgers equation on a periodic domain: numpy only, deterministic.

    u_t + (u^2 / 2)_x = nu u_xx,   x in [0, 1) periodic,   u(x, 0) = c + a sin(2 pi x)

Why it is the active-sampling example: a shock forms at ``t = 1 / (2 pi a)``
and its width scales like ``nu / a``. Over most of the viscosity range the
field stays smooth and depends smoothly on the parameters; in the thin slab of
small viscosities it carries a near-discontinuity whose position moves with
``c`` and ``t``, which a surrogate interpolates badly from few simulations.

Numerics (first order, split): convection by finite volumes with the exact
Godunov flux of the convex flux ``u^2 / 2``, sub-steps of at most
``CFL dx / max|u|`` (the maximum principle bounds ``|u|`` by ``|c| + a``);
diffusion by backward Euler on the 3-point Laplacian, solved exactly through
the FFT (the periodic matrix is circulant), stable for any step. ``refine``
solves on a grid that many times finer and returns cell averages on ``nx``
cells: the same field, more compute per step (a simulation's honest cost).
"""

from __future__ import annotations

import math

import numpy as np


class BurgersSolver:
    """``step()`` advances by ``t_end / steps`` and returns ``u`` on the ``nx`` cells (float32)."""

    CFL = 0.45

    def __init__(
        self, a: float, c: float, nu: float, nx: int = 256, steps: int = 32, t_end: float = 1.0, refine: int = 1
    ) -> None:
        self.nx, self.refine, self.steps = nx, refine, steps
        cells = nx * refine
        dx = 1.0 / cells
        x = (np.arange(cells) + 0.5) * dx
        self.u = c + a * np.sin(2.0 * np.pi * x)
        dt_out = t_end / steps
        self.substeps = max(1, math.ceil(dt_out * (abs(c) + abs(a) + 1e-12) / (self.CFL * dx)))
        self.ratio = dt_out / self.substeps / dx
        k = 2.0 * np.pi * np.fft.rfftfreq(cells)  # radians per cell
        self.implicit = 1.0 / (1.0 + nu * dt_out / self.substeps * (2.0 - 2.0 * np.cos(k)) / dx**2)
        self.done = 0

    @staticmethod
    def godunov(left: np.ndarray, right: np.ndarray) -> np.ndarray:
        """The exact Riemann flux of ``u^2 / 2`` between two states (0 across a transonic rarefaction)."""
        fl, fr = 0.5 * left * left, 0.5 * right * right
        flux = np.where(left > right, np.maximum(fl, fr), np.minimum(fl, fr))
        return np.where((left < 0.0) & (right > 0.0), 0.0, flux)

    def step(self) -> np.ndarray:
        if self.done >= self.steps:
            raise RuntimeError(f"the simulation has only {self.steps} steps")
        u = self.u
        for _ in range(self.substeps):
            flux = self.godunov(u, np.roll(u, -1))  # at the right face of each cell
            u = u - self.ratio * (flux - np.roll(flux, 1))
            u = np.fft.irfft(np.fft.rfft(u) * self.implicit, n=u.size)
        self.u = u
        self.done += 1
        return u.reshape(self.nx, self.refine).mean(axis=1).astype(np.float32)
