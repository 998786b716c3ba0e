"""The sparse optimizers' Triton kernels against the torch path: compiled on a GPU, else on CPU tensors run by
Triton's interpreter, so that every machine tests them."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import melissa_dl.embeddings
from melissa_dl.embeddings import gpu_kernels, row_kernels
from melissa_dl.embeddings.sparse_optim import SPARSE_OPTIMIZERS, SparseOptimizer, make_sparse_optimizer

pytest.importorskip("triton", reason="Triton is not installed here (the 'test' and 'gpu' extras bring it)")

pytestmark = pytest.mark.timeout(300)

ROWS, DIM = 200, 20  # a row of 20: the kernels' 32 lanes masked
HYPER = {"sgd": {}, "adagrad": {"eps": 1e-6}, "rowadagrad": {"eps": 1e-6}, "adam": {"betas": (0.8, 0.9), "eps": 1e-6}}


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> torch.device:
    """Where the kernels run: the GPU, or the CPU through Triton's interpreter (``TRITON_INTERPRET``, which
    tests/conftest.py sets before anything imports triton where there is no GPU)."""
    if torch.cuda.is_available():
        return torch.device("cuda")
    loops = gpu_kernels.load()
    assert loops is not None
    assert "Interpreted" in type(loops._step).__name__, "triton was imported before TRITON_INTERPRET was set"
    monkeypatch.setattr(gpu_kernels, "on_cpu", True)
    return torch.device("cpu")


def batches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Ids and gradients of three steps: repeated ids, a hot row of 100 occurrences (its run spans four chunks
    of 32 and starts inside one), rows touched once; then a step of one id."""
    gen = torch.Generator().manual_seed(5)
    spread = torch.randint(0, ROWS, (60,), generator=gen)
    steps = [torch.cat([spread, torch.full((100,), 7), spread[:20]]), torch.randint(0, 12, (45,), generator=gen)]
    steps.append(torch.tensor([ROWS - 1]))
    return [(ids, torch.randn(len(ids), DIM, generator=gen).to(dtype)) for ids in steps]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(SPARSE_OPTIMIZERS))
def test_each_optimizers_kernel_updates_rows_and_state_as_the_torch_path(
    name: str, dtype: torch.dtype, device: torch.device, monkeypatch: pytest.MonkeyPatch
) -> None:
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(3)).to(dtype)
    with monkeypatch.context() as torch_only:  # the reference: torch's ops
        torch_only.setattr(gpu_kernels, "on_cpu", False)
        torch_only.setattr(row_kernels, "load", lambda: None)
        reference = make_sparse_optimizer(name, 0.05, **HYPER[name])
        reference.bind(init.clone())
        assert not reference._on_gpu
        expected = [after(reference, ids, grads) for ids, grads in batches(dtype)]
    fused = make_sparse_optimizer(name, 0.05, **HYPER[name])
    fused.bind(init.clone().to(device))
    assert fused._on_gpu, "the shard takes the kernels"
    for (ids, grads), (count, weight, state) in zip(batches(dtype), expected, strict=True):
        got = after(fused, ids.to(device), grads.to(device))
        assert isinstance(got[0], torch.Tensor) and int(got[0]) == count
        # bfloat16: a row's float32 sum, added up in another order, may round to the neighbouring bfloat16 (one
        # step of 2^-8 relative, up to 0.008 for the table's values under 3)
        tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
        torch.testing.assert_close(got[1].cpu(), weight, **tolerance)
        for key, tensor in state.items():
            assert got[2][key].dtype == torch.float32  # a bfloat16 table's state too
            torch.testing.assert_close(got[2][key].cpu(), tensor, rtol=1e-5, atol=1e-6)


