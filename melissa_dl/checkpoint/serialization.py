"""Serialisation of any state into bytes that can be written without a copy
(checkpoints, docs/explanation/design.md#checkpoints).

Serialisation rule (``dumps``/``loads``): cloudpickle with pickle protocol
5, so that anything (buffers of numpy samples, lambdas, local classes) can be
saved, and with the bytes of every tensor and numpy array kept out of band:
``dumps`` returns the pickle plus views of those bytes, which the writer
hands to ``write`` as they are. No copy is made and the GIL is not held while
gigabytes move (``torch.save`` copies every storage into its archive under
the GIL, which stalls the training thread). ``loads`` unpickles, so only load
checkpoints you wrote.
"""

from __future__ import annotations

import io
import pickle
import struct
from typing import Any

import cloudpickle
import numpy as np
import torch

_MAGIC = b"MLDLCKP1"
_ALIGN = 64  # arrays start on cache lines, so that a loaded tensor is as aligned as a fresh one
MOVED = {
    "melissa_dl.allocator": "melissa_dl.runtime.allocator",
    "melissa_dl.assembly": "melissa_dl.ingest.assembly",
    "melissa_dl.buffers": "melissa_dl.buffers.kinds",
    "melissa_dl.checkpoint": "melissa_dl.checkpoint.versions",
    "melissa_dl.client": "melissa_dl.wire.client",
    "melissa_dl.collectives": "melissa_dl.runtime.collectives",
    "melissa_dl.connections": "melissa_dl.ingest.connections",
    "melissa_dl.data_parallel": "melissa_dl.train.data_parallel",
    "melissa_dl.dataset": "melissa_dl.train.dataset",
    "melissa_dl.delivery": "melissa_dl.ingest.delivery",
    "melissa_dl.embedding": "melissa_dl.embeddings.table",
    "melissa_dl.files": "melissa_dl.runtime.files",
    "melissa_dl.finite": "melissa_dl.ingest.finite",
    "melissa_dl.finite_loop": "melissa_dl.ingest.finite_loop",
    "melissa_dl.handshake": "melissa_dl.ingest.handshake",
    "melissa_dl.learning": "melissa_dl.study.learning",
    "melissa_dl.ledger": "melissa_dl.ingest.ledger",
    "melissa_dl.logs": "melissa_dl.runtime.logs",
    "melissa_dl.loop": "melissa_dl.train.loop",
    "melissa_dl.module": "melissa_dl.train.module",
    "melissa_dl.mpi": "melissa_dl.runtime.mpi",
    "melissa_dl.plots": "melissa_dl.study.plots",
    "melissa_dl.plugins": "melissa_dl.runtime.plugins",
    "melissa_dl.progress": "melissa_dl.study.progress",
    "melissa_dl.protocol": "melissa_dl.wire.protocol",
    "melissa_dl.receiver": "melissa_dl.ingest.receiver",
    "melissa_dl.recovery": "melissa_dl.checkpoint.recovery",
    "melissa_dl.rejections": "melissa_dl.wire.rejections",
    "melissa_dl.report": "melissa_dl.study.report",
    "melissa_dl.row_kernels": "melissa_dl.embeddings.row_kernels",
    "melissa_dl.row_loops": "melissa_dl.embeddings.row_loops",
    "melissa_dl.rows": "melissa_dl.buffers.rows",
    "melissa_dl.sample": "melissa_dl.buffers.sample",
    "melissa_dl.security": "melissa_dl.wire.security",
    "melissa_dl.serialization": "melissa_dl.checkpoint.serialization",
    "melissa_dl.snapshots": "melissa_dl.checkpoint.snapshots",
    "melissa_dl.sparse_optim": "melissa_dl.embeddings.sparse_optim",
    "melissa_dl.status": "melissa_dl.runtime.status",
    "melissa_dl.study": "melissa_dl.study.study",
    "melissa_dl.training": "melissa_dl.train.trainer",
    "melissa_dl.trial": "melissa_dl.study.trial",
}
"""Modules by their name before the package had wings: checkpoints written then name their classes so."""


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle, with each plain CPU tensor reduced to a flat byte array that goes out of band."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and not obj.is_quantized:
            tensor = obj.detach().cpu().contiguous()
            return _tensor, (tensor.reshape(-1).view(torch.uint8).numpy(), tensor.dtype, tuple(tensor.shape))
        return super().reducer_override(obj)


class _Unpickler(pickle.Unpickler):
    """pickle's, finding a class or function under its module's new name (``MOVED``)."""

    def find_class(self, module: str, name: str) -> Any:
        return super().find_class(MOVED.get(module, module), name)


def _tensor(data: np.ndarray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(data).view(dtype).reshape(shape)


def _align(offset: int) -> int:
    return -(-offset // _ALIGN) * _ALIGN


def dumps(obj: Any) -> list[memoryview]:
    """Serialise any state (see the module doc); the chunks view the state's arrays, so keep it unchanged until written.

    Layout: magic, buffer count, pickle length, each buffer's length, the
    pickle, then the buffers, each starting at a multiple of 64 bytes.
    """
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
    raws = [buffer.raw() for buffer in buffers]
    pickled = stream.getbuffer()
    header = _MAGIC + struct.pack(f"<QQ{len(raws)}Q", len(raws), pickled.nbytes, *(r.nbytes for r in raws))
    chunks = [memoryview(header), pickled]
    offset = len(header) + pickled.nbytes
    for raw in raws:
        padding = _align(offset) - offset
        chunks += [memoryview(bytes(padding)), raw]
        offset += padding + raw.nbytes
    return chunks


def loads(data: bytes | bytearray | memoryview) -> Any:
    """Inverse of ``dumps``; arrays and tensors view ``data`` (writable if ``data`` is, as ``Version.read``'s)."""
    view = memoryview(data).cast("B")
    if view[: len(_MAGIC)] != _MAGIC:
        raise ValueError("not a checkpoint serialisation (bad magic)")
    count, size = struct.unpack_from("<QQ", view, len(_MAGIC))
    lengths = struct.unpack_from(f"<{count}Q", view, len(_MAGIC) + 16)
    offset = len(_MAGIC) + 16 + 8 * count
    pickled, offset = view[offset : offset + size], offset + size
    buffers = []
    for length in lengths:
        offset = _align(offset)
        buffers.append(view[offset : offset + length])
        offset += length
    return _Unpickler(io.BytesIO(pickled), buffers=buffers).load()
