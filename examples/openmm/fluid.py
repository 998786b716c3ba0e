"""A Lennard-Jones fluid (argon) in OpenMM, and a Reporter that measures it every ``interval`` MD steps.

Parameters: the temperature in kelvin and the reduced density ``rho sigma^3``.
The fluid starts from an fcc lattice of ``particles`` atoms (4 n^3: 108, 256,
...) in a periodic cube, with Maxwell-Boltzmann velocities, and is
thermostatted by a Langevin integrator: the first reports show the lattice
melting, which is why the surrogate sees the report's index as an input.

What is measured, in reduced Lennard-Jones units (sigma, epsilon):

- ``rdf``: the radial distribution function g(r) in ``BINS`` bins over
  ``0 < r < R_MAX``, counted over the pairs of the frame;
- ``energy``: the potential energy per particle, ``U / (N epsilon)``;
- ``pressure``: ``P sigma^3 / epsilon`` from the kinetic energy and the
  pair virial.

The potential is truncated at ``CUTOFF`` with no dispersion correction, so
that the energy and the virial are those of the system simulated. The box
must be at least twice ``CUTOFF`` and ``R_MAX`` wide (with 108 particles, a
density of at most 0.85), so that g(r) is counted the same way at every
density.

OpenMM runs on its CPU platform with one thread: the simulations share the
machine with the server's ranks, and ``launcher.job_limit`` is what sets how
many cores they take.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import openmm
from openmm import app, unit

SIGMA = 0.3405  # nm, argon
EPSILON = 0.99605  # kJ/mol, 119.8 K
MASS = 39.948  # dalton
CUTOFF = 2.5  # sigma
R_MAX = 2.5  # sigma
BINS = 50
TIME_STEP = 0.01  # ps, 0.0046 of the Lennard-Jones time unit
FRICTION = 1.0  # 1/ps

Observables = dict[str, np.ndarray]


def lattice(particles: int, box: float) -> np.ndarray:
    """fcc positions ``[particles, 3]`` filling a cube of side ``box``, or ``ValueError`` naming the culprit."""
    cells = round((particles / 4) ** (1 / 3))
    if 4 * cells**3 != particles:
        raise ValueError(f"particles: {particles} does not fill an fcc lattice (4 n^3: 32, 108, 256, 500, ...)")
    corner = np.array([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]])
    cell = np.stack(np.meshgrid(*[np.arange(cells)] * 3, indexing="ij"), axis=-1).reshape(-1, 1, 3)
    return ((cell + corner) * (box / cells)).reshape(-1, 3)


def build(temperature: float, density: float, particles: int, seed: int) -> app.Simulation:
    """The OpenMM simulation at ``temperature`` (K) and reduced ``density``, on one CPU thread;
    ``seed`` (> 0) makes it repeatable (the velocities and the thermostat's noise)."""
    box = (particles / density) ** (1 / 3) * SIGMA
    if box / 2 < max(CUTOFF, R_MAX) * SIGMA:
        raise ValueError(f"density: {density} makes the box of {particles} particles shorter than twice the cutoff")
    topology = app.Topology()
    chain = topology.addChain()
    argon = app.Element.getBySymbol("Ar")
    system = openmm.System()
    lennard_jones = openmm.NonbondedForce()
    lennard_jones.setNonbondedMethod(openmm.NonbondedForce.CutoffPeriodic)
    lennard_jones.setCutoffDistance(CUTOFF * SIGMA)
    lennard_jones.setUseDispersionCorrection(False)
    for _ in range(particles):
        topology.addAtom("Ar", argon, topology.addResidue("AR", chain))
        system.addParticle(MASS)
        lennard_jones.addParticle(0.0, SIGMA, EPSILON)
    system.addForce(lennard_jones)
    vectors = [openmm.Vec3(box, 0, 0), openmm.Vec3(0, box, 0), openmm.Vec3(0, 0, box)] * unit.nanometer
    system.setDefaultPeriodicBoxVectors(*vectors)
    topology.setPeriodicBoxVectors(vectors)
    integrator = openmm.LangevinMiddleIntegrator(temperature * unit.kelvin, FRICTION / unit.picosecond, TIME_STEP)
    integrator.setRandomNumberSeed(seed)
    platform = openmm.Platform.getPlatformByName("CPU")
    simulation = app.Simulation(topology, system, integrator, platform, {"Threads": "1"})
    simulation.context.setPositions(lattice(particles, box) * unit.nanometer)
    simulation.context.setVelocitiesToTemperature(temperature * unit.kelvin, seed)
    return simulation


def observe(state: openmm.State) -> Observables:
    """g(r), the potential energy per particle and the pressure of one frame, in reduced units."""
    positions = state.getPositions(asNumpy=True).value_in_unit(unit.nanometer) / SIGMA
    box = state.getPeriodicBoxVectors(asNumpy=True).value_in_unit(unit.nanometer)[0, 0] / SIGMA
    n, volume = len(positions), box**3
    i, j = np.triu_indices(n, k=1)
    d = positions[i] - positions[j]
    r = np.linalg.norm(d - box * np.round(d / box), axis=1)
    counts, edges = np.histogram(r, bins=BINS, range=(0.0, R_MAX))
    shells = 4 / 3 * np.pi * (edges[1:] ** 3 - edges[:-1] ** 3)
    rdf = counts / (n * (n - 1) / 2 / volume * shells)
    near = r[r < CUTOFF] ** -6
    virial = np.sum(24 * (2 * near**2 - near))  # sum of r . f over the pairs within the cutoff
    kinetic = state.getKineticEnergy().value_in_unit(unit.kilojoule_per_mole) / EPSILON
    potential = state.getPotentialEnergy().value_in_unit(unit.kilojoule_per_mole) / EPSILON
    return {
        "rdf": rdf.astype(np.float32),
        "energy": np.float32(potential / n),
        "pressure": np.float32((2 * kinetic + virial) / (3 * volume)),
    }


class Reporter:
    """OpenMM's reporter interface: every ``interval`` steps, ``deliver(index, observables)``, the reports
    numbered 0, 1, 2, ... (the study's steps), not by MD step."""

    def __init__(self, interval: int, deliver: Callable[[int, Observables], None]) -> None:
        self.interval, self.deliver, self.reports = interval, deliver, 0

    def describeNextReport(self, simulation: app.Simulation) -> tuple[int, bool, bool, bool, bool]:
        """Steps to the next report; it needs the positions and the energies."""
        return self.interval - simulation.currentStep % self.interval, True, False, False, True

    def report(self, simulation: app.Simulation, state: openmm.State) -> None:
        self.deliver(self.reports, observe(state))
        self.reports += 1


def run(
    temperature: float,
    density: float,
    deliver: Callable[[int, Observables], None],
    reports: int,
    interval: int = 50,
    particles: int = 108,
    seed: int = 1,
) -> None:
    """Simulate ``reports * interval`` MD steps, delivering the observables every ``interval``."""
    simulation = build(temperature, density, particles, seed)
    simulation.reporters.append(Reporter(interval, deliver))
    simulation.step(reports * interval)
