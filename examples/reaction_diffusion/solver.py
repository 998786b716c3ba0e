"""Gray–Scott reaction–diffusion on a periodic square grid: numpy only, deterministic.

    u_t = Du lap(u) - u v^2 + F (1 - u)
    v_t = Dv lap(v) + u v^2 - (F + k) v

Why it is the autoregressive example: from a few seeded spots, the feed rate
``F`` and the kill rate ``k`` decide what the field becomes, within one
simulation's 1000 time units: spots that split and fill the domain, rings
that grow into labyrinths, or a decay to a uniform state. A surrogate that
steps the field forward must learn how the local update depends on ``(F,
k)``, and its rollout lands in the wrong regime where it has seen too few of
them. The third parameter, ``seed``, only places the initial spots.

Numerics: forward Euler in time, the 5-point Laplacian on a grid of spacing
1 (``Du = 0.2``, ``Dv = 0.1``: patterns about ten cells wide), ``dt = 1``
(stable while ``4 D dt <= 1``), ``substeps`` of them per step returned. Float32
throughout, in preallocated arrays with a one-cell halo that each substep
refreshes from the opposite edges (periodic), so that a returned step costs
about 2 ms at 64x64 with 20 substeps on one core. Both fields stay in
``[0, 1]``.
"""

from __future__ import annotations

import numpy as np

PARAMETER_NAMES: tuple[str, ...] = ("feed", "kill", "seed")
FIELDS: tuple[str, ...] = ("u", "v")


def initial_state(seed: float, n: int, spots: int = 4) -> np.ndarray:
    """``[2, n, n]``: ``u = 1, v = 0`` with ``spots`` 7x7 squares of ``u = 0.5, v = 0.25`` and 2 % noise, placed
    by ``seed`` (a number in ``[0, 1)``: the study samples it like the others)."""
    rng = np.random.default_rng(int(seed * 2**32))
    state = np.zeros((2, n, n), dtype=np.float32)
    state[0] = 1.0
    for _ in range(spots):
        i, j = rng.integers(0, n, 2)
        rows, cols = np.arange(i - 3, i + 4) % n, np.arange(j - 3, j + 4) % n
        state[0][np.ix_(rows, cols)] = 0.5
        state[1][np.ix_(rows, cols)] = 0.25
    state += (0.02 * rng.standard_normal((2, n, n))).astype(np.float32)
    return np.clip(state, 0.0, 1.0)


class GrayScott:
    """``step()`` advances ``substeps`` explicit steps of ``dt`` and returns ``(u, v)``, fresh float32 ``[n, n]``
    arrays."""

    def __init__(
        self,
        feed: float,
        kill: float,
        seed: float,
        n: int = 64,
        substeps: int = 20,
        dt: float = 1.0,
        du: float = 0.2,
        dv: float = 0.1,
    ) -> None:
        if n < 3 or substeps < 1:
            raise ValueError(f"need n >= 3 and substeps >= 1, got n={n}, substeps={substeps}")
        if not 0 < 4 * max(du, dv) * dt <= 1:
            raise ValueError(f"explicit steps need 0 < 4 D dt <= 1, got du={du}, dv={dv}, dt={dt}")
        self.n, self.substeps = n, substeps
        self.padded = np.zeros((2, n + 2, n + 2), dtype=np.float32)
        self.state = self.padded[:, 1:-1, 1:-1]  # a view: the halo surrounds it
        self.state[:] = initial_state(seed, n)
        self.diffusion = (np.array([du, dv], dtype=np.float32) * np.float32(dt))[:, None, None]
        self.dt, self.feed, self.kill = np.float32(dt), np.float32(feed), np.float32(kill)
        self.change = np.empty((2, n, n), dtype=np.float32)
        self.reaction = np.empty((n, n), dtype=np.float32)

    def _halo(self) -> None:
        p = self.padded
        p[:, 0, 1:-1], p[:, -1, 1:-1] = p[:, -2, 1:-1], p[:, 1, 1:-1]
        p[:, 1:-1, 0], p[:, 1:-1, -1] = p[:, 1:-1, -2], p[:, 1:-1, 1]

    def _substep(self) -> None:
        """One forward-Euler step, in place: ``change`` is ``dt`` times the right-hand side."""
        self._halo()
        p, c, change, r = self.padded, self.state, self.change, self.reaction
        np.add(p[:, :-2, 1:-1], p[:, 2:, 1:-1], out=change)
        change += p[:, 1:-1, :-2]
        change += p[:, 1:-1, 2:]
        change -= 4 * c
        change *= self.diffusion
        u, v = c[0], c[1]
        np.multiply(u, v, out=r)
        r *= v
        r *= self.dt  # dt u v^2
        change[0] -= r
        change[1] += r
        change[0] += (self.dt * self.feed) * (1 - u)
        change[1] -= (self.dt * (self.feed + self.kill)) * v
        c += change

    def step(self) -> tuple[np.ndarray, np.ndarray]:
        for _ in range(self.substeps):
            self._substep()
        return self.state[0].copy(), self.state[1].copy()

    def solve(self, steps: int) -> np.ndarray:
        """``steps`` steps at once, ``[steps, 2, n, n]`` (the fields in ``FIELDS`` order): held-out and offline
        trajectories."""
        return np.stack([np.stack(self.step()) for _ in range(steps)])
