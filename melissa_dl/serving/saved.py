"""A study's trained model on disk, and the way back to a module (docs/how-to/use-the-model.md).

At its end (and on ``--export-model``) a study writes into its output folder:

- ``model.pt``: the module's ``state_dict`` on the CPU, every embedding table whole;
- ``model.json``: what rebuilds it: the module's file (an absolute path: the config's folder is not the output's),
  its class, ``training.options``, ``training.window``, the batches it was trained to (its version), and, when
  the module declares ``prediction_inputs``, the inputs and outputs of its ``predict``;
- ``model.ts``: for such a module whose ``predict`` traces, a TorchScript module whose ``forward`` takes those
  inputs as tensors ``[n, *shape]`` in their declared order and returns the outputs (one tensor, or a tuple in
  ``model.json``'s order): what C++ (``torch::jit::load``) and Fortran (FTorch) load.

``load_model`` rebuilds the module in any Python session, on one process: a ``ShardedEmbedding`` built without
the server's collectives holds its whole table, which ``model.pt`` has. Tracing needs the same single-process
module, so the study builds one from the files it just wrote rather than tracing its rank's replica, whose
lookups would be collectives over the ranks.
"""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from melissa_dl.config.sections import TrainingConfig, WindowConfig
from melissa_dl.embeddings.table import set_default_collectives
from melissa_dl.errors import ConfigError
from melissa_dl.runtime.files import write_atomic
from melissa_dl.train.module import TrainingModule, load_module_class
from melissa_dl.wire.predictions import described

logger = logging.getLogger(__name__)

FORMAT = 1  # of model.json
TRACE_SEED = 0  # of the random inputs a trace is made and checked with
TRACE_BATCHES = (2, 3)  # traced with the first, checked with the second: a batch size the trace froze fails


def save(
    folder: Path,
    state: dict[str, Any],
    training: TrainingConfig,
    module_file: Path,
    batches: int,
    prediction_inputs: Mapping[str, tuple[str, tuple[int, ...]]],
) -> None:
    """``model.pt``, ``model.json`` and, where the module declares ``prediction_inputs`` and its ``predict``
    traces, ``model.ts`` in ``folder``. Nothing of the user's code runs for a module
    that declares none, and what fails in it only costs the TorchScript file: the study's report follows."""
    (folder / "model.ts").unlink(missing_ok=True)  # an earlier model's trace must not answer for this one
    _write(folder / "model.pt", lambda stream: torch.save(state, stream))
    saved: dict[str, Any] = {
        "format": FORMAT,
        "module": str(module_file.resolve()),
        "class_name": training.class_name,
        "options": training.options,
        "window": vars(training.window) if training.window is not None else None,
        "batches": batches,
        "inputs": None,
        "outputs": None,
        "torchscript": None,
    }
    if prediction_inputs:
        saved["inputs"] = described(prediction_inputs)
        try:
            traced, saved["outputs"] = _trace(_rebuild(saved, state, "cpu", "model.pt"))
        except Exception as error:  # the user's code: any failure means only that there is no TorchScript file
            said = [line for line in str(error).splitlines() if any(c.isalpha() for c in line)] or [repr(error)]
            logger.warning("model.ts not written: %s's predict does not trace (%s)", training.class_name, said[-1])
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                _write(folder / "model.ts", lambda stream: torch.jit.save(traced, stream))
            saved["torchscript"] = "model.ts"
    write_atomic(folder / "model.json", (json.dumps(saved, indent=2) + "\n").encode())


def _write(path: Path, save_to: Callable[[io.BytesIO], None]) -> None:
    """What ``save_to`` writes into a stream, written atomically to ``path``."""
    stream = io.BytesIO()
    save_to(stream)
    write_atomic(path, stream.getbuffer())


def load_model(output_dir: str | Path, device: str | torch.device = "cpu") -> TrainingModule:
    """The module a study trained, rebuilt from its output folder (``model.json`` and ``model.pt``) on ``device``,
    in ``eval()`` mode: call its ``predict`` (under ``torch.no_grad()``), or any method of yours. Its class is
    imported from the file the study trained with, which must still be there."""
    folder = Path(output_dir)
    description, parameters = folder / "model.json", folder / "model.pt"
    try:
        saved = json.loads(description.read_text())
        state = torch.load(parameters, map_location="cpu", weights_only=True)
    except FileNotFoundError as error:
        raise ConfigError(
            f"{error.filename}: missing (a study writes model.pt and model.json at its end; --export-model writes "
            "them from its latest checkpoint)"
        ) from None
    if saved.get("format") != FORMAT:
        raise ConfigError(f"{description}: format {saved.get('format')!r}, this melissa_dl reads {FORMAT}")
    return _rebuild(saved, state, device, str(parameters)).eval()


