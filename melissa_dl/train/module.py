"""The one class a user writes to train on a study: ``TrainingModule``.

Like a LightningModule it *is* the model (an ``nn.Module``) and carries the
hooks the server calls; the server owns the loop, the devices and every
collective, so a user never writes MPI or ``torch.distributed`` code::

    class Surrogate(TrainingModule):
        def __init__(self, hidden: int = 256):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 1024))

        def configure_optimizer(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def process(self, sample):                    # each time a sample is served into a batch, or once
                                                      # per sample with deterministic_process = True
            x = torch.tensor([*sample.parameters, sample.time_step], dtype=torch.float32)
            return x, torch.from_numpy(sample.fields["temperature"]).flatten()

        def training_step(self, batch):               # batch: the processed samples, stacked
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

The config names the file and the class (``training.module``,
``training.class_name``); ``training.options`` are passed to the constructor.
"""

from __future__ import annotations

import difflib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from melissa_dl.buffers.sample import Sample
from melissa_dl.config.limits import DTYPES, MAX_NDIM
from melissa_dl.errors import ConfigError
from melissa_dl.runtime.plugins import load_class


class TrainingModule(nn.Module, ABC):
    """Subclass it; define ``configure_optimizer``, ``process`` and ``training_step``."""

    rank: int = 0  # set by the server before any hook runs
    world_size: int = 1
    window: Any = None  # ``training.window`` (``inputs``, ``targets``, ``stride``), or None: a sample is a step
    deterministic_process: bool = False
    """True when ``process`` depends on the sample alone (no randomness, no state that changes) and returns
    the same shapes and dtypes for every sample: the server then runs it once per sample, as the sample
    arrives, keeps its outputs as rows of preallocated tensors, and forms each batch with one ``index_select``
    per output (``melissa_dl.buffers.rows``; a second copy of the buffered samples, processed). False: ``process``
    runs every time a sample is served into a batch."""

    prediction_inputs: Mapping[str, tuple[str, tuple[int, ...]]] = {}
    """What one prediction is asked with: name -> (dtype, shape) of its array; ``predict`` gets them stacked,
    ``[n, *shape]``. A module that declares them is also saved as TorchScript when it can be traced
    (``melissa_dl.serving.saved``); empty: it is saved as a state dict only."""

    @abstractmethod
    def configure_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of the module's parameters."""

    @abstractmethod
    def process(self, sample: Sample) -> Any:
        """Turn one buffered sample into tensors (a tensor, a tuple or a dict of them)."""

    @abstractmethod
    def training_step(self, batch: Any) -> torch.Tensor:
        """The loss of one batch; the server averages it over ranks.

        It must not change parameters or embedding shards in place: only the
        optimizers do, after it, and a checkpoint's copy of them may be in the
        making while it runs.
        """

    def validation_step(self, batch: Any) -> torch.Tensor:
        """The validation loss of one batch (by default the training loss)."""
        return self.training_step(batch)

    def predict(self, inputs: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The model's answers to ``n`` questions at once: each input ``[n, *shape]`` (``prediction_inputs``),
        each output ``[n, ...]``, by name. Called without gradients, in ``eval()`` mode. By default
        ``forward(**inputs)``, whose tensor is named ``"output"`` (a mapping is returned as it is)."""
        outputs = self(**inputs)
        return outputs if isinstance(outputs, Mapping) else {"output": outputs}

    def log(self, name: str, value: float | torch.Tensor) -> None:
        """Show ``value`` in TensorBoard as ``module/<name>``, from any hook: every ``training.log_interval``
        batches and after each validation, the mean of what was logged under ``name`` since (each rank its own)."""
        logged = self.__dict__.setdefault("_logged", {})  # beside nn.Module's attributes: no parameter, no buffer
        total, count = logged.get(name, (0.0, 0))
        logged[name] = (total + (value.detach() if isinstance(value, torch.Tensor) else float(value)), count + 1)

    def plot(self, sample: Sample) -> Any:
        """A matplotlib figure of the model on the held-out ``sample``, shown in TensorBoard after each validation
        (``validation/prediction``), or None. By default, where ``predict``'s inputs are the sample's parameters,
        time step or fields, each output named as a 1-D or 2-D field, drawn beside it."""
        from melissa_dl.train.pictures import prediction_against_truth  # matplotlib: only when drawn

        return prediction_against_truth(self, sample)

    def validation_samples(self) -> Sequence[Sample]:
        """Held-out samples for validation; none by default (no validation). With ``training.window``: steps, of
        which every whole window is validated on and every trajectory rolled out."""
        return ()

    def advance(self, window: Sample) -> Mapping[str, Any]:
        """With ``training.window``: the ``targets`` steps that follow ``window``, whose fields hold the ``inputs``
        most recent steps (``[inputs, ...]``: true ones at first, then the model's own predictions), as
        ``[targets, ...]`` arrays or tensors per field. Called without gradients, in ``eval()`` mode, by the
        default ``rollout``; a module without it (or its own ``rollout``) is not rolled out."""
        # optional, as validation_step is: ``rolls_out`` tells whether a module overrides it, so this is reached
        # only by a module whose own ``rollout`` calls it: the module's mistake, named with its fix
        raise TypeError(
            f"{type(self).__name__}.advance(window) is called (by its rollout) but not defined: define it, or a "
            "rollout that does not call it"
        )

    def rollout(self, first: Sample, steps: int) -> dict[str, np.ndarray]:
        """The model's predictions of the ``steps`` steps after ``first`` (whose fields hold a trajectory's first
        ``inputs`` steps), ``[steps, ...]`` per field: by default ``advance``, its predictions fed back."""
        inputs = next(iter(first.fields.values())).shape[0]
        history = {name: list(array) for name, array in first.fields.items()}
        predicted: dict[str, list[np.ndarray]] = {name: [] for name in first.fields}
        made = 0
        while made < steps:
            window = {name: np.stack(steps_so_far[-inputs:]) for name, steps_so_far in history.items()}
            after = self.advance(Sample(first.simulation_id, first.time_step + made, first.parameters, window))
            if set(after) != set(history):
                raise ValueError(
                    f"{type(self).__name__}.advance returned {sorted(after)}, not every field {sorted(history)}"
                )
            for name, values in after.items():
                values = values.detach().cpu().numpy() if isinstance(values, torch.Tensor) else np.asarray(values)
                if len(values) == 0:
                    raise ValueError(f"{type(self).__name__}.advance predicted no step of '{name}'")
                history[name] += list(values)
                predicted[name] += list(values)
            made += len(next(iter(after.values())))
        return {name: np.stack(values[:steps]) for name, values in predicted.items()}

    def rolls_out(self) -> bool:
        """Whether the module defines ``advance`` or its own ``rollout``."""
        return type(self).advance is not TrainingModule.advance or type(self).rollout is not TrainingModule.rollout


def take_logged(module: TrainingModule) -> dict[str, float]:
    """What the module's ``log`` gathered since the last call, as TensorBoard points: the mean of each name."""
    logged = module.__dict__.pop("_logged", {})
    return {f"module/{name}": float(total) / count for name, (total, count) in logged.items()}


def check_prediction_inputs(module: TrainingModule) -> None:
    """``prediction_inputs`` of a module as it is built, so that a mistake in them ends the study before it starts,
    not when it writes its model."""
    where = f"{type(module).__name__}.prediction_inputs"
    if not isinstance(module.prediction_inputs, Mapping):
        raise ConfigError(f"{where}: expected a mapping of name to (dtype, shape)")
    for name, layout in module.prediction_inputs.items():
        if not (isinstance(layout, (tuple, list)) and len(layout) == 2):
            raise ConfigError(f"{where}[{name!r}]: expected (dtype, shape), got {layout!r}")
        dtype, shape = layout
        if dtype not in DTYPES:
            raise ConfigError(f"{where}[{name!r}]: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        if not (
            isinstance(shape, (tuple, list))
            and len(shape) < MAX_NDIM
            and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)
        ):
            raise ConfigError(f"{where}[{name!r}]: shape {shape!r} is not a tuple of fewer than {MAX_NDIM} sizes > 0")


def load_module_class(path: Path, class_name: str) -> type[TrainingModule]:
    """Import the user's file and return its TrainingModule subclass."""
    return load_class(path, class_name, TrainingModule, "training")


def check_options(cls: type[TrainingModule], options: dict[str, Any]) -> None:
    """``training.options`` against the constructor: a misspelt or missing option is a config error, not a
    ``TypeError`` on every rank."""
    parameters = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return
    named = [n for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in options:
        if key not in named:
            close = difflib.get_close_matches(key, named, n=1)
            takes = f" ({cls.__name__} takes {', '.join(named) or 'none'})"
            hint = f" (did you mean '{close[0]}'?)" if close else takes
            raise ConfigError(f"training.options.{key}: not an option of {cls.__name__}{hint}")
    for name in named:
        if parameters[name].default is inspect.Parameter.empty and name not in options:
            raise ConfigError(f"training.options.{name}: missing, {cls.__name__} requires it")
