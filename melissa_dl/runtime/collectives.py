"""One small interface hiding which transport moves tensors between ranks.

- CPU tensors go through MPI itself: mpi4py works on the tensors' memory
  (``tensor.numpy()`` views, ``MPI.IN_PLACE`` all-reduce), with no copy and no
  second runtime. Measured on 2 ranks, an all-reduce of 1 MiB takes 0.19 ms
  through MPI against 2.4 ms through torch's gloo.
- CUDA tensors go through ``torch.distributed`` with NCCL, initialised from the
  MPI communicator: rank 0 picks a free TCP port and broadcasts ``host:port``.
  The same class runs with gloo on CPU tensors, which is how it is tested;
  gloo, like NCCL, implements ``all_to_all_single`` with uneven splits, so both
  share one all-to-all path.

``GradientAverager`` averages dense gradients (docs/explanation/design.md#training-across-ranks: the global loss is
the mean of the K per-rank losses).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from itertools import accumulate
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

from melissa_dl.runtime.mpi import Comm

logger = logging.getLogger(__name__)


class Collectives(ABC):
    """The tensor collectives the training loop needs; every rank calls each one."""

    rank: int
    size: int

    @abstractmethod
    def allreduce_sum_(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` (contiguous) over ranks, in place."""

    @abstractmethod
    def start_allreduce_sum_(self, tensor: torch.Tensor) -> Started:
        """Start summing ``tensor`` (contiguous) over ranks in place, apart from the other collectives: only
        the order of these reductions must be the same on every rank. Read ``tensor`` after ``wait()``."""

    @abstractmethod
    def start_reduce_scatter_sum(self, tensor: torch.Tensor, counts: list[int], out: torch.Tensor) -> Started:
        """Start summing ``tensor`` (contiguous, 1-D) over ranks into ``out``: only this rank's piece, the
        ``counts[rank]`` elements after the pieces of the ranks before it. Started as the reductions are."""

    @abstractmethod
    def start_allgather_(self, tensor: torch.Tensor, counts: list[int]) -> Started:
        """Start filling ``tensor`` (contiguous, 1-D) with every rank's piece of it, rank ``r``'s being the
        ``counts[r]`` elements after those of the ranks before it. Started as the reductions are."""

    @abstractmethod
    def alltoallv(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """Send ``send_counts[r]`` rows of ``send`` (in rank order) to rank ``r``.

        Returns the received rows concatenated in source-rank order, in a new
        tensor (the caller may change it in place), and how many came from
        each rank. A caller that knows those counts (a reply to an exchange,
        or a second exchange the same way) passes them as ``recv_counts``
        and saves the all-to-all of the counts; they must be what the other
        ranks send. Every rank calls it, even with no rows.
        """

    def close(self) -> None:
        """Release the transport."""

    def _check_alltoallv(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None) -> None:
        if len(send_counts) != self.size or min(send_counts) < 0 or sum(send_counts) != send.shape[0]:
            raise ValueError(
                f"alltoallv: send_counts {send_counts} must be {self.size} non-negative row counts "
                f"summing to the {send.shape[0]} rows of the send tensor"
            )
        if recv_counts is not None and (len(recv_counts) != self.size or min(recv_counts) < 0):
            raise ValueError(f"alltoallv: recv_counts {recv_counts} must be {self.size} non-negative row counts")
        if recv_counts is not None and recv_counts[self.rank] != send_counts[self.rank]:
            raise ValueError(
                f"alltoallv: recv_counts {recv_counts} expect {recv_counts[self.rank]} rows from this "
                f"rank {self.rank}, which sends itself {send_counts[self.rank]}"
            )
        _check_contiguous(send)


class Started(Protocol):
    """A reduction under way."""

    def test(self) -> bool:
        """Whether it is done; also moves it along (MPI progresses only inside its calls)."""

    def wait(self) -> None: ...


class _MpiStarted:
    def __init__(self, request: MPI.Request) -> None:
        self.request = request

    def test(self) -> bool:
        return bool(self.request.Test())

    def wait(self) -> None:
        self.request.Wait()


class _TorchStarted:
    def __init__(self, *works: Any) -> None:
        self.works = works

    def test(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class _Done:
    def test(self) -> bool:
        return True

    def wait(self) -> None:
        pass


class MpiCollectives(Collectives):
    """Collectives of mpi4py directly on CPU tensors' memory."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.rank = comm.rank
        self.size = comm.size
        self._reductions = comm.Dup()  # the started ones: their order is theirs alone

    def close(self) -> None:
        self._reductions.Free()

    def start_allreduce_sum_(self, tensor: torch.Tensor) -> Started:
        _check_contiguous(tensor)
        if tensor.dtype == torch.bfloat16:
            self.allreduce_sum_(tensor)
            return _Done()
        return _MpiStarted(self._reductions.Iallreduce(MPI.IN_PLACE, tensor.detach().numpy(), op=MPI.SUM))

    def start_reduce_scatter_sum(self, tensor: torch.Tensor, counts: list[int], out: torch.Tensor) -> Started:
        _check_contiguous(tensor)
        if tensor.dtype == torch.bfloat16:  # as in allreduce_sum_
            wide = out.float()
            self.comm.Reduce_scatter(tensor.detach().float().numpy(), wide.numpy(), recvcounts=counts, op=MPI.SUM)
            out.detach().copy_(wide)
            return _Done()
        return _MpiStarted(
            self._reductions.Ireduce_scatter(
                tensor.detach().numpy(), out.detach().numpy(), recvcounts=counts, op=MPI.SUM
            )
        )

    def start_allgather_(self, tensor: torch.Tensor, counts: list[int]) -> Started:
        _check_contiguous(tensor)
        size = tensor.element_size()
        return _MpiStarted(
            self._reductions.Iallgatherv(
                MPI.IN_PLACE, [_bytes(tensor.detach()), ([c * size for c in counts], None), MPI.BYTE]
            )
        )

    def allreduce_sum_(self, tensor: torch.Tensor) -> None:
        _check_contiguous(tensor)
        if tensor.dtype == torch.bfloat16:  # numpy and MPI have no bfloat16: reduce in float32
            wide = tensor.detach().float()
            self.comm.Allreduce(MPI.IN_PLACE, wide.numpy(), op=MPI.SUM)
            tensor.detach().copy_(wide)
        else:
            self.comm.Allreduce(MPI.IN_PLACE, tensor.detach().numpy(), op=MPI.SUM)

    def alltoallv(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        self._check_alltoallv(send, send_counts, recv_counts)
        if recv_counts is None:
            received = np.empty(self.size, np.int64)
            self.comm.Alltoall(np.array(send_counts, np.int64), received)
            recv_counts = received.tolist()
        recv = torch.empty((sum(recv_counts), *send.shape[1:]), dtype=send.dtype)
        # Moved as bytes, so that any dtype (bfloat16, bool) goes through.
        row_bytes = math.prod(send.shape[1:]) * send.element_size()
        outgoing, incoming = _bytes(send.detach()), _bytes(recv)
        (send_sizes, send_starts), (recv_sizes, recv_starts) = (
            _byte_layout(counts, row_bytes) for counts in (send_counts, recv_counts)
        )
        # This rank's own rows are copied here, not by MPI: MPICH's Alltoallv copies them at a fraction of memory
        # speed (on 2 ranks, 1 MiB each: 88 us with them, 48 us without them plus this copy).
        me = self.rank
        incoming[recv_starts[me] : recv_starts[me] + recv_sizes[me]] = outgoing[
            send_starts[me] : send_starts[me] + send_sizes[me]
        ]
        send_sizes[me] = recv_sizes[me] = 0
        self.comm.Alltoallv(
            [outgoing, (send_sizes, send_starts), MPI.BYTE], [incoming, (recv_sizes, recv_starts), MPI.BYTE]
        )
        return recv, recv_counts


class TorchCollectives(Collectives):
    """Collectives of ``torch.distributed`` (NCCL on GPUs, gloo in tests), set up from MPI.

    It owns the default process group, so only one instance lives at a time.
    """

    def __init__(self, comm: Comm, backend: str, device: torch.device) -> None:
        if dist.is_initialized():
            raise RuntimeError("torch.distributed is already initialised; close() the other TorchCollectives first")
        self.rank = comm.rank
        self.size = comm.size
        self.device = device
        host, port = _rendezvous_address(comm)
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.size,
            device_id=device if device.type == "cuda" else None,  # NCCL binds this GPU now, not at its first call
        )
        logger.info("torch.distributed %s initialised from MPI at %s:%d (%d ranks)", backend, host, port, self.size)

    def allreduce_sum_(self, tensor: torch.Tensor) -> None:
        _check_contiguous(tensor)
        dist.all_reduce(tensor.detach(), op=dist.ReduceOp.SUM)

    def start_allreduce_sum_(self, tensor: torch.Tensor) -> Started:
        _check_contiguous(tensor)
        return _TorchStarted(dist.all_reduce(tensor.detach(), op=dist.ReduceOp.SUM, async_op=True))

    def start_reduce_scatter_sum(self, tensor: torch.Tensor, counts: list[int], out: torch.Tensor) -> Started:
        _check_contiguous(tensor)
        return _TorchStarted(
            dist.reduce_scatter(out.detach(), list(tensor.detach().split(counts)), op=dist.ReduceOp.SUM, async_op=True)
        )

    def start_allgather_(self, tensor: torch.Tensor, counts: list[int]) -> Started:
        """One broadcast per rank's piece: gloo's all-gather takes only pieces of one size."""
        _check_contiguous(tensor)
        return _TorchStarted(
            *(
                dist.broadcast(piece, src=r, async_op=True)
                for r, piece in enumerate(tensor.detach().split(counts))
                if piece.numel()
            )
        )

    def alltoallv(
        self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        self._check_alltoallv(send, send_counts, recv_counts)
        if recv_counts is None:
            counts = torch.tensor(send_counts, dtype=torch.int64, device=self.device)
            received = torch.empty_like(counts)
            dist.all_to_all_single(received, counts)
            recv_counts = received.tolist()
        recv = torch.empty((sum(recv_counts), *send.shape[1:]), dtype=send.dtype, device=self.device)
        dist.all_to_all_single(recv, send.detach(), output_split_sizes=recv_counts, input_split_sizes=send_counts)
        return recv, recv_counts

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def make_collectives(comm: Comm, device: torch.device) -> Collectives:
    """NCCL for CUDA devices, MPI itself otherwise."""
    if device.type == "cuda":
        return TorchCollectives(comm, "nccl", device)
    return MpiCollectives(comm)


class GradientAverager:
    """Averages dense gradients over ranks: large ones where backward left them, small ones packed.

    Gradients start every step as ``None`` (``zero_grad``, as torch's own
    default), so backward stores each new gradient as it is made: no memset of
    old gradients, no add into them (on a 25 MB model that zeroing and adding
    cost 4.7 ms a step; ``bench/step_overhead.py``). A gradient of at least
    ``small_bytes`` is then reduced in place; smaller ones are copied into one
    flat tensor per (device, dtype), reduced with one call and handed back as
    views of it, so that a model of many small tensors costs few calls. A
    missing gradient (the parameter took no part in this rank's loss) counts as
    zeros, so that all ranks reduce the same tensors; every rank must pass the
    same model.

    Under ``overlapping()`` the large ones are reduced during backward, as DDP
    does: measured on 2 ranks sharing 2 cores (``bench/step_overhead.py``), the
    gain is small, since the reduction's copies need the same cores; with a
    free core or a GPU's own communication stream it hides behind backward.
    """

    def __init__(
        self, parameters: Iterable[nn.Parameter], collectives: Collectives, small_bytes: int = 1 << 20
    ) -> None:
        self.collectives = collectives
        unique = {id(p): p for p in parameters if p.requires_grad}
        self._params = list(unique.values())
        self.large = [p for p in self._params if p.numel() * p.element_size() >= small_bytes]
        groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for p in self._params:
            if p.numel() * p.element_size() < small_bytes:
                groups.setdefault((p.device, p.dtype), []).append(p)
        self.packs: list[tuple[torch.Tensor, list[nn.Parameter], list[torch.Tensor]]] = []
        for (device, dtype), params in groups.items():
            ends = list(accumulate(p.numel() for p in params))
            flat = torch.zeros(ends[-1], dtype=dtype, device=device)
            views = [flat[end - p.numel() : end].view(p.shape) for p, end in zip(params, ends)]
            self.packs.append((flat, params, views))
        logger.debug(
            "gradients: %d reduced in place, %d packed into %d flat tensors",
            len(self.large),
            len(self._params) - len(self.large),
            len(self.packs),
        )
        self.large.reverse()  # the order in which backward produces them, mostly: the order they are reduced in
        self._position = {id(p): i for i, p in enumerate(self.large)}
        self._ready = [False] * len(self.large)
        self._started: list[Started] = []
        self._overlapping = False
        for p in self.large:
            p.register_post_accumulate_grad_hook(self._produced)

    def zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    @contextlib.contextmanager
    def overlapping(self) -> Iterator[None]:
        """Around a step's one backward: each large gradient is divided and its reduction started as soon as
        backward has produced it and those before it in ``large`` (the same order on every rank, whatever
        parameter a rank did not use), while its bytes are still in cache and backward goes on."""
        self._overlapping = self.collectives.size > 1
        self._ready = [False] * len(self.large)
        try:
            yield
        finally:
            self._overlapping = False

    def _produced(self, p: nn.Parameter) -> None:
        if not self._overlapping or threading.current_thread() is not threading.main_thread():
            return  # a GPU's backward may run hooks in another thread: average() starts those
        self._ready[self._position[id(p)]] = True
        while len(self._started) < len(self.large) and self._ready[len(self._started)]:
            self._start(self.large[len(self._started)])
        for started in self._started:
            started.test()

    def _start(self, p: nn.Parameter) -> None:
        grad = dense_grad(p)
        grad.div_(self.collectives.size)
        self._started.append(self.collectives.start_allreduce_sum_(grad))

    def average(self) -> None:
        """Replace each gradient by its mean over ranks (the gradient of the mean loss)."""
        size = self.collectives.size
        if size > 1:
            for p in self.large[len(self._started) :]:
                self._start(p)
        reduced = [] if size > 1 else [dense_grad(p) for p in self.large]
        for flat, params, views in self.packs:
            for p, view in zip(params, views):
                if p.grad is None:
                    view.zero_()
                else:
                    view.copy_(dense_grad(p))
                p.grad = view
            reduced.append(flat)
        if size > 1:
            for tensor in reduced:
                self.collectives.allreduce_sum_(tensor)
                tensor.div_(size)
        for started in self._started:
            started.wait()
        self._started = []


def dense_grad(p: nn.Parameter) -> torch.Tensor:
    """``p.grad``, made zeros if missing and contiguous if not."""
    grad = p.grad
    if grad is not None and grad.layout != torch.strided:
        raise ValueError(
            f"GradientAverager: parameter of shape {tuple(p.shape)} has a sparse gradient; dense "
            "all-reduce cannot average it (use ShardedEmbedding, not nn.Embedding(sparse=True))"
        )
    if grad is None or not grad.is_contiguous():
        p.grad = grad = (
            torch.zeros_like(p, memory_format=torch.contiguous_format) if grad is None else grad.contiguous()
        )
    return grad


def _rendezvous_address(comm: Comm) -> tuple[str, int]:
    """Rank 0's address (``MASTER_ADDR`` if set, loopback on one host) and a free port it picked."""
    hosts = comm.allgather(socket.gethostname())
    address: tuple[str, int] | None = None
    if comm.rank == 0:
        host = os.environ.get("MASTER_ADDR") or (
            "127.0.0.1" if len(set(hosts)) == 1 else socket.gethostbyname(socket.gethostname())
        )
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind((host, 0))
            address = (host, probe.getsockname()[1])
    address = comm.bcast(address, root=0)
    assert address is not None
    return address


def _check_contiguous(tensor: torch.Tensor) -> None:
    if not tensor.is_contiguous():
        raise ValueError(f"collectives work on contiguous tensors; got strides {tensor.stride()}")


def _byte_layout(counts: list[int], row_bytes: int) -> tuple[list[int], list[int]]:
    """The bytes of each rank's piece of ``counts`` rows, and where each starts: packed in rank order."""
    sizes = [count * row_bytes for count in counts]
    return sizes, [0, *accumulate(sizes)][:-1]


def _bytes(tensor: torch.Tensor) -> Any:
    """The memory of a contiguous CPU tensor as a flat numpy uint8 view (no copy)."""
    return tensor.view(-1).view(torch.uint8).numpy()
