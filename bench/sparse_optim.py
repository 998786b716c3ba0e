"""Sparse optimizer rows/s against ``nn.Embedding(sparse=True)`` + ``SparseAdam``
(docs/explanation/performance.md#what-the-targets-are).

A 1,000,000 x 64 float32 table, batches of 4096 ids from two distributions:
uniform, and Zipf (numpy ``zipf(a=1.2)``, folded into the table and sent
through a fixed random permutation so hot ids are scattered over the table as
in real data). Both sides do the whole lookup + backward + update of one batch:

- ours (each of sgd, adagrad, rowadagrad, adam), as ``ShardedEmbedding`` on
  one process does it less autograd: the lookup ``weight.index_select`` of the
  batch's ids, then ``opt.step(ids, grads)`` with the upstream gradient of a
  sum loss (ones), one row per id: the step sums the gradients of repeated
  ids and updates each distinct row once;
- baseline: ``nn.Embedding`` forward on the 4096 ids, backward of ``out.sum()``
  (a sparse COO gradient), ``torch.optim.SparseAdam.step()``;
- second baseline, when ``fbgemm-gpu-cpu`` is installed (``pip install -e
  '.[bench]'``; skipped, and said so, when it is not): FBGEMM's CPU
  table-batched embedding with its fused exact row-wise Adagrad, forward on the
  same ids (bags of one id) and backward of ``out.sum()``, which updates the
  table inside backward. It is compared with ``rowadagrad``, the same update.

rows/s counts batch ids per second on both sides (the ratio is the same as per
unique row, since both see the same batches). The memory-bandwidth bound of
each optimizer is the copy bandwidth of this machine (a 256 MiB clone, read +
write) divided by the bytes each unique row moves (read + write of the weight
row and of its state); ``bound_share`` is measured rows/s over that bound. All
state is pre-faulted (zero-filled) so the first touch of a page is not timed.
Sides alternate within each repetition; each figure is the median of
``--repeat`` repetitions and the ratio the median of per-repetition ratios.
Also prints a per-phase breakdown (us per batch) of our side: the lookup
(``gather``), the sort of the ids with their positions (``dedup``), the sum of
repeated ids' gradients and the update of the rows (``sum`` and ``update``,
done in one pass and told apart by timing the step on the batch's distinct
ids alone), and the step by torch's ops (``torch_step``: ``unique``,
``index_add_`` and the optimizer's torch math, what GPUs and float16 tables
run).

With ``--device cuda`` every tensor of both sides lives on the GPU, the
timers wait for the GPU, the RESULT names end in ``_cuda``, the bound is the
GPU's own copy bandwidth, and there is no FBGEMM baseline (its CPU build
only) nor breakdown (the GPU runs the Triton kernel of
``melissa_dl.embeddings.gpu_loops``, replayed as a CUDA graph from the warm-up's
second batch on since every batch has the same size, or torch's ops where Triton
is missing, as the first line says). ``step_us`` is our side's time per batch
(lookup and step); the targets on a GPU are ratio >= 10 for rowadagrad and adam,
``bound_share`` >= 0.25 at ``--batch 65536`` and ``step_us`` <= 100 at 4096.

    python bench/sparse_optim.py [--rows 1000000] [--dim 64] [--batch 4096] [--batches 60] [--repeat 7] [--threads 1]
                                 [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from melissa_dl.embeddings import gpu_kernels, row_kernels
from melissa_dl.embeddings.sparse_optim import SparseOptimizer, make_sparse_optimizer

OPTIMIZERS = ("sgd", "adagrad", "rowadagrad", "adam")
TARGETS = {"rowadagrad": "10", "adam": "4"}
CUDA_TARGETS = {"rowadagrad": "10", "adam": "10"}  # and >= 25% of the copy bandwidth at 65,536 ids, <= 100 us at 4096
LR = {"sgd": 1e-3, "adagrad": 1e-2, "rowadagrad": 1e-2, "adam": 1e-3}


def make_ids(dist: str, rows: int, batch: int, batches: int, seed: int, device: torch.device) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    if dist == "uniform":
        flat = rng.integers(0, rows, size=batch * batches)
    else:
        flat = rng.permutation(rows)[(rng.zipf(1.2, size=batch * batches) - 1) % rows]
    return list(torch.from_numpy(flat.astype(np.int64)).to(device).split(batch))


def timed(fn: Callable[[], None]) -> float:
    """Seconds ``fn`` takes, including the GPU work it queued."""
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else lambda: None
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def copy_bandwidth(device: torch.device, nbytes: int = 256 << 20, repeat: int = 5) -> float:
    """Bytes per second moved (read + write) copying a large tensor into a pre-faulted one."""
    src, dst = torch.ones(nbytes // 4, device=device), torch.zeros(nbytes // 4, device=device)
    dst.copy_(src)
    return 2 * nbytes / min(timed(lambda: dst.copy_(src)) for _ in range(repeat))


def ours_pass(opt: SparseOptimizer, weight: torch.Tensor, ids: list[torch.Tensor], ones: torch.Tensor) -> None:
    for batch in ids:
        weight.index_select(0, batch)  # the lookup
        opt.step(batch, ones)


def baseline_pass(emb: nn.Embedding, opt: torch.optim.Optimizer, ids: list[torch.Tensor]) -> None:
    for batch in ids:
        opt.zero_grad()
        emb(batch).sum().backward()
        opt.step()


def make_fbgemm(rows: int, dim: int) -> Callable[[torch.Tensor], None] | None:
    """FBGEMM's CPU embedding with fused exact row-wise Adagrad (lookup, backward and update of one batch), or
    None when ``fbgemm-gpu-cpu`` is not installed."""
    try:
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            EmbeddingLocation,
            SplitTableBatchedEmbeddingBagsCodegen,
        )
    except ImportError:
        return None
    table = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=LR["rowadagrad"],
        pooling_mode=PoolingMode.SUM,
    )
    offsets: dict[int, torch.Tensor] = {}

    def step(batch: torch.Tensor) -> None:
        bags = offsets.setdefault(len(batch), torch.arange(len(batch) + 1))  # one id per bag: a plain lookup
        table(batch, bags).sum().backward()

    return step


def fbgemm_pass(step: Callable[[torch.Tensor], None], ids: list[torch.Tensor]) -> None:
    for batch in ids:
        step(batch)


def breakdown(opt: SparseOptimizer, weight: torch.Tensor, ids: list[torch.Tensor], ones: torch.Tensor) -> str:
    """Microseconds per batch of each phase of our side, timed one phase at a time, and of the torch path's step.

    The step sums a repeated id's gradients inside its pass over the rows, so the two are told apart by
    subtraction: ``update`` is the step over the batch's distinct ids, one gradient each (their sort included),
    and ``sum`` what the whole step costs beyond it."""
    kernels = row_kernels.load()
    assert kernels is not None, "numba's compiled loops did not load"
    distinct = [torch.unique(batch) for batch in ids]

    def each(fn: Callable[[int], object]) -> float:
        def run() -> None:
            for i in range(len(ids)):
                fn(i)  # the result is dropped at once, as in the real pass

        return statistics.median(timed(run) for _ in range(3)) / len(ids) * 1e6

    gather = each(lambda i: weight.index_select(0, ids[i]))
    dedup = each(lambda i: kernels.sorted_keys(ids[i], len(weight)))
    step = each(lambda i: opt.step(ids[i], ones))
    update = each(lambda i: opt.step(distinct[i], ones[: len(distinct[i])]))
    torch_step = each(lambda i: opt._torch_step(weight, ids[i], ones))
    return (
        f"gather={gather:.0f} dedup={dedup:.0f} sum={step - update:.0f} update={update:.0f} "
        f"(step={step:.0f}) torch_step={torch_step:.0f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=60, help="batches per timed pass")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads, both sides")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(device)
    print(
        f"torch {torch.__version__} threads={torch.get_num_threads()} "
        f"device={torch.cuda.get_device_name(device) if cuda else 'cpu'} "
        f"table={args.rows}x{args.dim} float32 batch={args.batch} copy bandwidth={bandwidth / 1e9:.1f} GB/s"
    )

    weight = torch.randn(args.rows, args.dim, device=device)
    row_bytes = args.dim * weight.element_size()
    opts: dict[str, SparseOptimizer] = {}
    for name in OPTIMIZERS:  # all bound to one table: values do not matter for timing, memory does
        opts[name] = make_sparse_optimizer(name, LR[name])
        opts[name].bind(weight)
        for tensor in opts[name].state.values():
            tensor.fill_(0)  # pre-fault
    emb = nn.Embedding(args.rows, args.dim, sparse=True, device=device)
    base_opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-3)
    baseline_pass(emb, base_opt, [torch.arange(2, device=device)])
    for tensor in base_opt.state[emb.weight].values():
        if isinstance(tensor, torch.Tensor) and tensor.dim():
            tensor.zero_()  # pre-fault
    ones = torch.ones(args.batch, args.dim, device=device)
    fbgemm = None if cuda else make_fbgemm(args.rows, args.dim)
    print(
        "FBGEMM baseline: "
        + (
            "fbgemm-gpu-cpu, exact row-wise Adagrad"
            if fbgemm
            else "skipped (its CPU build only)"
            if cuda
            else "skipped (fbgemm-gpu-cpu is not installed: pip install -e '.[bench]')"
        )
    )
    suffix = "_cuda" if cuda else ""
    if cuda:
        kernels = "Triton kernels" if opts["sgd"]._on_gpu and gpu_kernels.load() else "torch's ops (no Triton)"
        print(f"sparse step on the GPU: {kernels}")

    results: list[str] = []
    for d, dist in enumerate(("uniform", "zipf")):
        ids = make_ids(dist, args.rows, args.batch, args.batches, seed=d, device=device)
        mean_unique = statistics.mean(len(torch.unique(b)) for b in ids)
        print(f"{dist}: {mean_unique:.0f} unique ids per batch of {args.batch} on average")
        for name in OPTIMIZERS:  # warm up
            ours_pass(opts[name], weight, ids[:2], ones)
        baseline_pass(emb, base_opt, ids[:2])
        base_t: list[float] = []
        fbgemm_t: list[float] = []
        ours_t: dict[str, list[float]] = {n: [] for n in OPTIMIZERS}
        if fbgemm:
            fbgemm_pass(fbgemm, ids[:2])
        for _ in range(args.repeat):  # interleaved, so drifts hit both sides
            base_t.append(timed(lambda: baseline_pass(emb, base_opt, ids)))
            if fbgemm:
                fbgemm_t.append(timed(lambda: fbgemm_pass(fbgemm, ids)))
            for name in OPTIMIZERS:
                ours_t[name].append(timed(lambda: ours_pass(opts[name], weight, ids, ones)))
        n_ids = args.batch * len(ids)
        base_rate = n_ids / statistics.median(base_t)
        print(f"  baseline Embedding+SparseAdam: {base_rate:12.0f} rows/s (includes its lookup and backward)")
        if fbgemm:
            fbgemm_rate = n_ids / statistics.median(fbgemm_t)
            print(f"  FBGEMM row-wise Adagrad:       {fbgemm_rate:12.0f} rows/s (includes its lookup and backward)")
            ratio = statistics.median(f / o for f, o in zip(fbgemm_t, ours_t["rowadagrad"]))
            results.append(
                f"RESULT sparse_rowadagrad_vs_fbgemm_{dist} ratio={ratio:.2f} "
                f"rows_per_s={n_ids / statistics.median(ours_t['rowadagrad']):.0f} "
                f"fbgemm_rows_per_s={fbgemm_rate:.0f}"
            )
        for name in OPTIMIZERS:
            rate = n_ids / statistics.median(ours_t[name])
            ratio = statistics.median(b / o for b, o in zip(base_t, ours_t[name]))
            bytes_per_row = 2 * (row_bytes + opts[name].state_bytes_per_row)
            bound = args.batch * bandwidth / (bytes_per_row * mean_unique)
            print(
                f"  {name:10s}: {rate:12.0f} rows/s  ratio {ratio:6.2f}  {bytes_per_row} B/unique row  "
                f"bound {bound:12.0f} rows/s"
                + ("" if cuda else f"  us/batch: {breakdown(opts[name], weight, ids, ones)}")
            )
            results.append(
                f"RESULT sparse_{name}_{dist}{suffix} ratio={ratio:.2f} "
                f"target={(CUDA_TARGETS if cuda else TARGETS).get(name, '-')} "
                f"rows_per_s={rate:.0f} baseline_rows_per_s={base_rate:.0f} bound_share={rate / bound:.3f} "
                f"step_us={statistics.median(ours_t[name]) / len(ids) * 1e6:.1f}"
            )
    print("\n".join(results))


if __name__ == "__main__":
    main()
