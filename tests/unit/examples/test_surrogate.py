"""Unit tests of the heat-equation surrogate (examples/heat_pde/surrogate.py).

The example is what users copy and what the online demo trains, so its hooks
must produce what the server expects (float32 tensors of fixed shapes, a
scalar loss), it must actually learn the solver's fields, and its validation
set must be reproducible and held out from the study. Loaded with the
server's own ``load_module_class``, so the test also covers importing it by
path (its ``from solver import ...`` relies on that).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from launcher.samplers import SobolSampler
from melissa_dl.buffers.sample import Sample
from melissa_dl.train.module import TrainingModule, load_module_class

pytestmark = pytest.mark.timeout(60)

EXAMPLE_DIR = Path(__file__).resolve().parents[3] / "examples" / "heat_pde"
HeatSurrogate = load_module_class(EXAMPLE_DIR / "surrogate.py", "HeatSurrogate")
HeatSolver = __import__("solver").HeatSolver  # the example's folder is on sys.path now


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Small matrices train fastest on one thread, and a busy CI machine makes more threads slower still."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def simulate(parameters: np.ndarray, steps: int, nx: int = 32, ny: int = 32, first_id: int = 0) -> list[Sample]:
    samples = []
    for i, values in enumerate(parameters):
        solver = HeatSolver(values, nx, ny)
        samples += [Sample(first_id + i, t, values, {"temperature": solver.step()}) for t in range(steps)]
    return samples


def mean_loss(module: TrainingModule, samples: list[Sample]) -> float:
    with torch.no_grad():
        return float(module.validation_step(default_collate([module.process(s) for s in samples])))


def test_is_a_training_module_with_adam() -> None:
    module = HeatSurrogate(hidden=32, depth=2, lr=5e-4, nx=8, ny=6)
    assert isinstance(module, TrainingModule)
    optimizer = module.configure_optimizer()
    assert isinstance(optimizer, torch.optim.Adam)
    assert optimizer.param_groups[0]["lr"] == 5e-4 and optimizer.param_groups[0]["fused"]
    linears = [m for m in module.modules() if isinstance(m, torch.nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [(6, 32), (32, 32), (32, 48)]


def test_process_normalises_into_float32_tensors() -> None:
    module = HeatSurrogate(nx=8, ny=6, steps=10)
    parameters = np.array([100.0, 500.0, 300.0, 200.0, 400.0])
    field = np.linspace(100, 500, 48, dtype=np.float32).reshape(8, 6)
    # Received fields are read-only views of network frames: no copy warning, no error.
    frozen = np.frombuffer(field.tobytes(), dtype=np.float32).reshape(8, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        x, y = module.process(Sample(3, 5, parameters, {"temperature": frozen}))
    assert x.dtype == y.dtype == torch.float32
    assert x.shape == (6,) and y.shape == (48,)
    np.testing.assert_allclose(x.numpy(), [-1, 1, 0, -0.5, 0.5, 0.5], atol=1e-6)
    np.testing.assert_allclose(y.numpy(), (field.reshape(-1) - 300) / 100, atol=1e-6)


def test_a_diffusivity_range_adds_a_sixth_input_and_held_out_truth_uses_refine() -> None:
    module = HeatSurrogate(
        hidden=8, depth=1, nx=9, ny=7, steps=3, diffusivity=[0.5, 2.5], refine=2, validation_simulations=2
    )
    assert module.net[0].in_features == 7
    parameters = np.array([100.0, 500.0, 300.0, 200.0, 400.0, 2.0])
    x, _ = module.process(Sample(0, 0, parameters, {"temperature": np.zeros((9, 7), np.float32)}))
    np.testing.assert_allclose(x.numpy(), [-1, 1, 0, -0.5, 0.5, 0.5, 0], atol=1e-6)
    held_out = module.validation_samples()
    values = module.validation_parameters()
    assert values.shape == (2, 6) and np.all((values[:, 5] >= 0.5) & (values[:, 5] <= 2.5))
    solver = HeatSolver(values[0], 9, 7, refine=2)
    truth = [solver.step() for _ in range(3)]
    for t in range(3):
        np.testing.assert_array_equal(held_out[t].fields["temperature"], truth[t])


def test_training_step_on_a_collated_batch_is_a_scalar_with_gradients() -> None:
    module = HeatSurrogate(hidden=16, depth=1)
    samples = simulate(np.array([[150.0, 250, 350, 450, 200]]), steps=4)
    x, y = batch = default_collate([module.process(s) for s in samples])
    assert x.shape == (4, 6) and y.shape == (4, 32 * 32)
    loss = module.training_step(batch)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in module.parameters())


def test_predict_is_in_kelvin_on_the_grid() -> None:
    torch.manual_seed(0)
    module = HeatSurrogate(hidden=16, depth=1, nx=8, ny=6)
    torch.nn.init.zeros_(module.net[-1].weight)
    torch.nn.init.zeros_(module.net[-1].bias)
    parameters = torch.tensor([[100.0, 200, 300, 400, 500], [500, 400, 300, 200, 100]])
    with torch.no_grad():
        prediction = module.predict({"parameters": parameters, "time_step": torch.tensor([0.0, 7])})
    assert list(prediction) == ["temperature"] and prediction["temperature"].shape == (2, 8, 6)
    np.testing.assert_allclose(prediction["temperature"], 300.0)  # a zero output is the middle of the range


def test_a_few_hundred_steps_cut_the_held_out_loss_tenfold() -> None:
    torch.manual_seed(0)
    module = HeatSurrogate()
    train = simulate(SobolSampler([100.0] * 5, [500.0] * 5, 2026, 16).ask(16), steps=100)
    held_out = list(module.validation_samples())
    optimizer = module.configure_optimizer()
    rng = np.random.default_rng(0)
    before = mean_loss(module, held_out)
    for _ in range(300):
        picked = rng.choice(len(train), size=32, replace=False)
        loss = module.training_step(default_collate([module.process(train[i]) for i in picked]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    after = mean_loss(module, held_out)
    assert after < before / 10, (before, after)


def test_validation_samples_are_reproducible_whole_held_out_simulations() -> None:
    module = HeatSurrogate(steps=20, validation_simulations=3, validation_seed=7)
    samples = module.validation_samples()
    assert len(samples) == 3 * 20
    assert sorted({s.simulation_id for s in samples}) == [-3, -2, -1]  # never a study's id
    assert [s.time_step for s in samples if s.simulation_id == -1] == list(range(20))

    again = HeatSurrogate(steps=20, validation_simulations=3, validation_seed=7).validation_samples()
    for a, b in zip(samples, again, strict=True):
        assert (a.simulation_id, a.time_step) == (b.simulation_id, b.time_step)
        np.testing.assert_array_equal(a.parameters, b.parameters)
        np.testing.assert_array_equal(a.fields["temperature"], b.fields["temperature"])

    # They are the solver's own fields for their parameters.
    expected = simulate(samples[0].parameters[None], steps=20)
    np.testing.assert_array_equal(samples[19].fields["temperature"], expected[19].fields["temperature"])

    held_out = module.validation_parameters()
    assert np.all((held_out >= 100) & (held_out <= 500))
    study = SobolSampler([100.0] * 5, [500.0] * 5, 2026, 64).ask(64)
    assert not np.any(np.all(np.isclose(held_out[:, None, :], study[None, :, :]), axis=-1))
    other = HeatSurrogate(steps=20, validation_simulations=3, validation_seed=8).validation_parameters()
    assert not np.allclose(held_out, other)


def test_a_validation_cache_is_solved_once_then_read_back_per_problem(tmp_path: Path) -> None:
    options = {"steps": 5, "validation_simulations": 2, "validation_cache": str(tmp_path)}
    solved = HeatSurrogate(**options).validation_samples()
    [cached] = tmp_path.glob("solved-*.npy")
    np.save(cached, np.load(cached) + 1)  # from now on, what a run gets is what the file holds
    again = HeatSurrogate(**options).validation_samples()
    for a, b in zip(solved, again, strict=True):
        np.testing.assert_array_equal(a.fields["temperature"] + 1, b.fields["temperature"])
    uncached = HeatSurrogate(steps=5, validation_simulations=2).validation_samples()
    for a, b in zip(solved, uncached, strict=True):
        np.testing.assert_array_equal(a.fields["temperature"], b.fields["temperature"])
    HeatSurrogate(**options, refine=2).validation_samples()  # another problem: another file
    assert len(list(tmp_path.glob("solved-*.npy"))) == 2 and not list(tmp_path.glob("*.tmp"))
