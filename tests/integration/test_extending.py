"""Extending is one place: a scheduler, or a sparse optimizer written with torch alone, is one new file plus one
line in its registry, and a study runs with both."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from conftest import ROOT, SIMULATIONS, STEPS, clean_environment, paced_config, server_command

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


def add_registry_line(path: Path, registry: str, line: str) -> None:
    """Insert ``line`` as the first entry of ``registry = {`` in ``path``: the one line a new part needs."""
    text = path.read_text()
    opening = f"{registry} = {{\n"
    assert text.count(opening) == 1, f"{path}: no single {opening!r}"
    path.write_text(text.replace(opening, f"{opening}    {line}\n"))


def test_a_new_scheduler_and_a_torch_only_sparse_optimizer_are_one_file_and_one_line_each(tmp_path: Path) -> None:
    source = tmp_path / "source"
    for package in ("melissa_dl", "launcher"):  # with __pycache__: numba's compiled row loops, valid for the copies
        shutil.copytree(ROOT / package, source / package)
    (source / "launcher" / "toy.py").write_text(TOY_SCHEDULER)
    add_registry_line(source / "launcher" / "jobs.py", "SCHEDULERS", '"toy": "launcher.toy:ToyScheduler",')
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
