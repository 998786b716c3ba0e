"""How the ranks' replicas of the dense parameters stay one model: the gradient of the mean loss, one step.

Picked once per run by ``make_data_parallel``:

- ``ShardedStep`` (ZeRO stage 1): each rank sums only its 1/K of every
  gradient (a reduce-scatter), steps the optimizer on that 1/K of every
  parameter, and the ranks then gather the updated parameters (an
  all-gather). The bytes moved are those of an all-reduce; the optimizer's
  work and state per rank are 1/K of them, and the replicas are identical by
  construction. On 2 ranks sharing 2 cores it took the server's step of a
  10 MB MLP with Adam from 1.18-1.19x a single process's to 1.01-1.03x
  (``bench/step_overhead.py``). It needs an optimizer that treats each
  element alone (the torch ones in ``ELEMENTWISE``, exactly those classes),
  whose parameters are dense modules' contiguous tensors of one dimension or
  more.
- ``ReplicatedStep``: the gradients averaged everywhere
  (``GradientAverager``) and every rank steps the whole optimizer: on one
  rank, and for any other optimizer (L-BFGS, a factored one, a subclass, a
  user's own).

Either way the optimizer's state in a checkpoint is the user's optimizer's
over whole parameters, so a run resumes under the other way or on another
number of ranks.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Protocol

import torch
from torch import nn

from melissa_dl.runtime.collectives import Collectives, GradientAverager, Started, dense_grad

logger = logging.getLogger(__name__)

ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.RMSprop,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.Rprop,
)


class DataParallel(Protocol):
    """One training step's work on the dense parameters, after the forward pass."""

    state_is_copy: bool  # whether state_dict's tensors are new CPU ones, or the optimizer's (changed by the next step)

    def zero_grad(self) -> None: ...

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of this rank's loss, and whatever the step then needs of the other ranks' gradients."""

    def step(self) -> None:
        """The optimizer's step: every rank's parameters are the same after it."""

    def state_dict(self) -> dict[str, Any] | None:
        """The user's optimizer's state over whole parameters, on rank 0 (None elsewhere); every rank calls it."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (such a state, of any way and any number of ranks)."""


def make_data_parallel(module: nn.Module, optimizer: torch.optim.Optimizer, collectives: Collectives) -> DataParallel:
    """Sharded where it can be, replicated otherwise (and said which, once)."""
    refusal = _unshardable(module, optimizer, collectives.size)
    if refusal is None:
        parallel: DataParallel = ShardedStep(module, optimizer, collectives)
        how = f"sharded: each of the {collectives.size} ranks steps 1/{collectives.size} of every parameter"
    else:
        parallel = ReplicatedStep(module, optimizer, collectives)
        how = f"replicated on every rank ({refusal})"
    if collectives.rank == 0:
        logger.info("optimizer %s %s", type(optimizer).__name__, how)
    return parallel


def _unshardable(module: nn.Module, optimizer: torch.optim.Optimizer, size: int) -> str | None:
    """Why the optimizer cannot be stepped in shards, or None."""
    if size == 1:
        return "one rank"
    if type(optimizer) not in ELEMENTWISE:
        return f"not one of the element-wise {', '.join(cls.__name__ for cls in ELEMENTWISE)}"
    own = {id(p) for p in module.parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if len({id(p) for p in params}) != len(params) or not {id(p) for p in params} <= own:
        return "its parameters are not the module's, each once"
    if any(p.ndim == 0 or not p.is_contiguous() or p.layout != torch.strided for p in params):
        return "a parameter is a scalar, sparse or not contiguous"
    return None


class ReplicatedStep:
    """Every rank averages every gradient and steps the whole optimizer."""

    state_is_copy = False

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, collectives: Collectives) -> None:
        self.optimizer = optimizer
        self.averager = GradientAverager(module.parameters(), collectives)

    def zero_grad(self) -> None:
        self.averager.zero_grad()

    def backward(self, loss: torch.Tensor) -> None:
        with self.averager.overlapping():
            loss.backward()
        self.averager.average()

    def step(self) -> None:
        self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


def _shard_grad(shard: nn.Parameter) -> torch.Tensor:
    assert shard.grad is not None, "a large parameter's shard has its gradient from the start"
    return shard.grad


