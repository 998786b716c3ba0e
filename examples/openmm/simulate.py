"""The Lennard-Jones fluid of fluid.py, streamed to the melissa_dl server.

The launcher sets the parameters (``temperature`` in kelvin and the reduced
``density``, read by name) and the server's endpoint in the environment.
OpenMM runs ``--reports`` x ``--interval`` MD steps; its Reporter hands g(r),
the potential energy per particle and the pressure to ``send`` every
``--interval`` steps, numbered 0, 1, 2, ... as the study counts its steps.
"""

from __future__ import annotations

import argparse

import fluid  # fluid.py sits next to this script
import numpy as np

from melissa_dl import Client

FIELDS = {"rdf": (np.float32, (fluid.BINS,)), "energy": (np.float32, ()), "pressure": (np.float32, ())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=int, default=100, help="reports sent: study.time_steps")
    parser.add_argument("--interval", type=int, default=50, help="MD steps between two reports")
    parser.add_argument("--particles", type=int, default=108, help="atoms, 4 n^3 (an fcc lattice)")
    args = parser.parse_args()
    with Client(FIELDS) as client:

        def send(report: int, observables: fluid.Observables) -> None:
            for name, value in observables.items():
                client.send(name, report, value)

        p = client.named_parameters
        # seeded by the simulation's id, so that a relaunched simulation sends again the steps it sent
        # before; + 1 since OpenMM draws a random seed for 0
        seed = client.simulation_id + 1
        fluid.run(p["temperature"], p["density"], send, args.reports, args.interval, args.particles, seed)


if __name__ == "__main__":
    main()
