"""The default picture of a module at each validation (``TrainingModule.plot``): its prediction of a held-out
sample beside the sample's field, where the sample holds what ``predict`` is asked with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from melissa_dl.buffers.sample import Sample
from melissa_dl.train.module import TrainingModule, take_logged


class Doubler(TrainingModule):
    """``u = 2 * parameters[0] + time_step`` everywhere on a 3 x 4 grid, and on a line of 5."""

    prediction_inputs = {"parameters": ("float32", (2,)), "time_step": ("float32", ())}

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))

    def configure_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def process(self, sample: Sample) -> Any:
        return sample

    def training_step(self, batch: Any) -> torch.Tensor:
        return self.scale

    def predict(self, inputs: Mapping[str, torch.Tensor]) -> Mapping[str, torch.Tensor]:
        value = self.scale * inputs["parameters"][:, 0] + inputs["time_step"]
        return {"u": value[:, None, None].expand(-1, 3, 4), "line": value[:, None].expand(-1, 5), "other": value}


def sample(**fields: np.ndarray) -> Sample:
    return Sample(1, 4, np.array([1.5, 0.0]), fields)


def test_a_2d_and_a_1d_field_are_drawn_beside_the_prediction() -> None:
    figure = Doubler().plot(sample(u=np.full((3, 4), 7.0, np.float32), line=np.zeros(5, np.float32)))
    assert figure is not None
    rows = figure.subfigs
    assert [len(row.axes) for row in rows] == [6, 1]  # three images with their colour bars; one plot
    images = [axes.get_images()[0].get_array() for axes in rows[0].axes if axes.get_images()]
    assert [float(np.mean(image)) for image in images] == [7.0, 7.0, 0.0]  # truth, 2 x 1.5 + 4, their difference
    assert [line.get_ydata()[0] for line in rows[1].axes[0].get_lines()] == [0.0, 7.0]


def test_no_picture_where_the_sample_lacks_an_input_or_no_output_is_a_field_of_its_shape() -> None:
    assert Doubler().plot(Sample(1, 4, np.array([1.5]), {"u": np.zeros((3, 4), np.float32)})) is None
    assert Doubler().plot(sample(u=np.zeros((4, 3), np.float32))) is None  # another shape
    assert Doubler().plot(sample(other=np.zeros(1, np.float32))) is None  # a 0-d output: no field of one or two


def test_what_log_gathered_is_taken_once_as_its_means() -> None:
    module = Doubler()
    module.log("error", 1.0)
    module.log("error", torch.tensor(3.0))
    module.log("size", 5)
    assert take_logged(module) == {"module/error": 2.0, "module/size": 5.0}
    assert take_logged(module) == {}
