"""Sparse optimizers of embedding shards against torch's and hand-written references."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from melissa_dl.embeddings.sparse_optim import (
    SGD,
    Adagrad,
    Adam,
    RowAdagrad,
    SparseOptimizer,
    make_sparse_optimizer,
)
from melissa_dl.errors import ConfigError

pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.filterwarnings("ignore:Sparse invariant checks"),
    pytest.mark.usefixtures("row_path"),
]

ROWS, DIM = 50, 8
# Repeated, overlapping, empty and disjoint row sets; row 40..49 is never touched.
STEPS = [[0, 3, 7, 10], [3, 7, 20, 21], [], [30, 31, 32], [0, 3, 39], [21, 10, 5]]
UNTOUCHED = torch.arange(40, ROWS)


def init_weight(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


def batches(seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.tensor(r, dtype=torch.int64), torch.randn(len(r), DIM, generator=gen)) for r in STEPS]


def sparse_grad(rows: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    return torch.sparse_coo_tensor(rows.unsqueeze(0), grads, (ROWS, DIM), check_invariants=True)


def run_torch(make: type[torch.optim.Optimizer], weight: torch.Tensor, **kw: float) -> list[torch.Tensor]:
    """Weights after each step of a torch optimizer fed the same sparse gradients."""
    param = nn.Parameter(weight.clone())
    opt = make([param], **kw)
    out = []
    for rows, grads in batches():
        param.grad = sparse_grad(rows, grads)
        opt.step()
        out.append(param.detach().clone())
    return out


def run_ours(opt: SparseOptimizer, weight: torch.Tensor) -> list[torch.Tensor]:
    opt.bind(weight)
    out = []
    for rows, grads in batches():
        opt.step(rows, grads)
        out.append(weight.clone())
    return out


def assert_steps_equal(ours: list[torch.Tensor], ref: list[torch.Tensor], init: torch.Tensor) -> None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        torch.testing.assert_close(a, b, msg=lambda m: f"step {i}: {m}")
        assert torch.equal(a[UNTOUCHED], init[UNTOUCHED]), "an untouched row changed"


def test_adam_matches_sparse_adam() -> None:
    init = init_weight()
    kw = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6}
    assert_steps_equal(run_ours(Adam(**kw), init.clone()), run_torch(torch.optim.SparseAdam, init, **kw), init)


def test_adam_moments_move_only_on_touched_rows() -> None:
    opt = Adam(0.1)
    weight = init_weight()
    run_ours(opt, weight)
    touched = torch.tensor(sorted({r for s in STEPS for r in s}))
    moments = opt.state_dict()["moments"]
    assert opt.state_dict()["step"] == len(STEPS)  # the empty step counts, as in SparseAdam
    assert (moments[touched].abs().amax(dim=(1, 2)) > 0).all()
    mask = torch.ones(ROWS, dtype=torch.bool)
    mask[touched] = False
    assert not moments[mask].any()


def test_adagrad_matches_torch_adagrad_with_sparse_grads() -> None:
    init = init_weight()
    ref = run_torch(torch.optim.Adagrad, init, lr=0.3, lr_decay=0.0, initial_accumulator_value=0.0, eps=1e-10)
    assert_steps_equal(run_ours(Adagrad(0.3), init.clone()), ref, init)


def test_sgd_matches_hand_reference() -> None:
    init, lr = init_weight(), 0.2
    ref, expected = init.clone(), []
    for rows, grads in batches():
        ref[rows] -= lr * grads
        expected.append(ref.clone())
    assert_steps_equal(run_ours(SGD(lr), init.clone()), expected, init)


def test_row_adagrad_matches_hand_reference() -> None:
    init, lr, eps = init_weight(), 0.5, 1e-10
    ref, acc, expected = init.double(), torch.zeros(ROWS, dtype=torch.float64), []
    for rows, grads in batches():
        g = grads.double()
        acc[rows] += (g**2).mean(dim=1)
        ref[rows] -= lr * g / (acc[rows].sqrt() + eps).unsqueeze(1)
        expected.append(ref.float())
    opt = RowAdagrad(lr, eps=eps)
    assert_steps_equal(run_ours(opt, init.clone()), expected, init)
    torch.testing.assert_close(opt.state_dict()["sum"], acc.float())


REPEATED = ([1, 5, 1, 1, 9, 5], [9, 9, 2], [5, 1, 7, 7, 7, 7], [3])


def test_repeated_ids_have_their_gradients_summed_as_sparse_adam_on_an_embedding() -> None:
    init = init_weight()
    emb = nn.Embedding(ROWS, DIM, sparse=True)
    with torch.no_grad():
        emb.weight.copy_(init)
    ref_opt = torch.optim.SparseAdam(emb.parameters(), lr=0.05)
    weight = init.clone()
    opt = make_sparse_optimizer("adam", 0.05)
    opt.bind(weight)
    gen = torch.Generator().manual_seed(2)
    for ids in REPEATED:
        ids_t = torch.tensor(ids)
        upstream = torch.randn(len(ids), DIM, generator=gen)
        ref_opt.zero_grad()
        (emb(ids_t) * upstream).sum().backward()
        ref_opt.step()
        assert opt.step(ids_t, upstream) == len(set(ids))
        torch.testing.assert_close(weight, emb.weight.detach())


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowadagrad", "adam"])
def test_repeated_ids_step_as_their_summed_gradient_once(name: str) -> None:
    repeated, summed = make_sparse_optimizer(name, 0.1), make_sparse_optimizer(name, 0.1)
    w_repeated, w_summed = init_weight(), init_weight()
    repeated.bind(w_repeated)
    summed.bind(w_summed)
    gen = torch.Generator().manual_seed(3)
    for ids in REPEATED:
        ids_t = torch.tensor(ids)
        grads = torch.randn(len(ids), DIM, generator=gen)
        before = grads.clone()
        unique, inverse = torch.unique(ids_t, return_inverse=True)
        summed_grads = torch.zeros(len(unique), DIM).index_add_(0, inverse, grads)
        assert repeated.step(ids_t, grads) == summed.step(unique, summed_grads) == len(unique)
        assert torch.equal(grads, before), "the gradients were modified"
        torch.testing.assert_close(w_repeated, w_summed, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowadagrad", "adam"])
def test_state_dict_round_trip_continues_identically(name: str) -> None:
    steps = batches()
    a, wa = make_sparse_optimizer(name, 0.1), init_weight()
    a.bind(wa)
    for rows, grads in steps[:3]:
        a.step(rows, grads)
    saved = copy.deepcopy(a.state_dict())  # live tensors: copy before training on
    b, wb = make_sparse_optimizer(name, 0.1), wa.clone()
    b.bind(wb)
    b.load_state_dict(saved)
    for rows, grads in steps[3:]:
        a.step(rows, grads)
        b.step(rows, grads)
    assert torch.equal(wa, wb)
    for key, value in a.state_dict().items():
        assert torch.equal(torch.as_tensor(value), torch.as_tensor(b.state_dict()[key])), key


def test_load_state_dict_rejects_a_mismatch() -> None:
    opt = Adagrad(0.1)
    opt.bind(init_weight())
    with pytest.raises(ValueError, match="keys"):
        opt.load_state_dict({"step": 1})
    with pytest.raises(ValueError, match="shape"):
        opt.load_state_dict({"step": 1, "sum": torch.zeros(ROWS + 1, DIM)})


def test_state_bytes_per_row() -> None:
    expected = {"sgd": 0, "adagrad": 256, "rowadagrad": 4, "adam": 512}
    for name, nbytes in expected.items():
        opt = make_sparse_optimizer(name, 0.1)
        opt.bind(torch.zeros(3, 64))
        assert opt.state_bytes_per_row == nbytes, name


def test_dtype_without_numpy_uses_index_copy() -> None:
    init = init_weight(dtype=torch.bfloat16)
    weight = init.clone()
    opt = SGD(0.5)
    opt.bind(weight)
    rows, grads = torch.tensor([4, 1]), torch.ones(2, DIM, dtype=torch.bfloat16)
    opt.step(rows, grads)
    expected = init.clone()
    expected[rows] -= 0.5
    assert torch.equal(weight, expected)


def test_factory_hyperparameters_and_errors() -> None:
    opt = make_sparse_optimizer("adam", 0.01, betas=[0.5, 0.6], eps=1e-4)
    assert isinstance(opt, Adam) and (opt.beta1, opt.beta2, opt.eps) == (0.5, 0.6, 1e-4)
    assert isinstance(make_sparse_optimizer("rowadagrad", 0.1, eps=1e-8), RowAdagrad)
    with pytest.raises(ConfigError, match="'adamw'"):
        make_sparse_optimizer("adamw", 0.01)
    with pytest.raises(ConfigError, match="'sgd'.*momentum"):
        make_sparse_optimizer("sgd", 0.01, momentum=0.9)
    with pytest.raises(ConfigError, match="'adam'.*betas"):
        make_sparse_optimizer("adam", 0.01, betas=(1.0, 0.9))
    with pytest.raises(ConfigError, match="learning rate"):
        make_sparse_optimizer("adagrad", -1.0)


@pytest.mark.parametrize("name", ["sgd", "adagrad", "rowadagrad", "adam"])
def test_rows_outside_the_shard_are_refused(name: str) -> None:
    opt = make_sparse_optimizer(name, 0.1)
    weight = init_weight()
    opt.bind(weight)
    for rows in ([3, ROWS], [-1, 2], [2**61, 3]):  # the last too large for the compiled path's packing
        with pytest.raises(IndexError):
            opt.step(torch.tensor(rows), torch.ones(2, DIM))
    assert torch.equal(weight, init_weight())