def _rebuild(saved: dict[str, Any], state: dict[str, Any], device: str | torch.device, source: str) -> TrainingModule:
    """The module of ``saved`` (``model.json``) with the parameters of ``state`` (read from ``source``), on one
    process."""
    try:
        module_class = load_module_class(Path(saved["module"]), saved["class_name"])
    except ConfigError as error:  # it says training.module, the study's key: here it is model.json's
        raise ConfigError(f"model.json's module {saved['module']}: {str(error).split(': ', 1)[-1]}") from None
    with _single_process():
        module = module_class(**saved["options"])
    window = saved["window"]
    module.window = WindowConfig(**window) if window is not None else None
    changed = f"{source} does not match {saved['class_name']} of {saved['module']}"
    try:
        missing, unexpected = module.load_state_dict(state, strict=False)
    except RuntimeError as error:  # a size that changed
        said = " ".join(str(error).split())
        raise ConfigError(f"{changed} ({said}): was the file changed since the study?") from None
    missing = [key for key in missing if not key.endswith("._extra_state")]  # a table's: its range, whole here
    if missing or unexpected:
        raise ConfigError(
            f"{changed} (missing {missing[:3]}, unexpected {unexpected[:3]}): was the file changed since the study?"
        )
    return module.to(device)


@contextmanager
def _single_process() -> Iterator[None]:
    """Tables built meanwhile hold every row, whatever collectives the server set for its own module."""
    before = set_default_collectives(None)
    try:
        yield
    finally:
        set_default_collectives(before)


class _Positional(nn.Module):
    """``predict`` as TorchScript's callers call ``forward``: tensors in, in ``prediction_inputs``' order; one
    tensor out, or a tuple of them in ``outputs``' order."""

    def __init__(self, module: TrainingModule, outputs: list[str]) -> None:
        super().__init__()
        self.module, self.inputs, self.outputs = module, list(module.prediction_inputs), outputs

    def forward(self, *tensors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        answers = self.module.predict(dict(zip(self.inputs, tensors)))
        values = tuple(answers[name] for name in self.outputs)
        return values[0] if len(values) == 1 else values


def _trace(module: TrainingModule) -> tuple[torch.jit.ScriptModule, list[str]]:
    """``module``'s ``predict`` traced, and its outputs' names; raises if the trace does not give eager's answers
    at another batch size."""
    module.eval()
    traced_batch, checked_batch = (_example(module, n) for n in TRACE_BATCHES)
    with torch.no_grad():
        answers = module.predict(dict(zip(module.prediction_inputs, traced_batch)))
        if not isinstance(answers, Mapping) or not all(isinstance(v, torch.Tensor) for v in answers.values()):
            raise TypeError(f"predict returned {type(answers).__name__}, not a mapping of name to tensor")
        outputs = list(answers)
        wrapper = _Positional(module, outputs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TracerWarnings and torch.jit's deprecation: the check below decides
            traced = torch.jit.trace(wrapper, traced_batch, check_trace=False)
        expected, got = wrapper(*checked_batch), traced(*checked_batch)
    expected = expected if isinstance(expected, tuple) else (expected,)
    got = got if isinstance(got, tuple) else (got,)
    for name, want, have in zip(outputs, expected, got):
        if want.shape != have.shape or not torch.allclose(want, have, rtol=1e-4, atol=1e-5, equal_nan=True):
            raise ValueError(f"the trace answers '{name}' differently at a batch of {TRACE_BATCHES[1]}")
    return traced, outputs


def _example(module: TrainingModule, n: int) -> tuple[torch.Tensor, ...]:
    """A batch of ``n`` questions: random floats, and zeros for integers (valid ids of any table)."""
    rng = np.random.default_rng(TRACE_SEED)
    tensors = []
    for dtype, shape in module.prediction_inputs.values():
        kind = np.dtype(dtype)
        values = rng.standard_normal((n, *shape)) if kind.kind == "f" else np.zeros((n, *shape))
        tensors.append(torch.from_numpy(values.astype(kind)))
    return tuple(tensors)
