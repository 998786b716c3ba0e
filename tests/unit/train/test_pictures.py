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
from melissa_dl.train.pictures import GAP, PIXELS


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


def test_a_2d_field_is_an_image_of_truth_prediction_and_their_difference() -> None:
    """At every validation while the other ranks wait: an image array (a matplotlib figure took 160 ms)."""
    truth = np.full((3, 4), 7.0, np.float32)
    truth[0, 0] = 5.0  # a range for the colour scale: 5 to 7
    image = Doubler().plot(sample(u=truth))  # predicted: 2 x 1.5 + 4 = 7 everywhere
    assert isinstance(image, np.ndarray) and image.dtype == np.uint8
    zoom = PIXELS // 4  # the longer side, 4 cells, scaled up to PIXELS
    assert image.shape == (3 * zoom, 3 * 4 * zoom + 2 * GAP, 3)
    truth_panel, prediction_panel = image[:, : 4 * zoom], image[:, 4 * zoom + GAP : 8 * zoom + GAP]
    difference = image[:, 8 * zoom + 2 * GAP :]
    assert (truth_panel[zoom:, :] == prediction_panel[zoom:, :]).all()  # equal where the prediction is right
    assert not (truth_panel[0, 0] == prediction_panel[0, 0]).all()  # 5 against 7
    assert (image[:, 4 * zoom : 4 * zoom + GAP] == 255).all()  # the white gap
    red, green, blue = (int(c) for c in difference[0, 0])
    assert red > blue and all(c > 240 for c in difference[-1, -1])  # too high: red; right: white


def test_a_1d_field_is_a_figure_of_two_curves() -> None:
    figure = Doubler().plot(sample(line=np.zeros(5, np.float32)))
    assert figure is not None and not isinstance(figure, np.ndarray)
    assert [line.get_ydata()[0] for line in figure.axes[0].get_lines()] == [0.0, 7.0]


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