class ShardedStep:
    """Each rank steps a copy of the user's optimizer on its piece of every parameter.

    A parameter of at least ``small_bytes`` is reduced and gathered alone;
    smaller ones go through one flat tensor per (device, dtype) laid out rank
    by rank (every parameter's piece 0, then every piece 1, ...), so that a
    reduce-scatter of it leaves each rank its pieces side by side, and a
    model of many small tensors costs two calls. A frozen parameter
    (``requires_grad`` false) is neither reduced nor gathered: its piece has
    no gradient, so the optimizer skips it, as torch's does.
    """

    state_is_copy = True

    def __init__(
        self, module: nn.Module, optimizer: torch.optim.Optimizer, collectives: Collectives, small_bytes: int = 1 << 20
    ) -> None:
        self.optimizer = optimizer  # the user's: it keeps the hyperparameters in force (a schedule sets them there)
        optimizer.state.clear()  # and never steps (Adagrad makes its state at once)
        self.collectives = collectives
        self.rank, self.size = collectives.rank, collectives.size
        self.trained = [p for p in module.parameters() if p.requires_grad]  # those whose gradients zero_grad drops
        self.params = [p for group in optimizer.param_groups for p in group["params"]]
        self.counts = [
            [p.numel() * (r + 1) // self.size - p.numel() * r // self.size for r in range(self.size)]
            for p in self.params
        ]
        self.spans = [(sum(c[: self.rank]), sum(c[: self.rank + 1])) for c in self.counts]
        self.shards = [nn.Parameter(p.detach().view(-1)[a:b]) for p, (a, b) in zip(self.params, self.spans)]
        stepped = [i for i, p in enumerate(self.params) if p.requires_grad]
        self.large = [i for i in stepped if self.params[i].numel() * self.params[i].element_size() >= small_bytes]
        for i in self.large:
            self.shards[i].grad = torch.empty_like(self.shards[i])
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i in stepped:
            if i not in self.large:
                groups.setdefault((self.params[i].device, self.params[i].dtype), []).append(i)
        self.packs = [_Pack(indices, self) for indices in groups.values()]
        shards = iter(self.shards)
        cls = type(optimizer)
        accepted = inspect.signature(cls).parameters
        self.shard_optimizer = cls(
            [
                {**_hyperparameters(group), "params": [next(shards) for _ in group["params"]]}
                for group in optimizer.param_groups
            ],
            **{key: value for key, value in optimizer.defaults.items() if key in accepted},
        )
        self._started: list[Started] = []

    def zero_grad(self) -> None:
        for p in self.trained:
            p.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        self._started = [
            self.collectives.start_reduce_scatter_sum(
                dense_grad(self.params[i]).view(-1), self.counts[i], _shard_grad(self.shards[i])
            )
            for i in self.large
        ]
        self._started += [pack.start_reduce() for pack in self.packs]

    def step(self) -> None:
        for reducing in self._started:
            reducing.wait()
        for i in self.large:
            _shard_grad(self.shards[i]).div_(self.size)
        for pack in self.packs:
            pack.own.div_(self.size)
        for mine, theirs in zip(self.shard_optimizer.param_groups, self.optimizer.param_groups):
            mine.update(_hyperparameters(theirs))
        self.shard_optimizer.step()
        started = [
            self.collectives.start_allgather_(self.params[i].detach().view(-1), self.counts[i]) for i in self.large
        ]
        started += [pack.start_gather() for pack in self.packs]
        for gathering in started:
            gathering.wait()
        for pack in self.packs:
            pack.unpack()

    def state_dict(self) -> dict[str, Any] | None:
        """Each piece's state gathered whole (its 1-D tensors; the scalars are the same on every rank), one
        tensor at a time, so that no rank holds more than one whole tensor at once but rank 0, which keeps them
        (on the CPU) to write them."""
        state: dict[int, dict[str, Any]] = {}
        for i, entry in self.shard_optimizer.state_dict()["state"].items():  # the same entries and keys everywhere
            kept = state.setdefault(i, {})
            for key, value in entry.items():
                if isinstance(value, torch.Tensor) and value.ndim == 1:
                    whole = value.new_empty(self.params[i].numel())
                    whole[slice(*self.spans[i])] = value
                    self.collectives.start_allgather_(whole, self.counts[i]).wait()
                    value = whole.view(self.params[i].shape)
                elif isinstance(value, torch.Tensor):
                    value = value.clone()  # the step counter: the next step adds to it in place
                if self.rank == 0:
                    kept[key] = value.cpu() if isinstance(value, torch.Tensor) else value
        if self.rank != 0:
            return None
        return {"state": state, "param_groups": self.optimizer.state_dict()["param_groups"]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's pieces of every whole-parameter tensor (torch's rule: any state but ``step`` shaped as
        its parameter follows it)."""
        self.optimizer.load_state_dict({"state": {}, "param_groups": state["param_groups"]})
        own = {
            i: {
                key: value.reshape(-1)[slice(*self.spans[i])].clone()
                if key != "step" and isinstance(value, torch.Tensor) and value.shape == self.params[i].shape
                else value
                for key, value in entry.items()
            }
            for i, entry in state["state"].items()
        }
        self.shard_optimizer.load_state_dict({"state": own, "param_groups": state["param_groups"]})


class _Pack:
    """Small parameters' gradients, then their data, in one flat tensor laid out rank by rank."""

    def __init__(self, indices: list[int], step: ShardedStep) -> None:
        self.collectives = step.collectives
        self.flat = step.params[indices[0]].new_empty(sum(step.params[i].numel() for i in indices))
        self.counts = [sum(step.counts[i][r] for i in indices) for r in range(step.size)]
        self.own = self.flat.new_empty(self.counts[step.rank])  # this rank's pieces, reduced
        # (parameter, its elements start:stop, their place in flat): the other ranks' pieces, and this rank's
        self.pieces: list[tuple[nn.Parameter, int, int, torch.Tensor]] = []
        self.mine: list[tuple[nn.Parameter, int, int, torch.Tensor]] = []
        offset = 0
        for r in range(step.size):
            for i in indices:
                start = sum(step.counts[i][:r])
                count = step.counts[i][r]
                piece = (step.params[i], start, start + count, self.flat[offset : offset + count])
                (self.mine if r == step.rank else self.pieces).append(piece)
                offset += count
        offset = 0
        for i in indices:  # the shards' gradients: views of the reduced pieces
            count = step.counts[i][step.rank]
            step.shards[i].grad = self.own[offset : offset + count]
            offset += count

    def start_reduce(self) -> Started:
        for p, start, stop, place in self.pieces + self.mine:
            place.copy_(dense_grad(p).view(-1)[start:stop])
        return self.collectives.start_reduce_scatter_sum(self.flat, self.counts, self.own)

    def start_gather(self) -> Started:
        for p, start, stop, place in self.mine:
            place.copy_(p.detach().view(-1)[start:stop])
        return self.collectives.start_allgather_(self.flat, self.counts)

    def unpack(self) -> None:
        for p, start, stop, place in self.pieces:
            p.detach().view(-1)[start:stop].copy_(place)


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in group.items() if key != "params"}
