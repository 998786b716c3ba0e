"""The CUDA path on a GPU (docs/how-to/gpus.md#tested-on-a-gpu): online training, sparse optimizers and
checkpoints across devices.

Skipped, with the reason, where torch sees no CUDA device; NCCL's collectives
are in tests/mpi/test_nccl.py (under ``mpirun -n K``). A device's share of
the CPU path (the error of ``training.device: "cuda"`` without a GPU, the
copy to the CPU) is tested everywhere.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from mpi4py import MPI
from support import ROOT, SIMULATIONS, STEPS, paced_config, run_server
from test_fault_tolerance import assert_every_step_once, stop_after_first_checkpoint

from melissa_dl.checkpoint.serialization import loads
from melissa_dl.checkpoint.versions import latest_valid
from melissa_dl.embeddings.sparse_optim import SPARSE_OPTIMIZERS, make_sparse_optimizer
from melissa_dl.embeddings.table import ShardedEmbedding, set_default_collectives
from melissa_dl.errors import ConfigError
from melissa_dl.train.trainer import to_device, training_device

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device: torch.cuda.is_available() is False here")

pytestmark = pytest.mark.timeout(300)


@pytest.mark.skipif(CUDA, reason="a CUDA device is here: the error is for machines without one")
def test_cuda_asked_for_without_a_gpu_is_a_one_line_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r'^training.device: "cuda", but torch .* sees no CUDA device on '):
        training_device("cuda", MPI.COMM_SELF)
    assert training_device("auto", MPI.COMM_SELF) == torch.device("cpu")


def test_a_batch_for_the_cpu_is_neither_copied_nor_pinned() -> None:
    x = torch.arange(6.0)
    moved = to_device({"x": x, "pair": (x, 3)}, torch.device("cpu"))
    assert moved["x"] is x and moved["pair"][0] is x and moved["pair"][1] == 3


@needs_cuda
def test_a_batch_reaches_the_gpu_from_pinned_memory() -> None:
    batch = (torch.randn(32, 6), torch.randn(32, 1024))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        moved = to_device(batch, torch.device("cuda"))
        torch.cuda.synchronize()
    assert all(t.device.type == "cuda" for t in moved)
    assert all(torch.equal(m.cpu(), b) for m, b in zip(moved, batch))
    copies = [event.name for event in profile.events() if "Memcpy HtoD" in event.name]
    assert len(copies) == 2 and all("Pinned" in name for name in copies), copies


@needs_cuda
def test_the_heat_surrogate_trains_online_on_cuda_and_its_loss_falls(tmp_path: Path) -> None:
    example = ROOT / "examples" / "heat_pde"
    for name in ("heat.py", "solver.py", "surrogate.py"):
        shutil.copy(example / name, tmp_path)
    config = json.loads((example / "config.json").read_text())
    config.pop("$schema")
    config["output_dir"] = str(tmp_path / "output")
    config["study"]["simulations"] = 8
    config["training"].update(device="cuda", nb_batches_update=25)
    run = run_server(tmp_path, config, ranks=1, timeout=240)
    assert run.code == 0, run.log
    assert "rank 0 trains on cuda:0" in run.log
    assert run.report is not None
    held_out = config["study"]["validation"]["simulations"]  # the example's held-out simulations run too
    assert run.report["held_out"]["simulations"] == held_out
    assert run.report["samples_received"] == run.report["samples_expected"] == (8 + held_out) * 100
    training = run.report["training"]
    assert training["batches"] >= 20, training
    assert training["last_validation_loss"] < training["first_validation_loss"] / 2, training
    model = torch.load(tmp_path / "output" / "model.pt", weights_only=True)
    assert {tensor.device.type for tensor in model.values()} == {"cpu"}  # loads where there is no GPU


def _train(device: str, name: str, steps: int = 20) -> ShardedEmbedding:
    """A table of ``name`` trained on the same batches (repeated ids included) on ``device``."""
    table = ShardedEmbedding(500, 16, make_sparse_optimizer(name, 0.05), seed=7, device=device)
    generator = torch.Generator().manual_seed(11)
    for _ in range(steps):
        ids = torch.randint(0, 100, (256,), generator=generator)  # many repeats: their gradients are summed
        weights = torch.randn(256, 16, generator=generator)
        (table(ids.to(device)) * weights.to(device)).square().sum().backward()
        table.apply_gradients()
    return table


@needs_cuda
@pytest.mark.parametrize("name", sorted(SPARSE_OPTIMIZERS))
def test_a_sparse_optimizer_on_cuda_gives_the_cpu_result(name: str) -> None:
    set_default_collectives(None)
    cpu, gpu = _train("cpu", name), _train("cuda", name)
    assert gpu.shard.device.type == "cuda"
    torch.testing.assert_close(gpu.shard.cpu(), cpu.shard, rtol=1e-4, atol=1e-5)
    for key, state in cpu.optimizer.state.items():
        torch.testing.assert_close(gpu.optimizer.state[key].cpu(), state, rtol=1e-4, atol=1e-5, msg=key)
    assert gpu.optimizer.step_count == cpu.optimizer.step_count == 20


@needs_cuda
@pytest.mark.parametrize(("before", "after"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_checkpoint_written_on_one_device_resumes_on_the_other(tmp_path: Path, before: str, after: str) -> None:
    """The table module (a sharded table with sparse Adam, and a dense head) stops after its first checkpoint on
    ``before`` and ends the study on ``after``; the CUDA generator's state is in a checkpoint written on the GPU."""
    output = tmp_path / "output"
    config = paced_config(output, class_name="Table", job_limit=1)
    config["training"]["device"] = before
    stop_after_first_checkpoint(tmp_path, config, ranks=1)
    version = latest_valid(output / "checkpoints")
    assert version is not None
    cuda_state = loads(version.read(0, "trainer.pt"))["rng"]["cuda"]  # the rank's own GPU's generator
    assert isinstance(cuda_state, torch.Tensor) if before == "cuda" else cuda_state is None
    config["training"]["device"] = after
    run = run_server(tmp_path, config, ranks=1)
    assert run.code == 0, run.log
    assert "resuming from checkpoint" in run.log and f"rank 0 trains on {after}" in run.log
    assert run.report is not None and run.report["samples_received"] == SIMULATIONS * STEPS
    assert run.report["training"]["batches"] == SIMULATIONS * STEPS // 4
    assert_every_step_once(output, ranks=1)
