"""The dense step in shards or replicated, under ``mpirun -n 1``, ``-n 2`` and ``-n 3``, through MPI and gloo.

Every rank trains on its own batches; each test compares with one model,
trained here on every rank's batches at once, whose loss is the mean of the
ranks' losses (docs/explanation/design.md#training-across-ranks).
"""

from __future__ import annotations

import copy

import pytest
import torch
from mpi4py import MPI
from torch import nn

from melissa_dl.runtime.collectives import Collectives
from melissa_dl.train.data_parallel import ReplicatedStep, ShardedStep, make_data_parallel

pytestmark = pytest.mark.timeout(120)

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda params: torch.optim.Adam(params, lr=0.05),
    "adamw_fused": lambda params: torch.optim.AdamW(params, lr=0.05, fused=True),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=0.01, momentum=0.5),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
}


@pytest.fixture(params=["mpi", "gloo"])
def coll(request: pytest.FixtureRequest) -> Collectives:
    return request.getfixturevalue(request.param)


def _model() -> nn.Module:
    """Odd sizes: 35, 7, 7 and 1 elements, the last fewer than the ranks; the middle one unused on rank 1."""
    torch.manual_seed(0)
    return nn.ModuleDict({"a": nn.Linear(5, 7), "b": nn.Linear(7, 7), "c": nn.Linear(7, 1)})


def _loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank + 1000 * step)
    size = 4 + 3 * rank  # sizes differ by rank: the mean of means matters
    x, y = torch.randn(size, 5, generator=generator), torch.randn(size, 1, generator=generator)
    hidden = torch.tanh(model["a"](x))
    if rank != 1:
        hidden = torch.tanh(model["b"](hidden))
    return nn.functional.mse_loss(model["c"](hidden), y)


def _train(model: nn.Module, parallel: ShardedStep | ReplicatedStep, rank: int, steps: range) -> None:
    for step in steps:
        parallel.zero_grad()
        parallel.backward(_loss(model, rank, step))
        parallel.step()


