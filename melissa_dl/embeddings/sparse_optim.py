"""Optimizers for one rank's shard of a ``ShardedEmbedding`` table (docs/explanation/design.md#partitioned-embeddings).

The shard is a plain float tensor ``weight`` of shape ``[rows, dim]``; each
``step(ids, grads)`` updates only the rows a batch touched, from one
gradient per occurrence of an id. Gradients of an id that appears several times are
**summed** before its row is updated (as autograd, torch, PBG and FBGEMM do),
never averaged: the update is non-linear, so duplicates must be merged first.

On a CUDA shard, where Triton is installed, each optimizer's step is one
persistent Triton kernel over the ids sorted on the device (:mod:`melissa_dl.embeddings.gpu_loops`):
each row's gradients summed in float32 and the row and its state updated in
one pass, with no host wait; a step whose number of ids repeats is replayed
as a CUDA graph. On CPU the update is bound by random row access, not arithmetic. Where it
can (a CPU float32/float64 shard, numba installed), each optimizer runs one
compiled pass (:mod:`melissa_dl.embeddings.row_loops`) over the ids sorted with their
positions: it sums a repeated id's gradients as it reaches them and updates
the table row and its state where they lie. Elsewhere (GPUs, float16, no
numba) the ids are deduplicated and their gradients summed by torch
(``unique``, ``index_add_``), and every optimizer follows one torch pattern:
gather the touched rows of each tensor once (``index_select``), do the
per-row math in place on the gathered block, and write the block back once.
Optimizer state is row-aligned with the shard (first dimension = rows), so
it is sharded and checkpointed with it. No sparse COO tensor and no
``coalesce()`` is built.

The torch path, measured on torch 2.13, one thread, 4096 random 64-float rows
of a 1M-row table: the write-back through numpy's fancy assignment takes 66 us (cache-hot
rows) or 224 us (cold) against 164 or 324 us for ``index_copy_`` and 313 us
(hot) for ``index_add_``, hence ``_scatter``. ``torch.compile`` of gather +
math + write-back was left out: its Adam step took 2.6 ms against 1.1 ms
eager, after 32 s of compilation.

A new optimizer is a subclass with ``name`` and ``_update`` (torch ops
alone), in a file of its own, plus one line in ``SPARSE_OPTIMIZERS``; a
compiled loop (``_fused``) and a GPU kernel (``_gpu_fused``) are optional fast
paths, which tests hold to the torch path. A 16-bit table keeps its state in
float32 (``state_dtype``), and every path sums its gradients in float32.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from melissa_dl.config.registry import load
from melissa_dl.embeddings import gpu_kernels, row_kernels
from melissa_dl.errors import ConfigError

if TYPE_CHECKING:
    from types import ModuleType

_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)


def state_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype of an optimizer's state and of the summed gradients: float32 for a 16-bit table (a bfloat16
    accumulator stops growing), else the table's."""
    return torch.float32 if weight.element_size() < 4 else weight.dtype


