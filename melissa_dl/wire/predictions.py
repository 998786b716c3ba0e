"""Predictions on the wire: one frame a question, one frame an answer (docs/how-to/use-the-model.md).

A simulation asks a server rank's prediction service (:mod:`melissa_dl.serving.online`) over a DEALER socket;
the rank's ROUTER answers each request on the same connection. Both are one ZeroMQ frame::

    <u32 little-endian: header bytes> <header: JSON> <each array's bytes, C order, in the header's order>

A request's header is ``{"id": 7, "arrays": [["parameters", "float32", [n, 2]], ...]}``: ``n`` questions, one
array per input the module declares (``TrainingModule.prediction_inputs``), each ``[n, *shape]``. An answer's is
``{"id": 7, "status": "answered", "version": 1200, "arrays": [["output", "float32", [n, 16]]]}`` (``version``: the
batches the model was trained to), ``{"id": 7, "status": "no_model"}`` (nothing trained yet) or ``{"id": 7,
"status": "refused", "kind": "shape", "error": "..."}``. One frame bounds what a request may make a rank hold:
the socket's cap (:func:`request_bytes`) ends a larger one's connection before it is read whole.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from melissa_dl.config.limits import DTYPES, MAX_NDIM
from melissa_dl.errors import ProtocolError
from melissa_dl.wire.protocol import decode_json, encode_json, quote

HEADER_BYTES = 4096  # the most a header may take: a name and a shape per input
SERVING_FILE = "serving.json"  # what ``melissa-server --serve`` publishes in the output folder for its clients
_LENGTH = struct.Struct("<I")

Inputs = Mapping[str, tuple[str, tuple[int, ...]]]  # name -> dtype and shape of one question


@dataclass(frozen=True)
class Prediction:
    """The answer to ``Client.predict``: ``status`` is ``answered`` (``outputs`` by name, ``[n, ...]`` each, from
    the model trained to ``version`` batches), ``no_model`` (the study has trained nothing yet) or ``no_answer``
    (none within the deadline). True only when answered, so that ``if prediction:`` chooses the model."""

    status: str
    version: int = 0
    outputs: dict[str, np.ndarray] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.status == "answered"


def request_bytes(inputs: Inputs, max_questions: int) -> int:
    """The largest request of ``max_questions`` questions: the prediction socket's message cap."""
    per_question = sum(math.prod(shape) * np.dtype(dtype).itemsize for dtype, shape in inputs.values())
    return _LENGTH.size + HEADER_BYTES + max_questions * per_question


def pack(header: dict[str, Any], arrays: Mapping[str, np.ndarray]) -> bytes:
    """One frame: ``header`` with the arrays' names, dtypes and shapes, then their bytes."""
    described = {**header, "arrays": [[name, a.dtype.name, list(a.shape)] for name, a in arrays.items()]}
    text = encode_json(described)
    return b"".join([_LENGTH.pack(len(text)), text, *(np.ascontiguousarray(a).tobytes() for a in arrays.values())])


def unpack(frame: bytes | memoryview, what: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """A frame's header and arrays (views of ``frame``), or a ProtocolError whose ``kind`` says what was wrong."""
    view = memoryview(frame)
    if len(view) < _LENGTH.size:
        raise ProtocolError(f"{what}: a frame of {len(view)} bytes", "malformed")
    (length,) = _LENGTH.unpack_from(view)
    if length > min(HEADER_BYTES, len(view) - _LENGTH.size):
        raise ProtocolError(f"{what}: a header of {length} bytes in a frame of {len(view)}", "malformed")
    header = decode_json(view[_LENGTH.size : _LENGTH.size + length], what)
    described = header.get("arrays") if isinstance(header, dict) else None
    if not isinstance(described, list) or type(header.get("id")) is not int:
        raise ProtocolError(f"{what}: the header needs an integer id and a list of arrays", "malformed")
    arrays, offset = {}, _LENGTH.size + length
    for entry in described:
        name, dtype, shape = _described(entry, what)
        size = math.prod(shape) * np.dtype(dtype).itemsize
        if name in arrays or offset + size > len(view):
            raise ProtocolError(f"{what}: array {quote(name)} repeated or beyond the frame's end", "malformed")
        arrays[name] = np.frombuffer(view, dtype, math.prod(shape), offset).reshape(shape)
        offset += size
    if offset != len(view):
        raise ProtocolError(f"{what}: {len(view) - offset} bytes after the arrays the header describes", "malformed")
    return header, arrays


def _described(entry: Any, what: str) -> tuple[str, str, tuple[int, ...]]:
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[0], str) and entry[1] in DTYPES):
        raise ProtocolError(f"{what}: array {quote(entry)} is not [name, dtype, shape]", "malformed")
    shape = entry[2]
    if not (
        isinstance(shape, list) and len(shape) <= MAX_NDIM and all(type(n) is int and 0 <= n < 1 << 32 for n in shape)
    ):
        raise ProtocolError(f"{what}: array {quote(entry[0])} has a bad shape {quote(shape)}", "malformed")
    return entry[0], entry[1], tuple(shape)


def count_questions(arrays: Mapping[str, np.ndarray], inputs: Inputs, max_questions: int, what: str) -> int:
    """How many questions ``arrays`` ask, checked against the declared ``inputs``: the same names, dtypes and
    shapes ``[n, *shape]`` with one ``n``, from 1 to ``max_questions``, and finite floats; a ProtocolError
    (``kind``: ``names``, ``dtype``, ``shape``, ``oversize``, ``non_finite``) otherwise."""
    if set(arrays) != set(inputs):
        raise ProtocolError(f"{what}: inputs {quote(sorted(arrays))}, the model's are {sorted(inputs)}", "names")
    counts = set()
    for name, (dtype, shape) in inputs.items():
        array = arrays[name]
        if array.dtype.name != dtype:
            raise ProtocolError(f"{what}: input '{name}' is {array.dtype.name}, the model's is {dtype}", "dtype")
        if array.ndim != len(shape) + 1 or tuple(array.shape[1:]) != tuple(shape):
            raise ProtocolError(
                f"{what}: input '{name}' is {list(array.shape)}, the model's is [n, {', '.join(map(str, shape))}]",
                "shape",
            )
        counts.add(array.shape[0])
    if len(counts) != 1:
        raise ProtocolError(f"{what}: the inputs ask {sorted(counts)} questions: one count for all", "shape")
    (n,) = counts
    if not 1 <= n <= max_questions:
        raise ProtocolError(f"{what}: {n} questions, a request asks 1 to serving.max_batch={max_questions}", "oversize")
    for name, array in arrays.items():
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            raise ProtocolError(f"{what}: input '{name}' holds NaN or infinity", "non_finite")
    return n


def described(inputs: Inputs) -> dict[str, list[Any]]:
    """``prediction_inputs`` as JSON carries them (``model.json``, the handshake, ``serving.json``)."""
    return {name: [dtype, list(shape)] for name, (dtype, shape) in inputs.items()}


def declared(inputs: Mapping[str, Sequence[Any]]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """``prediction_inputs`` as JSON carries them (a handshake's answer), back to dtypes and shape tuples."""
    return {name: (str(dtype), tuple(int(n) for n in shape)) for name, (dtype, shape) in inputs.items()}
