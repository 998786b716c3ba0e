"""Extending is one place: a scheduler, a buffer kind, or a sparse optimizer written with torch alone, is one new
file plus one line in its registry; a study runs with them, and a broken one breaks only the studies that choose
it."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from pathlib import Path

from support import ROOT, SIMULATIONS, STEPS, clean_environment, committed, paced_config, server_command, wait_for
from test_fault_tolerance import assert_every_step_once

from melissa_dl.checkpoint.serialization import loads
from melissa_dl.checkpoint.versions import latest_valid
from melissa_dl.runtime.status import EXIT_STOPPED

TOY_SCHEDULER = '''
"""A scheduler that runs each simulation as a local process and says so in the server's log."""
import logging
from dataclasses import dataclass, field

from launcher.schedulers import JobTemplate, LocalScheduler, Scheduler

logger = logging.getLogger(__name__)


@dataclass
class ToyOptions:
    """Options of each simulation's job (scheduler `toy`)."""

    tag: str = field(default="toy", metadata={"doc": "Said in the log at each start."})


class ToyScheduler(LocalScheduler):
    summary = "a local process, announced"
    Options = ToyOptions

    @classmethod
    def from_job(cls, job: JobTemplate) -> Scheduler:
        scheduler = cls(job.command, job.cwd)
        scheduler.tag = job.options.tag
        return scheduler

    def dry_run(self):
        return "the toy refuses" if self.tag == "refuse" else None

    def start(self, simulation_id, attempt, env, log_path):
        logger.warning("toy scheduler %s starts simulation %d", self.tag, simulation_id)
        return super().start(simulation_id, attempt, env, log_path)
'''

TOY_OPTIMIZER = '''
"""Sparse SGD in torch alone, counting the rows it updated."""
import logging

import torch

from melissa_dl.embeddings.sparse_optim import SparseOptimizer

logger = logging.getLogger(__name__)


class ToySGD(SparseOptimizer):
    name = "toysgd"

    def _new_state(self, weight):
        return {"updates": torch.zeros(weight.shape[0], dtype=torch.int64)}

    def _update(self, weight, rows, grads):
        if not self.state["updates"].any():
            logger.warning("toysgd takes its first step")
        weight.index_copy_(0, rows, weight.index_select(0, rows) - self.lr * grads)
        self.state["updates"].index_add_(0, rows, torch.ones_like(rows))
'''


TOY_BUFFER = '''
"""A FIFO that counts the samples it took, across restarts and reshards, and says so when reception ends."""
import logging
from dataclasses import dataclass, field

from melissa_dl.buffers.kinds import FifoBuffer

logger = logging.getLogger(__name__)


@dataclass
class CountedOptions:
    """Options of buffer kind `counted`."""

    label: str = field(default="counted", metadata={"doc": "Said with the count."})


class CountedBuffer(FifoBuffer):
    kind = "counted"
    Options = CountedOptions
    taken = 0

    def _insert(self, entry):
        self.taken += 1
        super()._insert(entry)

    def _on_close(self):
        logger.warning("buffer %s took %d samples", self.options.label, self.taken)

    def state_dict_with(self, other):
        state, (taken, got) = super().state_dict_with(lambda: (self.taken, other()))
        return {**state, "taken": taken}, got

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.taken = state["taken"]

    def load_resharded(self, olds, rank, size):
        super().load_resharded(olds, rank, size)
        self.taken = sum(old["taken"] for old in olds) if rank == 0 else 0
