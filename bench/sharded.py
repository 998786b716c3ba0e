"""Sharded embedding lookup + update on K ranks against one rank doing all the work
(docs/explanation/performance.md#what-the-targets-are).

Run under ``mpirun -n 2``. Every step, each of the K ranks draws a batch of
``--batch`` uniform ids from a ``--rows x --dim`` table and runs forward, a
sum-loss backward and ``apply_gradients`` (``--optimizer``) on a
``ShardedEmbedding`` over ``MpiCollectives`` (three all-to-alls a step). The
baseline, in the same command, is rank 0 alone with the whole table
(``collectives=None``: no communication) processing the same batches of all K
ranks one after the other, while the other ranks wait at a barrier. Both use
the server's thread count (cores / ranks on the node). Phases alternate,
``--repeat`` times, so that both see the same machine load; the median time
of each is kept (the ratio of the best times is printed too: on a shared
machine the K-rank phase suffers more from a third process, since every
all-to-all waits for the descheduled rank).

    ratio    = time(K=1, all the work) / time(K ranks, all the work)  (1.0: no speedup, K: perfect)
    overhead = 1 / ratio - 1, target <= 30%: sharding over K ranks (which splits the
               table's memory) may cost at most 30% more wall time than one rank
               with the whole table doing the same lookups and updates; so the
               printed ratio target is 1 / 1.3.

    mpirun -n 2 python bench/sharded.py [--rows 1000000] [--dim 64] [--batch 4096] [--steps 30] [--repeat 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback

import torch
from mpi4py import MPI

from melissa_dl.embeddings.sparse_optim import make_sparse_optimizer
from melissa_dl.embeddings.table import ShardedEmbedding
from melissa_dl.runtime.collectives import MpiCollectives

OVERHEAD_TARGET = 0.30


def run_steps(emb: ShardedEmbedding, batches: list[torch.Tensor]) -> None:
    for ids in batches:
        emb(ids).sum().backward()
        emb.apply_gradients()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--optimizer", default="rowadagrad")
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.rank, comm.size
    local_ranks = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))  # as the server does
    g = torch.Generator().manual_seed(12345)
    # batches[s][r]: rank r's ids at step s; every rank draws them all, identically.
    batches = [
        [torch.randint(0, args.rows, (args.batch,), generator=g) for _ in range(size)] for _ in range(args.steps)
    ]
    sharded = ShardedEmbedding(
        args.rows,
        args.dim,
        make_sparse_optimizer(args.optimizer, args.lr),
        collectives=MpiCollectives(comm),
        name="bench",
    )
    whole = None
    if rank == 0:
        whole = ShardedEmbedding(args.rows, args.dim, make_sparse_optimizer(args.optimizer, args.lr), name="bench")
    mine = [step[rank] for step in batches]
    everything = [ids for step in batches for ids in step]
    run_steps(sharded, mine[:3])  # warm-up: first touches of pages, allocator, MPI connections
    if whole is not None:
        run_steps(whole, everything[:3])

    times_k, times_1 = [], []
    for _ in range(args.repeat):
        comm.Barrier()
        start = time.perf_counter()
        run_steps(sharded, mine)
        comm.Barrier()  # the step is over when the slowest rank is done
        times_k.append(time.perf_counter() - start)
        comm.Barrier()
        if whole is not None:
            start = time.perf_counter()
            run_steps(whole, everything)
            times_1.append(time.perf_counter() - start)
        comm.Barrier()

    if rank == 0:
        ids = args.steps * args.batch * size
        t_k, t_1 = statistics.median(times_k), statistics.median(times_1)
        ratio = t_1 / t_k
        print(
            f"K={size}: {[round(t * 1e3, 1) for t in times_k]} ms; K=1: {[round(t * 1e3, 1) for t in times_1]} ms "
            f"({args.steps} steps x {size} batches of {args.batch} ids, {args.rows} x {args.dim}, "
            f"{args.optimizer}, {torch.get_num_threads()} threads/rank)"
        )
        print(
            f"overhead = {1 / ratio - 1:+.1%} (target <= {OVERHEAD_TARGET:.0%}); best-of ratio "
            f"{min(times_1) / min(times_k):.3f}; "
            f"per K-rank step {t_k / args.steps * 1e3:.2f} ms, per batch on one rank "
            f"{t_1 / (args.steps * size) * 1e3:.2f} ms"
        )
        print(
            f"RESULT sharded_lookup_update ratio={ratio:.3f} target={1 / (1 + OVERHEAD_TARGET):.3f} "
            f"k{size if size > 1 else '1_sharded'}={ids / t_k:.0f}rows/s k1={ids / t_1:.0f}rows/s",
            flush=True,
        )


if __name__ == "__main__":
    try:
        main()
    except Exception:  # a benchmark reports, it does not fail the command
        traceback.print_exc()
        if MPI.COMM_WORLD.rank == 0:
            print("RESULT sharded_lookup_update ratio=nan target=0.769 k2=nan k1=nan", flush=True)
    sys.exit(0)
