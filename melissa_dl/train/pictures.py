"""What TensorBoard shows of the model at each validation, by default: its prediction of a held-out sample beside
the sample's own fields (``TrainingModule.plot``).

A module's ``prediction_inputs`` are taken from the sample by name (``parameters``, ``time_step`` or a field's
name); each output named as a field of one or two dimensions and of its shape is drawn: a 1-D field as two curves,
a 2-D one as an image of three panels: truth and prediction on the truth's colour scale, their difference on one
centred on 0 (red: too high, blue: too low).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

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


PIXELS = 128  # a panel's smaller side is scaled up to at least this many pixels
GAP = 8  # white pixels between two panels


def prediction_against_truth(module: Predicting, sample: Sample) -> Figure | np.ndarray | None:
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


def _draw(pairs: list[tuple[str, np.ndarray, np.ndarray]], sample: Sample) -> Figure | np.ndarray:
    """2-D fields: an image array, a row per field (0.4 ms where a matplotlib figure took 160 ms, at every
    validation while the other ranks wait); 1-D ones: a figure of two curves each."""
    if all(truth.ndim == 2 for _, truth, _ in pairs):
        return _image([(truth, predicted) for _, truth, predicted in pairs])
    from matplotlib.figure import Figure  # no pyplot: no GUI backend, no global state

    figure = Figure(figsize=(10, 3.2 * len(pairs)), layout="constrained")
    for axes, (name, truth, predicted) in zip(figure.subplots(len(pairs), 1, squeeze=False)[:, 0], pairs):
        axes.set_title(f"'{name}', simulation {sample.simulation_id}, step {sample.time_step}")
        axes.plot(truth.ravel(), label="truth")
        axes.plot(predicted.ravel(), label="prediction", linestyle="--")
        axes.legend()
    return figure


def _image(pairs: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """``[H, W, 3]`` uint8: per field, truth | prediction (viridis on the truth's range) | their difference (red:
    too high, blue: too low, white: right, on a scale centred on 0), each at least ``PIXELS`` pixels a side."""
    from matplotlib import colormaps

    rows = []
    for truth, predicted in pairs:
        low, span = float(truth.min()), float(np.ptp(truth)) or 1.0
        difference = predicted - truth
        largest = float(np.abs(difference).max()) or 1.0
        panels = [colormaps["viridis"](np.clip((a - low) / span, 0, 1)) for a in (truth, predicted)]
        panels.append(colormaps["RdBu_r"](difference / largest / 2 + 0.5))
        zoom = max(1, PIXELS // max(truth.shape))
        panels = [np.kron(panel[..., :3], np.ones((zoom, zoom, 1))) for panel in panels]
        gap = np.ones((panels[0].shape[0], GAP, 3))
        rows.append(np.concatenate([panels[0], gap, panels[1], gap, panels[2]], axis=1))
    width = max(row.shape[1] for row in rows)
    padded = [np.pad(row, ((0, GAP), (0, width - row.shape[1]), (0, 0)), constant_values=1.0) for row in rows]
    return (np.concatenate(padded)[:-GAP] * 255).round().astype(np.uint8)