'''


def add_registry_line(path: Path, registry: str, line: str) -> None:
    """Insert ``line`` as the first entry of ``registry = {`` in ``path``: the one line a new part needs."""
    text = path.read_text()
    opening = f"{registry} = {{\n"
    assert text.count(opening) == 1, f"{path}: no single {opening!r}"
    path.write_text(text.replace(opening, f"{opening}    {line}\n"))


def copy_of_the_source(tmp_path: Path) -> Path:
    """The packages copied, to be extended there (with __pycache__: numba's compiled loops, valid for the copies)."""
    source = tmp_path / "source"
    for package in ("melissa_dl", "launcher"):
        shutil.copytree(ROOT / package, source / package)
    return source


def test_a_new_scheduler_and_a_torch_only_sparse_optimizer_are_one_file_and_one_line_each(tmp_path: Path) -> None:
    source = copy_of_the_source(tmp_path)
    (source / "launcher" / "toy.py").write_text(TOY_SCHEDULER)
    add_registry_line(
        source / "melissa_dl" / "config" / "registry.py", "SCHEDULERS", '"toy": "launcher.toy:ToyScheduler",'
    )
    (source / "melissa_dl" / "embeddings" / "toy_sgd.py").write_text(TOY_OPTIMIZER)
    add_registry_line(
        source / "melissa_dl" / "embeddings" / "sparse_optim.py",
        "SPARSE_OPTIMIZERS",
        '"toysgd": "melissa_dl.embeddings.toy_sgd:ToySGD",',
    )
    environment = {**clean_environment(), "PYTHONPATH": str(source)}

    output = tmp_path / "output"
    config = paced_config(output, class_name="Table", scheduler="toy", toy={"tag": "refuse"})
    config["training"]["options"]["optimizer"] = "toysgd"
    # from tmp_path: ``python -m`` puts the working folder first on the path, before PYTHONPATH
    check = subprocess.run(
        server_command(tmp_path, config, 1, "--check")[3:],
        env=environment,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert check.returncode == 2, check.stdout + check.stderr
    assert f"{tmp_path / 'config.json'}: launcher.toy: the toy refuses" in check.stderr

    config["launcher"]["toy"] = {"tag": "hello"}
    command = server_command(tmp_path, config, 2)
    done = subprocess.run(command, env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=180)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert all(f"toy scheduler hello starts simulation {s}\n" in log for s in range(SIMULATIONS)), log
    assert "toysgd takes its first step" in log
    report = json.loads((output / "report.json").read_text())
    assert report["simulations"]["done"] == SIMULATIONS
    assert report["samples_received"] == SIMULATIONS * STEPS


def test_a_new_buffer_kind_with_options_and_state_of_its_own_checkpoints_and_reshards(tmp_path: Path) -> None:
    """A kind counting the samples it took (``buffer.counted.label``, its state ``taken``): stopped after a
    checkpoint on 2 ranks, resumed on 3, every sample is trained once and the counts add up to every sample."""
    source = copy_of_the_source(tmp_path)
    (source / "melissa_dl" / "buffers" / "counted.py").write_text(TOY_BUFFER)
    add_registry_line(
        source / "melissa_dl" / "config" / "registry.py",
        "BUFFERS",
        '"counted": "melissa_dl.buffers.counted:CountedBuffer",',
    )
    environment = {**clean_environment(), "PYTHONPATH": str(source)}
    output = tmp_path / "output"
    config = paced_config(output)
    config["buffer"] = {"kind": "counted", "capacity_samples": 1000, "counted": {"label": "hello"}}

    first = subprocess.Popen(
        server_command(tmp_path, config, 2),
        env=environment,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    wait_for(lambda: committed(output), first)
    first.send_signal(signal.SIGTERM)
    log, _ = first.communicate(timeout=60)
    assert first.returncode == EXIT_STOPPED, log
    assert not (output / "report.json").exists(), "the study should have been cut short"

    done = subprocess.run(
        server_command(tmp_path, config, 3), env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert "written by 2 ranks" in log
    assert_every_step_once(output, ranks=3)
    counts = [int(n) for n in re.findall(r"buffer hello took (\d+) samples", log)]
    assert len(counts) == 3 and sum(counts) == SIMULATIONS * STEPS, log
    version = latest_valid(output / "checkpoints")
    assert version is not None
    assert sum(loads(version.read(rank, "stream.pt"))["buffer"]["taken"] for rank in range(3)) == SIMULATIONS * STEPS


BROKEN = "def broken(:\n"  # line 1: a syntax error


def test_a_broken_scheduler_buffer_kind_or_optimizer_file_breaks_only_the_studies_that_choose_it(
    tmp_path: Path,
) -> None:
    source = copy_of_the_source(tmp_path)
    (source / "launcher" / "broken.py").write_text(BROKEN)
    add_registry_line(
        source / "melissa_dl" / "config" / "registry.py", "SCHEDULERS", '"broken": "launcher.broken:Broken",'
    )
    (source / "melissa_dl" / "buffers" / "broken.py").write_text(BROKEN)
    add_registry_line(
        source / "melissa_dl" / "config" / "registry.py", "BUFFERS", '"broken": "melissa_dl.buffers.broken:Broken",'
    )
    (source / "melissa_dl" / "embeddings" / "broken.py").write_text(BROKEN)
    add_registry_line(
        source / "melissa_dl" / "embeddings" / "sparse_optim.py",
        "SPARSE_OPTIMIZERS",
        '"broken": "melissa_dl.embeddings.broken:Broken",',
    )
    environment = {**clean_environment(), "PYTHONPATH": str(source)}
    output = tmp_path / "output"

    def check(config: dict) -> subprocess.CompletedProcess[str]:
        command = server_command(tmp_path, config, 1, "--check")[3:]  # without mpirun
        return subprocess.run(command, env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=120)

    config = paced_config(output, class_name="Table")
    assert check(config).returncode == 0, check(config).stderr
    done = subprocess.run(
        server_command(tmp_path, config, 1), env=environment, cwd=tmp_path, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads((output / "report.json").read_text())["samples_received"] == SIMULATIONS * STEPS

    where = {
        "scheduler": ("launcher.scheduler", source / "launcher" / "broken.py"),
        "buffer": ("buffer.kind", source / "melissa_dl" / "buffers" / "broken.py"),
        "optimizer": ("sparse optimizer", source / "melissa_dl" / "embeddings" / "broken.py"),
    }
    for chosen, (key, path) in where.items():
        config = paced_config(
            tmp_path / chosen, class_name="Table", **({"scheduler": "broken"} if chosen == "scheduler" else {})
        )
        if chosen == "buffer":
            config["buffer"]["kind"] = "broken"
        if chosen == "optimizer":
            config["training"]["options"]["optimizer"] = "broken"
        refused = check(config)
        assert refused.returncode == 2, refused.stdout + refused.stderr
        [line] = refused.stderr.strip().splitlines()
        assert f"{key}: 'broken' cannot load: {path}:1: " in line and line.startswith("melissa-server: "), line
