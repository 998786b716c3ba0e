"""melissa_sim.c in Python, written to Melissa's Python API as Melissa documents it.

melissa_sim.py STEPS A B
"""

import sys

import numpy as np
from mpi4py import MPI

from melissa_api import melissa_finalize, melissa_init, melissa_send

GLOBAL = 11

steps, a, b = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
first, end = rank * GLOBAL // size, (rank + 1) * GLOBAL // size
melissa_init("u", end - first, comm)
melissa_init("mark", 1, comm)
for t in range(steps):
    melissa_send("u", a * np.arange(first, end) + b * t)
    melissa_send("mark", np.array([100.0 * rank + t]))
melissa_finalize()
