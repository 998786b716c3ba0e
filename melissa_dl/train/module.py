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
import threading
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

_LOGGING = threading.Lock()  # what TrainingModule.log gathers, taken by the trainer's thread


class TrainingModule(nn.Module, ABC):
    """The one class a user writes to train on a study: the model (an ``nn.Module``) and the hooks the server calls.

    Subclass it and define ``configure_optimizer``, ``process`` and ``training_step``; the other hooks are optional.
    The server owns the loop, the devices and every collective, so a module holds no MPI or ``torch.distributed``
    code: on every rank it builds the module with ``training.options`` as keyword arguments, sets ``rank``,
    ``world_size`` and ``window``, moves it to the training device and calls the hooks. The config names the file and
    the class (``training.module``, ``training.class_name``); an option the constructor does not take, or one it
    requires that is missing, is a configuration error before the study starts. An exception in a hook, on any rank,
    ends the whole job, its traceback in the log.

    ```python
    class Surrogate(TrainingModule):
        deterministic_process = True  # optional: process() runs once per sample

        def __init__(self, hidden: int = 256):  # training.options are passed here
            super().__init__()
            self.net = nn.Sequential(nn.Linear(6, hidden), nn.ReLU(), nn.Linear(hidden, 1024))

        def configure_optimizer(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

        def process(self, sample):  # one buffered sample -> tensors
            x = torch.tensor([*sample.parameters, sample.time_step], dtype=torch.float32)
            return x, torch.from_numpy(sample.fields["temperature"]).flatten()

        def training_step(self, batch):  # the processed samples, stacked
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)
    ```
    """

    rank: int = 0  # set by the server before any hook runs
    """This process's rank among the training ranks, from 0. The server sets it after the constructor, before any
    hook runs: the constructor sees the default, 0."""
    world_size: int = 1
    """How many ranks train; set with ``rank``."""
    window: Any = None  # ``training.window`` (``inputs``, ``targets``, ``stride``), or None: a sample is a step
    """The ``training.window`` section (``inputs``, ``targets``, ``stride``), so that ``process`` splits a window where
    the configuration says (``sample.fields[name][:self.window.inputs]``); None without windows, where a sample is
    one step. Set with ``rank``."""
    deterministic_process: bool = False
    """True when ``process`` depends on the sample alone (no randomness, no state that changes) and returns
    the same shapes and dtypes for every sample: the server then runs it once per sample, as the sample
    arrives, keeps its outputs as rows of preallocated tensors, and forms each batch with one ``index_select``
    per output (``melissa_dl.buffers.rows``; a second copy of the buffered samples, processed). False: ``process``
    runs every time a sample is served into a batch. Not applied with ``training.window``."""

    prediction_inputs: Mapping[str, tuple[str, tuple[int, ...]]] = {}
    """What one prediction is asked with: name -> (dtype, shape) of its array, as
    ``{"parameters": ("float32", (5,)), "time_step": ("float32", ())}``; ``predict`` gets them stacked,
    ``[n, *shape]``. A module that declares them is also saved as TorchScript when it can be traced
    (``melissa_dl.serving.saved``); empty: it is saved as a state dict only. A declaration that is not a mapping of
    name to (dtype, shape), with a dtype a field may have and sizes > 0, is a ``ConfigError`` when the module is
    built."""

    @abstractmethod
    def configure_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer of the module's parameters, called once on each rank, once the module is on its device.

        The server zeroes the gradients, averages them over the ranks and steps it at each batch: never call
        ``zero_grad`` or ``step`` yourself. A ``ShardedEmbedding``'s rows are not its business: each table has its own
        sparse optimizer.

        :returns: a ``torch.optim.Optimizer`` of ``self.parameters()``, or of the dense ones beside the tables.
        """

    @abstractmethod
    def process(self, sample: Sample) -> Any:
        """Turn one buffered sample into what a batch stacks: the model's inputs and targets.

        It runs each time the sample is served into a batch (as often as the buffer serves it), or once per sample,
        as it arrives, with ``deterministic_process``; at each validation, on the rank's held-out samples. The server
        stacks the outputs of a batch's samples along a new first axis and moves them to the training device.

        :param sample: one time step of one simulation (with ``training.window``, one window of steps).
        :returns: a tensor, a numpy array or a number, or a tuple, list or dict of them: each batch has the same
            structure, each leaf stacked (numpy arrays become tensors).
        """

    @abstractmethod
    def training_step(self, batch: Any) -> torch.Tensor:
        """The loss of one batch, in ``train()`` mode: the server calls ``backward`` on it and steps the optimizers.

        It must not change parameters or embedding shards in place: only the optimizers do, after it, and a
        checkpoint's copy of them may be in the making while it runs. A step happens only when every rank has a batch.

        :param batch: the outputs of ``process`` for the batch's samples, stacked along a new first axis, on the
            training device.
        :returns: the loss, a scalar tensor; or one loss per sample (a vector), whose mean is trained on and which a
            study sampler that learns (``adaptive``) records per sample. The server averages it over the ranks.
        """

    def validation_step(self, batch: Any) -> torch.Tensor:
        """The validation loss of one batch of held-out samples: by default ``training_step``'s.

        Called without gradients, in ``eval()`` mode, on each rank's share of the held-out samples, at each
        validation (every ``training.nb_batches_update`` batches).

        :param batch: held-out samples, processed and stacked as for ``training_step``.
        :returns: the loss, a scalar tensor or one per sample; the validation loss is its mean over every rank's
            samples.
        """
        return self.training_step(batch)

    def predict(self, inputs: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        """The model's answers to ``n`` questions at once: what ``Client.predict``, a ``Predictor``, ``load_model``
        and the default ``plot`` ask, and what is traced into ``model.ts``. Called without gradients, in ``eval()``
        mode. By default ``forward(**inputs)``, whose tensor is named ``"output"`` (a mapping is returned as it is).

        ```python
        prediction_inputs = {"parameters": ("float32", (5,)), "time_step": ("float32", ())}

        def predict(self, inputs):
            x = torch.cat([inputs["parameters"], inputs["time_step"][:, None]], dim=1)  # [n, 6]
            return {"temperature": self.net(x).reshape(-1, 32, 32)}
        ```

        :param inputs: each name of ``prediction_inputs``, mapped to a tensor ``[n, *shape]`` of its dtype, on the
            module's device.
        :returns: each output by name, a tensor ``[n, ...]``.
        """
        outputs = self(**inputs)
        return outputs if isinstance(outputs, Mapping) else {"output": outputs}

    def log(self, name: str, value: float | torch.Tensor) -> None:
        """Show ``value`` in TensorBoard as ``module/<name>``, from any hook: every ``training.log_interval``
        batches and after each validation, the mean of what was logged under ``name`` since (each rank its own).
        A tensor is read only then, not at each call, so that logging does not wait for the GPU.

        ```python
        def training_step(self, batch):
            x, y = batch
            error = self.net(x) - y
            self.log("max_error", error.abs().max())
            return error.square().mean()
        ```

        :param name: the curve's name, under ``module/``.
        :param value: a number, or a tensor of one.
        """
        value = value.detach() if isinstance(value, torch.Tensor) else float(value)
        with _LOGGING:  # ``process`` may run in the receiver's thread (``deterministic_process``)
            logged = self.__dict__.setdefault("_logged", {})  # beside nn.Module's attributes: no parameter or buffer
            total, count = logged.get(name, (0.0, 0))
            logged[name] = (total + value, count + 1)

    def plot(self, sample: Sample) -> Any:
        """A picture of the model on the held-out ``sample``, shown in TensorBoard after each validation
        (``validation/prediction``), or None. By default, where ``predict``'s inputs are the sample's parameters,
        time step or fields, each output named as a 1-D or 2-D field drawn beside it: 2-D fields as an image of
        truth, prediction and their difference, 1-D ones as curves.

        Called on rank 0 (on every rank where the module has a ``ShardedEmbedding``, whose lookups are collectives),
        always with the same sample: halfway through the first held-out simulation's steps that rank holds. Not
        called with ``training.window``.

        :param sample: a held-out time step.
        :returns: a matplotlib ``Figure``, an ``[H, W, 3]`` uint8 image, or None to show nothing.
        """
        from melissa_dl.train.pictures import prediction_against_truth  # matplotlib: only when drawn

        return prediction_against_truth(self, sample)

    def validation_samples(self) -> Sequence[Sample]:
        """Held-out samples for validation, beside the study's held-out simulations (``study.validation``): data
        at hand, never trained on. None by default. Called once on each rank when training begins; every rank must
        return the same samples, of which each validates on its share. With ``training.window``: steps, of which
        every whole window is validated on and every trajectory rolled out.

        :returns: the samples, ``Sample(simulation_id, time_step, parameters, fields)`` each.
        """
        return ()

    def advance(self, window: Sample) -> Mapping[str, Any]:
        """With ``training.window``: the ``targets`` steps that follow ``window``, whose fields hold the ``inputs``
        most recent steps (``[inputs, ...]``: true ones at first, then the model's own predictions), as
        ``[targets, ...]`` arrays or tensors per field. Called without gradients, in ``eval()`` mode, by the
        default ``rollout``; a module without it (or its own ``rollout``) is not rolled out.

        ```python
        def advance(self, window):  # window.fields["u"]: the last k steps, [k, H, W]
            x = torch.from_numpy(window.fields["u"])[None]
            return {"u": self.net(x)[0]}  # the next m steps, [m, H, W]
        ```

        :param window: the most recent steps of a held-out trajectory; its ``time_step`` is the first step's of the
            rollout plus the steps predicted so far.
        :returns: every field of ``window``, by name: at least one predicted step each, ``[targets, ...]``.
        :raises TypeError: not defined, and called by a module's own ``rollout``.
        """
        # optional, as validation_step is: ``rolls_out`` tells whether a module overrides it, so this is reached
        # only by a module whose own ``rollout`` calls it: the module's mistake, named with its fix
        raise TypeError(
            f"{type(self).__name__}.advance(window) is called (by its rollout) but not defined: define it, or a "
            "rollout that does not call it"
        )

    def rollout(self, first: Sample, steps: int) -> dict[str, np.ndarray]:
        """The model's predictions of the ``steps`` steps after ``first`` (whose fields hold a trajectory's first
        ``inputs`` steps), ``[steps, ...]`` per field: by default ``advance``, its predictions fed back. Called
        without gradients, in ``eval()`` mode, on the held-out trajectories at every validation; define it instead
        of ``advance`` for a model that predicts many steps at once.

        :param first: the trajectory's first ``inputs`` true steps, as a window (``[inputs, ...]`` per field).
        :param steps: how many steps to predict: the rest of the trajectory.
        :returns: each field of ``first`` by name, ``[steps, ...]``.
        :raises ValueError: ``advance`` returned other fields than ``first``'s, or no step of one.
        """
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
    with _LOGGING:
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
