"""A domain-decomposed simulation, in Python: each rank of a ``--dims`` grid of ranks (their product: the MPI size)
holds a block of a ``--global`` array, uneven where the sizes do not divide, with a halo of one cell; it sends the
block's interior, a non-contiguous view (Fortran-ordered with ``--fortran``), as its block of field ``p``.

Step t of simulation s holds, at global index (i, j, ...), ``10 s + 0.5 t + sum_d (d + 1) * 0.01 * i_d``: the same
values whatever the decomposition, so that a study of one rank and of many must receive the same fields.
"""

from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

from melissa_dl import Block, Client


def split(n: int, parts: int, index: int) -> tuple[int, int]:
    """Start and length of part ``index`` of ``n`` cells in ``parts`` (the first ones one longer)."""
    base, extra = divmod(n, parts)
    return index * base + min(index, extra), base + (index < extra)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dims", type=int, nargs="+", required=True)
    parser.add_argument("--global", dest="whole", type=int, nargs="+", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fortran", action="store_true")
    parser.add_argument("--overlap", action="store_true", help="rank 1's block starts one cell early on the last axis")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    coords = np.unravel_index(comm.Get_rank(), args.dims)
    start, shape = zip(*(split(n, parts, int(c)) for n, parts, c in zip(args.whole, args.dims, coords)))
    indices = np.meshgrid(*(np.arange(s, s + n) for s, n in zip(start, shape)), indexing="ij")
    space = sum((d + 1) * 0.01 * index for d, index in enumerate(indices))
    halo = np.zeros([n + 2 for n in shape], np.float32, order="F" if args.fortran else "C")
    interior = halo[tuple(slice(1, -1) for _ in shape)]  # not contiguous
    if args.overlap and comm.Get_rank() == 1:
        start = (*start[:-1], start[-1] - 1)
    block = Block(tuple(start), tuple(args.whole))
    with Client({"p": ("float32", shape, block)}, comm) as client:
        for t in range(args.steps):
            interior[...] = 10 * client.simulation_id + 0.5 * t + space
            client.send("p", t, interior)


if __name__ == "__main__":
    main()