def _scatter(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[rows] = src`` for unique ``rows``, through numpy on CPU (see the module docstring)."""
    if dst.device.type == "cpu" and dst.dtype in _NUMPY_DTYPES:
        dst.detach().numpy()[rows.numpy()] = src.numpy()
    else:
        dst.index_copy_(0, rows, src)


class SparseOptimizer(ABC):
    """Updates the touched rows of one shard; state is row-aligned with it."""

    name: ClassVar[str]

    def __init__(self, lr: float) -> None:
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"learning rate must be a finite number >= 0, got {lr}")
        self.lr = float(lr)
        self.step_count = 0
        self.weight: torch.Tensor | None = None
        self.state: dict[str, torch.Tensor] = {}
        self._compiled = False  # whether the shard and its state fit the compiled loops
        self._on_gpu = False  # whether they fit the GPU kernels
        self._graphs: Any = None  # the GPU steps' CUDA graphs (a gpu_loops.Graphs), made at the first
        self._step_size_on_device: torch.Tensor  # what the GPU kernels read, made by bind()

    def bind(self, weight: torch.Tensor) -> None:
        """Attach the shard and allocate its state (zeros: pages are only touched when used)."""
        assert self.weight is None, "bind() is called once"
        if weight.dim() != 2 or not weight.is_floating_point() or not weight.is_contiguous():
            raise ValueError(f"a shard is a contiguous 2-D float tensor, got {tuple(weight.shape)} {weight.dtype}")
        self.weight = weight
        self.state = self._new_state(weight)
        # the loops load at the first step
        self._compiled = self.has_fused_loop() and row_kernels.fits(weight, *self.state.values())
        self._on_gpu = self.has_gpu_loop() and gpu_kernels.fits(weight, *self.state.values())
        self._graphs = None  # a graph holds the addresses of the shard it was captured on
        self._step_size_on_device = weight.new_zeros((), dtype=torch.float64)

    def _new_state(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """The state tensors of a freshly bound shard (none by default)."""
        return {}

    def step(self, ids: torch.Tensor, grads: torch.Tensor) -> int | torch.Tensor:
        """Apply one update to the rows ``ids`` (1-D int64, repeats allowed) from their gradients ``grads``
        (``[len(ids), dim]``): the gradients of a repeated id are summed, then each distinct row is updated
        once. Returns how many rows were updated (from the GPU kernels a 0-d tensor on the device, so that the
        step does not wait for it; they skip an id outside the shard, which the torch path refuses)."""
        weight = self.weight
        assert weight is not None, "bind() before step()"
        assert ids.dtype == torch.int64 and ids.dim() == 1, "ids: 1-D int64"
        assert grads.shape == (len(ids), weight.shape[1]) and grads.dtype == weight.dtype, "grads: [len(ids), dim]"
        assert ids.device == grads.device == weight.device, "ids and grads on the shard's device"
        self.step_count += 1
        if not ids.numel():
            return 0
        ids, grads = ids.contiguous(), grads.detach().contiguous()
        if self._on_gpu and (loops := gpu_kernels.load()) is not None:
            if self._graphs is None:
                self._graphs = loops.Graphs()
            self._step_size_on_device.fill_(self._step_size())  # a kernel's argument: no copy, no wait
            return self._graphs.run(lambda i, g: self._gpu_fused(loops, i, g), ids, grads)
        kernels = row_kernels.load() if self._compiled else None
        # the compiled loops do not check their indices: rows outside the shard get no keys, and the torch path
        # refuses them
        keys = kernels.sorted_keys(ids, len(weight)) if kernels is not None else None
        if kernels is None or keys is None:
            return self._torch_step(weight, ids, grads)
        return self._fused(kernels, keys, grads.numpy())

    def _torch_step(self, weight: torch.Tensor, ids: torch.Tensor, grads: torch.Tensor) -> int:
        """The step by torch's ops: distinct rows, their summed gradients, then ``_update``."""
        rows, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        low, high = rows[[0, -1]].tolist()  # one wait for a GPU, not two
        if low < 0 or high >= len(weight):
            raise IndexError(f"{self.name}: rows {low}..{high} outside the {len(weight)} of the shard")
        dtype = state_dtype(weight)
        summed = grads.new_zeros((len(rows), grads.shape[1]), dtype=dtype).index_add_(0, inverse, grads.to(dtype))
        self._update(weight, rows, summed)
        return len(rows)

    @abstractmethod
    def _update(self, weight: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        """The per-row math of one non-empty step (``step_count`` already counts it) in torch ops, on distinct
        ``rows`` and their summed gradients."""

    def _fused(self, kernels: row_kernels.Kernels, keys: row_kernels.SortedKeys, grads: np.ndarray) -> int:
        """Optional fast path: the same update, gradients summed as it goes, by a compiled loop on ``_arrays()``;
        the rows it updated. An optimizer without one takes ``_update`` at every step."""
        # not reached: bind() enables the compiled loops only for a class that defines this (has_fused_loop)
        raise NotImplementedError(f"{self.name} has no compiled loop")

    @classmethod
    def has_fused_loop(cls) -> bool:
        """Whether the class has its own compiled loop (``_fused``)."""
        return cls._fused is not SparseOptimizer._fused

    def _gpu_fused(self, loops: ModuleType, ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        """Optional fast path on the GPU: the same update by ``gpu_loops.step``; the rows it updated, on the
        device. An optimizer without one takes ``_update`` there."""
        raise NotImplementedError(f"{self.name} has no GPU kernel")  # not reached: see has_gpu_loop

    def _step_size(self) -> float:
        """The learning rate of the step ``step_count``."""
        return self.lr

    @classmethod
    def has_gpu_loop(cls) -> bool:
        """Whether the class has its own GPU kernel (``_gpu_fused``)."""
        return cls._gpu_fused is not SparseOptimizer._gpu_fused

    def _arrays(self) -> list[np.ndarray]:
        """Numpy views of the shard and its state, made at each step: ``share_memory_()`` moves a tensor's memory
        and keeps the tensor, and a view made before would still point at the old memory."""
        assert self.weight is not None
        return [t.detach().numpy() for t in (self.weight, *self.state.values())]

    def state_dict(self) -> dict[str, Any]:
        """The step count and the live state tensors (not copies: copy them to save asynchronously)."""
        return {"step": self.step_count, **self.state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` of an optimizer of the same kind bound to a shard of the same shape."""
        assert self.weight is not None, "bind() before load_state_dict()"
        if set(state) != {"step", *self.state}:
            raise ValueError(f"{self.name} state has keys {sorted(self.state)} and 'step', got {sorted(state)}")
        for key, tensor in self.state.items():
            if tuple(state[key].shape) != tuple(tensor.shape):
                raise ValueError(
                    f"{self.name} state {key!r}: shape {tuple(state[key].shape)}, expected {tuple(tensor.shape)}"
                )
            tensor.copy_(state[key])
        self.step_count = int(state["step"])

    @property
    def state_bytes_per_row(self) -> int:
        """Bytes of optimizer state per row of the shard."""
        assert self.weight is not None, "bind() first"
        return sum(math.prod(t.shape[1:]) * t.element_size() for t in self.state.values())


class SGD(SparseOptimizer):
    """Plain SGD on the touched rows: ``w_r -= lr * g_r``. No state."""

    name = "sgd"

    def _update(self, weight: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        w = weight.index_select(0, rows)
        w.add_(grads, alpha=-self.lr)
        _scatter(weight, rows, w)

    def _fused(self, kernels: row_kernels.Kernels, keys: row_kernels.SortedKeys, grads: np.ndarray) -> int:
        (weight,) = self._arrays()
        return kernels.sgd(weight, keys, grads, self.lr)

    def _gpu_fused(self, loops: ModuleType, ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        return loops.step(loops.SGD, self.weight, None, ids, grads, self._step_size_on_device)


class Adagrad(SparseOptimizer):
    """Per-element Adagrad, as ``torch.optim.Adagrad`` with sparse gradients.

    ``G_rj += g_rj^2;  w_rj -= lr * g_rj / (sqrt(G_rj) + eps)`` on the touched
    rows (no learning-rate decay, initial accumulator 0). State: ``sum``
    ``[rows, dim]``, as many bytes as the table itself.
    """

    name = "adagrad"

    def __init__(self, lr: float, eps: float = 1e-10) -> None:
        super().__init__(lr)
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        self.eps = float(eps)

    def _new_state(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"sum": torch.zeros_like(weight, dtype=state_dtype(weight))}

    def _update(self, weight: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        acc = self.state["sum"].index_select(0, rows)
        acc.addcmul_(grads, grads)
        _scatter(self.state["sum"], rows, acc)
        step = acc.sqrt_().add_(self.eps)
        torch.div(grads, step, out=step)
        w = weight.index_select(0, rows)
        w.add_(step, alpha=-self.lr)
        _scatter(weight, rows, w)

    def _fused(self, kernels: row_kernels.Kernels, keys: row_kernels.SortedKeys, grads: np.ndarray) -> int:
        weight, total = self._arrays()
        return kernels.adagrad(weight, total, keys, grads, self.lr, self.eps)

    def _gpu_fused(self, loops: ModuleType, ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        size = self._step_size_on_device
        return loops.step(loops.ADAGRAD, self.weight, self.state["sum"], ids, grads, size, self.eps)


class RowAdagrad(Adagrad):
    """Adagrad with one accumulator per row, as in PyTorch-BigGraph.

    ``G_r += mean_j(g_rj^2);  w_r -= lr * g_r / (sqrt(G_r) + eps)``. State:
    ``sum`` ``[rows]``, 4 bytes a row for float32 instead of 256 for a 64-d row
    with per-element Adagrad; the update touches little more than the row.
    """

    name = "rowadagrad"  # shares Adagrad's hyperparameters, not its state or update

    def _new_state(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"sum": weight.new_zeros(weight.shape[0], dtype=state_dtype(weight))}

    def _update(self, weight: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        acc = self.state["sum"].index_select(0, rows)
        # sum_j g_rj^2 as a squared norm: one pass, no [n, dim] temporary (vecdot is 1.5x slower)
        acc.add_(torch.linalg.vector_norm(grads, dim=1).square_(), alpha=1.0 / grads.shape[1])
        _scatter(self.state["sum"], rows, acc)
        scale = acc.sqrt_().add_(self.eps).reciprocal_().mul_(-self.lr)
        w = weight.index_select(0, rows)
        w.addcmul_(grads, scale.unsqueeze(1))
        _scatter(weight, rows, w)

    def _fused(self, kernels: row_kernels.Kernels, keys: row_kernels.SortedKeys, grads: np.ndarray) -> int:
        weight, total = self._arrays()
        return kernels.row_adagrad(weight, total, keys, grads, self.lr, self.eps)

    def _gpu_fused(self, loops: ModuleType, ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        size = self._step_size_on_device
        return loops.step(loops.ROW_ADAGRAD, self.weight, self.state["sum"], ids, grads, size, self.eps)


class Adam(SparseOptimizer):
    """Lazy Adam, as ``torch.optim.SparseAdam``: only touched rows' moments move.

    With ``t`` the global step count (incremented by every ``step`` call, even
    an empty one, as SparseAdam does for a parameter with a gradient)::

        m_r += (1 - beta1) * (g_r - m_r);  v_r += (1 - beta2) * (g_r^2 - v_r)
        w_r -= lr * sqrt(1 - beta2^t) / (1 - beta1^t) * m_r / (sqrt(v_r) + eps)

    State: ``moments`` ``[rows, 2, dim]`` (``[:, 0]`` = m, ``[:, 1]`` = v),
    interleaved so that one gather and one write-back serve both moments.
    """

    name = "adam"

    def __init__(self, lr: float, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8) -> None:
        super().__init__(lr)
        beta1, beta2 = betas
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps}")
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)

    def _new_state(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"moments": weight.new_zeros(weight.shape[0], 2, weight.shape[1], dtype=state_dtype(weight))}

    def _update(self, weight: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> None:
        moments = self.state["moments"].index_select(0, rows)
        m, v = moments[:, 0], moments[:, 1]
        m.lerp_(grads, 1 - self.beta1)
        v.mul_(self.beta2).addcmul_(grads, grads, value=1 - self.beta2)
        _scatter(self.state["moments"], rows, moments)
        step = m.div_(v.sqrt_().add_(self.eps))  # the gathered block is written back: reuse it
        w = weight.index_select(0, rows)
        w.add_(step, alpha=-self._step_size())
        _scatter(weight, rows, w)

    def _fused(self, kernels: row_kernels.Kernels, keys: row_kernels.SortedKeys, grads: np.ndarray) -> int:
        weight, moments = self._arrays()
        return kernels.adam(weight, moments, keys, grads, self.beta1, self.beta2, self._step_size(), self.eps)

    def _gpu_fused(self, loops: ModuleType, ids: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
        assert self.weight is not None
        moments, size = self.state["moments"], self._step_size_on_device
        return loops.step(loops.ADAM, self.weight, moments, ids, grads, size, self.eps, self.beta1, self.beta2)

    def _step_size(self) -> float:
        """The learning rate with both moments' bias corrections at step ``t``."""
        t = self.step_count
        return self.lr * math.sqrt(1 - self.beta2**t) / (1 - self.beta1**t)


SPARSE_OPTIMIZERS = {
    "sgd": "melissa_dl.embeddings.sparse_optim:SGD",
    "adagrad": "melissa_dl.embeddings.sparse_optim:Adagrad",
    "rowadagrad": "melissa_dl.embeddings.sparse_optim:RowAdagrad",
    "adam": "melissa_dl.embeddings.sparse_optim:Adam",
}
"""The optimizers by name, as ``module:class`` (the class's ``name`` is its key)."""


def sparse_optimizer_class(name: str) -> type[SparseOptimizer]:
    """The class of the optimizer ``name``; a ``ConfigError`` naming the known ones if there is none."""
    if name not in SPARSE_OPTIMIZERS:
        raise ConfigError(f"unknown sparse optimizer {name!r}; expected one of {sorted(SPARSE_OPTIMIZERS)}")
    found: type[SparseOptimizer] = load(SPARSE_OPTIMIZERS, name, "sparse optimizer")
    return found


def make_sparse_optimizer(name: str, lr: float, **hyper: Any) -> SparseOptimizer:
    """The optimizer named in the config (a key of ``SPARSE_OPTIMIZERS``: ``sgd``, ``adagrad``, ``rowadagrad``,
    ``adam``)."""
    cls = sparse_optimizer_class(name)
    try:
        inspect.signature(cls).bind(lr, **hyper)
        return cls(lr, **hyper)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"sparse optimizer {name!r}: {e}") from e
