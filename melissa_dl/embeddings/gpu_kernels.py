"""Whether a sparse optimizer's step runs as a Triton kernel (:mod:`melissa_dl.embeddings.gpu_loops`).

On a GPU, torch's path is some twenty small kernels and a host wait a step (``unique``'s size, the range check):
they, not memory, bound it. The Triton kernel sums each row's gradients and updates the row and its state in one
pass, with no host wait, and a step of a repeated size is replayed as a CUDA graph. It runs on CUDA shards of
float32, bfloat16 or float16 with float32 state, where Triton is installed (it comes with torch's CUDA wheels;
``pip install 'melissa-dl[gpu]'`` otherwise); elsewhere the torch path runs, and on a GPU it says so once in the
log.
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from types import ModuleType

logger = logging.getLogger(__name__)

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
on_cpu = False
"""True in tests only: CPU tensors take the kernel, which Triton's interpreter runs (``TRITON_INTERPRET=1`` set
before :func:`load`)."""


def fits(weight: torch.Tensor, *state: torch.Tensor) -> bool:
    """Whether a shard and its state are tensors the kernels take: contiguous on the GPU, the state float32."""
    device = "cpu" if on_cpu else "cuda"
    return (
        weight.device.type == device
        and weight.dtype in WEIGHT_DTYPES
        and weight.is_contiguous()
        and all(t.device == weight.device and t.dtype == torch.float32 and t.is_contiguous() for t in state)
    )


@functools.cache
def load() -> ModuleType | None:
    """The kernels' module, or None (said once) where Triton cannot be imported: the torch path runs instead."""
    try:
        from melissa_dl.embeddings import gpu_loops
    except ImportError:
        logger.warning(
            "Triton is not installed: the sparse optimizers on the GPU run torch's ops, several times slower "
            "(pip install 'melissa-dl[gpu]')"
        )
        return None
    return gpu_loops