def after(
    opt: SparseOptimizer, ids: torch.Tensor, grads: torch.Tensor
) -> tuple[int | torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One step: the count it returned, the table and the state after it."""
    assert opt.weight is not None
    count = opt.step(ids, grads)
    return count, opt.weight.clone(), {k: v.clone() for k, v in opt.state.items()}


def layouts() -> dict[str, torch.Tensor]:
    """Ids whose sorted runs meet the kernel's chunks of 32 positions (rows of ``DIM``) in every way."""
    gen = torch.Generator().manual_seed(11)
    return {
        "one id": torch.tensor([4]),
        "one run filling a chunk": torch.full((32,), 9),
        "one run filling two chunks": torch.full((64,), 9),
        "runs ending at a chunk's last position and on": torch.repeat_interleave(
            torch.tensor([0, 1, 2]), torch.tensor([31, 33, 33])
        ),
        "hot runs side by side": torch.arange(5).repeat(40),
        "hot runs of ids outside the shard": torch.cat(
            [torch.full((70,), -1), torch.arange(30), torch.full((40,), ROWS)]
        ),
        "zipf over many chunks": (torch.distributions.Pareto(1.0, 1.2).sample((300,)).long() - 1) % 50,
        "spread": torch.randint(0, ROWS, (257,), generator=gen),
    }


@pytest.mark.parametrize(("layout", "dim"), [(layout, DIM) for layout in layouts()] + [("zipf over many chunks", 300)])
def test_each_rows_gradients_are_summed_once_whatever_the_chunks_its_run_spans(
    layout: str, dim: int, device: torch.device
) -> None:
    """Rows of 300 take chunks of 8 positions (``gpu_loops.shape``)."""
    loops = gpu_kernels.load()
    assert loops is not None and loops.shape(dim)["CHUNK"] == {DIM: 32, 300: 8}[dim]
    torch.manual_seed(2)
    ids = layouts()[layout][torch.randperm(len(layouts()[layout]))]
    grads = torch.randn(len(ids), dim)
    inside = (ids >= 0) & (ids < ROWS)
    expected = torch.zeros(ROWS, dim, dtype=torch.float64).index_add_(0, ids[inside], -grads[inside].double())
    opt = make_sparse_optimizer("sgd", 1.0)
    weight = torch.zeros(ROWS, dim, device=device)
    opt.bind(weight)
    count = opt.step(ids.to(device), grads.to(device))
    assert int(count) == len(ids[inside].unique())
    torch.testing.assert_close(weight.cpu().double(), expected, rtol=1e-5, atol=1e-5)


def test_the_step_size_is_each_steps_own(device: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    """Adam's bias corrections and a learning rate changed between steps reach the kernel (read from the
    device, as a replayed graph reads them)."""
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(4))
    steps = batches(torch.float32)[:2] * 2
    results = []
    for kernel in (False, True):
        with monkeypatch.context() as m:
            if not kernel:  # the reference: torch's ops on the CPU
                m.setattr(gpu_kernels, "on_cpu", False)
                m.setattr(row_kernels, "load", lambda: None)
            where = device if kernel else torch.device("cpu")
            opt = make_sparse_optimizer("adam", 0.05, **HYPER["adam"])
            opt.bind(init.clone().to(where))
            assert opt._on_gpu == kernel
            for i, (ids, grads) in enumerate(steps):
                opt.lr = 0.05 * (i + 1)
                opt.step(ids.to(where), grads.to(where))
            assert opt.weight is not None
            results.append(opt.weight.cpu())
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_repeated_batch_size_is_replayed_as_a_cuda_graph_with_the_same_result(device: torch.device) -> None:
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(6))
    gen = torch.Generator().manual_seed(7)
    steps = [(torch.randint(0, 30, (150,), generator=gen), torch.randn(150, DIM, generator=gen)) for _ in range(5)]
    reference = make_sparse_optimizer("adam", 0.05, **HYPER["adam"])
    reference.bind(init.clone())
    graphed = make_sparse_optimizer("adam", 0.05, **HYPER["adam"])
    graphed.bind(init.clone().to(device))
    for ids, grads in steps:
        expected = reference.step(ids, grads)
        assert int(graphed.step(ids.to(device), grads.to(device))) == expected
    assert list(graphed._graphs._graphs) == [150], "the third step captured a graph, the next two replayed it"
    torch.testing.assert_close(graphed.weight.cpu(), reference.weight, rtol=1e-5, atol=1e-6)


def test_every_kernel_builds_for_an_h100_or_h200_here(tmp_path: Path) -> None:
    """What the interpreter cannot show, Triton's code generation for the GPU down to a cubin (ptxas comes with
    Triton), is checked on every machine."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path), "TRITON_DEFAULT_FP_FUSION": "1"}
    built = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("compile_for_gpu.py"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    assert built.stdout.split() == [f"{d}-{w}-{o}" for d in (64, 300) for w in ("fp32", "bf16") for o in range(4)]


def test_an_id_outside_the_shard_is_skipped_and_not_counted(device: torch.device) -> None:
    opt = make_sparse_optimizer("sgd", 1.0)
    weight = torch.zeros(ROWS, DIM, device=device)
    opt.bind(weight)
    count = opt.step(torch.tensor([3, ROWS, 3, -1], device=device), torch.ones(4, DIM, device=device))
    assert int(count) == 1
    assert torch.equal(weight[3].cpu(), torch.full((DIM,), -2.0)) and int((weight != 0).sum()) == DIM


def test_without_triton_the_torch_path_runs_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton raises ImportError
    monkeypatch.delitem(sys.modules, "melissa_dl.embeddings.gpu_loops", raising=False)
    monkeypatch.delattr(melissa_dl.embeddings, "gpu_loops", raising=False)
    monkeypatch.setattr(gpu_kernels, "on_cpu", True)
    gpu_kernels.load.cache_clear()
    try:
        caplog.set_level(logging.WARNING, logger=gpu_kernels.__name__)
        opt = make_sparse_optimizer("sgd", 1.0)
        weight = torch.zeros(ROWS, DIM)
        opt.bind(weight)
        for _ in range(2):
            assert opt.step(torch.tensor([5, 5]), torch.ones(2, DIM)) == 1  # the torch path's int
        assert torch.equal(weight[5], torch.full((DIM,), -4.0))
        assert [r.getMessage() for r in caplog.records].count(
            "Triton is not installed: the sparse optimizers on the GPU run torch's ops, several times slower "
            "(pip install 'melissa-dl[gpu]')"
        ) == 1
    finally:
        gpu_kernels.load.cache_clear()  # the next test loads the real kernels
