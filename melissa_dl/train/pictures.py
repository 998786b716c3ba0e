"""What TensorBoard shows of the model at each validation, by default: its prediction of a held-out sample beside
the sample's own fields (``TrainingModule.plot``).

A module's ``prediction_inputs`` are taken from the sample by name (``parameters``, ``time_step`` or a field's
name); each output named as a field of one or two dimensions and of its shape is drawn: a 1-D field as two curves,
a 2-D one as three images: truth and prediction on the truth's colour scale, their difference on one centred on 0.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from melissa_dl.buffers.sample import Sample

if TYPE_CHECKING:
    from matplotlib.figure import Figure


class Predicting(Protocol):
    """What is drawn of a TrainingModule."""

    prediction_inputs: Mapping[str, tuple[str, tuple[int, ...]]]

    def predict(self, inputs: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]: ...

    def parameters(self) -> Iterator[torch.nn.Parameter]: ...


def prediction_against_truth(module: Predicting, sample: Sample) -> Figure | None:
    """The figure, or None where the sample does not hold the inputs or no output is a field of one or two
    dimensions."""
    inputs = _inputs(module, sample)
    if inputs is None:
        return None
    device = next(module.parameters(), torch.empty(0)).device
    with torch.no_grad():
        outputs = module.predict({name: tensor.to(device) for name, tensor in inputs.items()})
    pairs = []
    for name, output in outputs.items():
        truth = sample.fields.get(name)
        predicted = output[0].detach().float().cpu().numpy()
        if truth is not None and truth.ndim in (1, 2) and predicted.shape == truth.shape:
            pairs.append((name, np.asarray(truth, np.float32), predicted))
    return _draw(pairs, sample) if pairs else None


def _inputs(module: Predicting, sample: Sample) -> dict[str, torch.Tensor] | None:
    """``predict``'s inputs for one question, from the sample, or None."""
    found = {"parameters": sample.parameters, "time_step": np.asarray(sample.time_step), **sample.fields}
    inputs = {}
    for name, (dtype, shape) in module.prediction_inputs.items():
        value = found.get(name)
        if value is None or np.shape(value) != tuple(shape):
            return None
        inputs[name] = torch.from_numpy(np.asarray(value, dtype=dtype)[None].copy())
    return inputs if inputs else None


def _draw(pairs: list[tuple[str, np.ndarray, np.ndarray]], sample: Sample) -> Figure:
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    figure = Figure(figsize=(10, 3.2 * len(pairs)), layout="constrained")
    rows = figure.subfigures(len(pairs), 1, squeeze=False)[:, 0]
    for row, (name, truth, predicted) in zip(rows, pairs):
        row.suptitle(f"'{name}', simulation {sample.simulation_id}, step {sample.time_step}")
        if truth.ndim == 1:
            axes = row.subplots()
            axes.plot(truth, label="truth")
            axes.plot(predicted, label="prediction", linestyle="--")
            axes.legend()
            continue
        difference = predicted - truth
        largest = float(np.abs(difference).max()) or 1.0
        scales: list[dict[str, Any]] = [{"vmin": float(truth.min()), "vmax": float(truth.max())}] * 2
        scales.append({"vmin": -largest, "vmax": largest, "cmap": "RdBu_r"})  # white: no error
        images = [("truth", truth), ("prediction", predicted), ("prediction - truth", difference)]
        for axes, (title, image), scale in zip(row.subplots(1, 3), images, scales):
            row.colorbar(axes.imshow(image, **scale), ax=axes)
            axes.set_title(title)
            axes.set_axis_off()
    return figure