def _reference(
    name: str, size: int, steps: range, model: nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One model trained on the mean of every rank's loss."""
    model = model or _model()
    optimizer = optimizer or OPTIMIZERS[name](model.parameters())
    for step in steps:
        optimizer.zero_grad()
        torch.stack([_loss(model, r, step) for r in range(size)]).mean().backward()
        optimizer.step()
    return model, optimizer


def _assert_same_everywhere(model: nn.Module, comm: MPI.Comm) -> None:
    mine = [p.detach().clone() for p in model.parameters()]
    for theirs in comm.allgather(mine):
        for a, b in zip(mine, theirs):
            assert torch.equal(a, b)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
@pytest.mark.parametrize("small_bytes", [0, 64, 1 << 20])  # every parameter alone, a mix, every one packed
def test_sharded_ranks_train_like_one_model_on_the_mean_loss(
    coll: Collectives, comm: MPI.Comm, name: str, small_bytes: int
) -> None:
    model = _model()
    parallel = ShardedStep(model, OPTIMIZERS[name](model.parameters()), coll, small_bytes=small_bytes)
    assert len(parallel.large) == {0: 6, 64: 2, 1 << 20: 0}[small_bytes]
    _train(model, parallel, coll.rank, range(3))
    reference, _ = _reference(name, coll.size, range(3))
    for trained, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(trained, expected, atol=1e-6, rtol=0)
    _assert_same_everywhere(model, comm)
    assert not parallel.optimizer.state  # the user's optimizer holds no state: each rank's is 1/K of it


def test_the_sharded_step_is_picked_for_an_element_wise_optimizer_on_several_ranks(coll: Collectives) -> None:
    model = _model()
    adam = make_data_parallel(model, torch.optim.Adam(model.parameters()), coll)
    assert isinstance(adam, ShardedStep if coll.size > 1 else ReplicatedStep)

    class Mine(torch.optim.Adam):
        pass

    scalar = nn.ParameterDict({"t": nn.Parameter(torch.tensor(1.0))})
    for module, optimizer in [
        (model, torch.optim.LBFGS(model.parameters())),
        (model, Mine(model.parameters())),
        (scalar, torch.optim.Adam(scalar.parameters())),
        (model["a"], torch.optim.Adam(model.parameters())),
    ]:
        assert isinstance(make_data_parallel(module, optimizer, coll), ReplicatedStep)


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_a_sharded_state_is_the_whole_optimizers_and_resumes_sharded_or_replicated(
    coll: Collectives, comm: MPI.Comm, name: str
) -> None:
    """The state a checkpoint holds is what one optimizer over whole parameters holds; a run continues from it
    in shards or replicated, and from a replicated run's state in shards."""
    model = _model()
    parallel = ShardedStep(model, OPTIMIZERS[name](model.parameters()), coll, small_bytes=64)
    _train(model, parallel, coll.rank, range(2))
    state = parallel.state_dict()
    assert (state is None) == (coll.rank != 0)
    state = comm.bcast(state)
    reference, reference_optimizer = _reference(name, coll.size, range(2))
    expected = copy.deepcopy(reference_optimizer.state_dict())
    assert state["param_groups"] == expected["param_groups"]
    assert state["state"].keys() == expected["state"].keys()
    for i, entry in expected["state"].items():
        assert state["state"][i].keys() == entry.keys()
        for key, value in entry.items():
            torch.testing.assert_close(state["state"][i][key], value, atol=1e-6, rtol=0)
    _reference(name, coll.size, range(2, 4), reference, reference_optimizer)

    for make, source in [(ShardedStep, state), (ReplicatedStep, state), (ShardedStep, expected)]:
        resumed = copy.deepcopy(model)
        optimizer = OPTIMIZERS[name](resumed.parameters())
        step = (
            ShardedStep(resumed, optimizer, coll, small_bytes=64)
            if make is ShardedStep
            else ReplicatedStep(resumed, optimizer, coll)
        )
        step.load_state_dict(copy.deepcopy(source))
        _train(resumed, step, coll.rank, range(2, 4))
        for trained, wanted in zip(resumed.parameters(), reference.parameters()):
            torch.testing.assert_close(trained, wanted, atol=1e-6, rtol=0)


def test_a_learning_rate_set_on_the_users_optimizer_takes_effect(coll: Collectives) -> None:
    """A schedule changes the user's optimizer's param_groups: the shards step with them."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    parallel = ShardedStep(model, optimizer, coll)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.param_groups[0]["lr"] = 0.0
    _train(model, parallel, coll.rank, range(1))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    optimizer.param_groups[0]["lr"] = 0.1
    _train(model, parallel, coll.rank, range(1, 2))
    assert not torch.equal(model["a"].weight, before[0])


@pytest.mark.parametrize("small_bytes", [0, 1 << 20])
def test_frozen_parameters_stay_put_and_gradients_outside_the_optimizer_are_dropped(
    coll: Collectives, comm: MPI.Comm, small_bytes: int
) -> None:
    """A frozen layer in the optimizer is skipped (as torch's AdamW skips it, weight decay included); a trained
    layer left out of the optimizer keeps no gradient from one step to the next."""
    model = _model()
    model["a"].requires_grad_(False)
    optimizer = torch.optim.AdamW([*model["a"].parameters(), *model["b"].parameters()], lr=0.1)
    parallel = ShardedStep(model, optimizer, coll, small_bytes=small_bytes)
    frozen = [p.detach().clone() for p in model["a"].parameters()]
    _train(model, parallel, coll.rank, range(2))
    assert all(torch.equal(p, f) for p, f in zip(model["a"].parameters(), frozen))
    assert all(p.grad is not None for p in model["c"].parameters())  # from the last step only
    parallel.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    reference = _model()
    reference["a"].requires_grad_(False)
    _reference(
        "adamw",
        coll.size,
        range(2),
        reference,
        torch.optim.AdamW([*reference["a"].parameters(), *reference["b"].parameters()], lr=0.1),
    )
    for trained, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(trained, expected, atol=1e-6, rtol=0)
    state = comm.bcast(parallel.state_dict())
    assert sorted(state["state"]) == [2, 3]  # b's weight and bias: a's never stepped
