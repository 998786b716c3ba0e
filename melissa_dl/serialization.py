"""Serialisation of any state into bytes that can be written without a copy (checkpoints, DESIGN.md §7).

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


class _Pickler(cloudpickle.CloudPickler):
    """cloudpickle, with each plain CPU tensor reduced to a flat byte array that goes out of band."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided and not obj.is_quantized:
            tensor = obj.detach().cpu().contiguous()
            return _tensor, (tensor.reshape(-1).view(torch.uint8).numpy(), tensor.dtype, tuple(tensor.shape))
        return super().reducer_override(obj)


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
    return pickle.loads(pickled, buffers=buffers)
