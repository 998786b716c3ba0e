"""A small TrainingModule for the toy simulations of the integration tests."""

from __future__ import annotations

import logging
import os
import time

import numpy as np
import torch
from torch import nn

from melissa_dl import Sample, TrainingModule

CHATTY = logging.getLogger("chatty_library")  # a third-party library that logs at INFO


class Tiny(TrainingModule):
    """Predicts toy_sim's field (its value is ``1000 s + t``) from the parameters and t.

    ``fail_rank``/``fail_after`` make ``training_step`` raise on one rank, to
    test that a user's error ends the whole job; ``step_delay`` makes training
    slower than the simulations; ``hidden`` makes its checkpoints larger;
    ``stall_rank`` makes that rank's ``validation_samples`` (called before
    training) create the file ``stall_marker`` and sleep for a minute;
    ``hold_until`` holds the first training step until that file exists (the
    buffers fill and the simulations block meanwhile). Only the first 32
    values of a field are learnt, so that simulations may send large fields.
    """

    def __init__(
        self,
        fail_rank: int = -1,
        fail_after: int = 3,
        step_delay: float = 0.0,
        hidden: int = 16,
        stall_rank: int = -1,
        stall_marker: str = "",
        hold_until: str = "",
    ) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, hidden), nn.Tanh(), nn.Linear(hidden, 32))
        self.fail_rank, self.fail_after, self.step_delay = fail_rank, fail_after, step_delay
        self.stall_rank, self.stall_marker = stall_rank, stall_marker
        self.hold_until = hold_until
        self.steps = 0
        CHATTY.info("chatty_library: an INFO line the server's log should not show")
        CHATTY.warning("chatty_library: a WARNING it should")

    def configure_optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-2)

    def process(self, sample: Sample) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor([*sample.parameters, sample.time_step / 10], dtype=torch.float32)
        return x, torch.from_numpy(sample.fields["field"]).flatten()[:32] / 1000

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.steps += 1
        if self.rank == self.fail_rank and self.steps > self.fail_after:
            raise ValueError("boom from the user's training_step")
        time.sleep(self.step_delay)
        while self.hold_until and not os.path.exists(self.hold_until):
            time.sleep(0.05)
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_samples(self) -> list[Sample]:
        if self.rank == self.stall_rank:
            open(self.stall_marker, "w").close()
            time.sleep(60)
        return [
            Sample(s, t, np.array([0.5, 0.5]), {"field": np.full((4, 8), s * 1000 + t, np.float32)})
            for s in range(2)
            for t in range(5)
        ]


class Hardness(Tiny):
    """Tiny, with each sample's loss, as an adaptive sampler sees it, its simulation's first parameter squared:
    the same whatever the model and whenever it is trained, so that what the sampler draws can be compared
    between a study run in one go and one killed and resumed."""

    def sample_losses(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return batch[0][:, 0] ** 2


class StudyValidated(Tiny):
    """Tiny validated on the study's held-out simulations alone (``study.validation``), which it refuses to be
    trained on: a training batch holding a sample of one of the ``held_out`` parameter sets raises."""

    def __init__(self, held_out: list[list[float]], **options: float) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.held_out = torch.tensor(held_out, dtype=torch.float32)

    def validation_samples(self) -> list[Sample]:
        return []

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        parameters = batch[0][:, None, :2]
        if (parameters == self.held_out[None]).all(dim=2).any():
            raise AssertionError("trained on a held-out simulation's sample")
        return super().training_step(batch)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)


class Pictured(Tiny):
    """Tiny, asked as a surrogate is (``parameters`` and ``time_step`` in, the 4 x 8 ``field`` out), logging
    its targets' mean from every step: what TensorBoard shows of a module."""

    prediction_inputs = {"parameters": ("float64", (2,)), "time_step": ("int64", ())}

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        self.log("target_mean", batch[1].mean())
        return super().training_step(batch)

    def predict(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        x = torch.cat([inputs["parameters"].float(), inputs["time_step"].float()[:, None] / 10], 1)
        return {"field": self.net(x).reshape(-1, 4, 8) * 1000}
