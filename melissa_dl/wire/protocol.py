"""The wire protocol between simulation clients and the server (version 4).

Handshake: a client rank sends one JSON object to rank 0 over REQ/REP and gets
the data endpoints back, or a refusal saying why. Data: every message on the
PUSH/PULL data sockets has two frames, a fixed little-endian header and a raw
payload, so the server can check a frame before touching its bytes and view the
payload without copying it. Three message kinds share the header:

- ``DECLARE`` (payload: JSON of the client rank's fields) opens a client rank's
  stream on a server rank; ZeroMQ keeps one connection's messages in order, so
  it arrives before that rank's data.
- ``DATA`` (payload: the array's bytes) carries one field slice of one step,
  or, for a slice larger than ``PART_BYTES``, one part of it: the slice goes
  as consecutive messages of ``PART_BYTES`` (the last one shorter), each
  giving the slice's size and its own ``offset`` in it. Every server socket
  caps a message part at about ``PART_BYTES`` (ZeroMQ's ``ZMQ_MAXMSGSIZE``,
  which applies to the login too), so that a peer without the study's
  credentials can make a rank hold at most that much (:mod:`melissa_dl.wire.security`).
- ``FINALIZE`` (payload: JSON ``{"steps": n}``) tells the server rank how many
  distinct time steps the client rank sent to it.

Delivery: each server rank also answers questions on a socket of its own
(:mod:`melissa_dl.ingest.delivery`): how many of a client rank's messages it has
read, and that it lives. A finalizing client waits for those answers before it
closes, so a client that exits has lost nothing, however far behind the server
is; no server socket sends ZeroMQ heartbeats.

Frames carry the attempt (launch) number of the simulation and an 8-byte key,
an HMAC of the simulation id and attempt under the study's secret token, so
every rank can check a frame without asking rank 0 and refuse the frames of an
attempt that a newer one replaced.
"""

from __future__ import annotations

import functools
import hmac
import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, NamedTuple

import numpy as np

from melissa_dl.config.limits import DTYPES, MAX_NDIM
from melissa_dl.errors import ProtocolError

PROTOCOL_VERSION = 4
MAGIC = b"MLDL"
KEY_BYTES = 8
PART_BYTES = 1 << 20  # the most payload one DATA message carries: a larger slice goes in parts

QUOTE_CHARS = 200  # peer text quoted in refusals and logs is cut to this
MAX_KEEPALIVE = 5.0  # seconds: the longest a delivery service holds a question, and a blocked client's ping interval

Layout = tuple[str, tuple[int, ...]]  # dtype and shape of one field (slice)

DTYPE_CODES = {name: code for code, name in enumerate(DTYPES)}


class Kind(IntEnum):
    DATA = 1
    DECLARE = 2
    FINALIZE = 3


_KINDS = {kind.value: kind for kind in Kind}
_HEADER = struct.Struct(f"<4sHBB{KEY_BYTES}sIIIHHHB{MAX_NDIM}IQQ")
HEADER_BYTES = _HEADER.size


class Header(NamedTuple):
    kind: Kind
    key: bytes
    simulation_id: int
    attempt: int
    time_step: int
    client_rank: int
    client_size: int
    field_id: int
    dtype: str
    shape: tuple[int, ...]
    payload_bytes: int  # of the whole slice (a DATA message may carry one part of it)
    offset: int = 0  # of this message's payload in the slice

    def pack(self) -> bytes:
        ndim = len(self.shape)
        assert ndim <= MAX_NDIM
        dims = tuple(self.shape) + (0,) * (MAX_NDIM - ndim)
        return _HEADER.pack(
            MAGIC,
            PROTOCOL_VERSION,
            self.kind,
            DTYPE_CODES[self.dtype],
            self.key,
            self.simulation_id,
            self.attempt,
            self.time_step,
            self.client_rank,
            self.client_size,
            self.field_id,
            ndim,
            *dims,
            self.payload_bytes,
            self.offset,
        )


def unpack_header(buffer: bytes | memoryview) -> Header:
    """Decode a header frame; a ProtocolError's ``kind`` says what was wrong."""
    if len(buffer) != HEADER_BYTES:
        raise ProtocolError(f"header of {len(buffer)} bytes instead of {HEADER_BYTES}", "malformed")
    magic, version, kind, dtype, key, sim, attempt, step, crank, csize, fid, ndim, *rest = _HEADER.unpack(buffer)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}", "malformed")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {version}, server speaks {PROTOCOL_VERSION}", "version")
    known = _KINDS.get(kind)
    if known is None or dtype >= len(DTYPES) or ndim > MAX_NDIM:
        raise ProtocolError(f"kind {kind}, dtype code {dtype}, ndim {ndim}", "malformed")
    if crank >= csize:
        raise ProtocolError(f"client rank {crank} of {csize}", "malformed")
    return Header(
        known, key, sim, attempt, step, crank, csize, fid, DTYPES[dtype], tuple(rest[:ndim]), rest[-2], rest[-1]
    )


def parts(payload_bytes: int) -> range:
    """The offsets of the messages that carry a slice of ``payload_bytes`` (one for an empty slice)."""
    return range(0, max(payload_bytes, 1), PART_BYTES)


@functools.lru_cache(maxsize=4096)  # checked for every data frame
def simulation_key(token: bytes, simulation_id: int, attempt: int) -> bytes:
    """The per-attempt credential every data frame carries: HMAC-SHA256(token, sim LE32 || attempt LE32)[:8]."""
    message = simulation_id.to_bytes(4, "little") + attempt.to_bytes(4, "little")
    return hmac.digest(token, message, "sha256")[:KEY_BYTES]


def keepalive(client_timeout: float) -> float:
    """How long a server rank's delivery service may keep a client waiting for an answer, and how often a client
    blocked by back-pressure asks whether the rank lives: well inside ``client_timeout``, after which the client
    takes a silent rank for dead."""
    return min(MAX_KEEPALIVE, client_timeout / 4)


@dataclass(frozen=True)
class Route:
    """Which server ranks receive step ``time_step`` of a simulation.

    Steps go round-robin over the ``size`` ranks in runs of ``block`` consecutive steps (the owner of step t is
    ``(s + t // block) mod size``; a run of one step spreads a simulation's steps over every rank), or all to
    ``s mod size`` with ``bind_simulation``. With ``overlap``, each run's owner also receives the first
    ``overlap`` steps of the next run: windows of consecutive steps (``training.window``) then start and end on
    one rank without binding a simulation to it.
    """

    size: int
    bind_simulation: bool = False
    block: int = 1
    overlap: int = 0

    def owner(self, simulation_id: int, time_step: Any) -> Any:
        """The rank that owns the step (an int; for an array of steps, an array of ranks unless the simulation is
        bound to one)."""
        if self.bind_simulation:
            return simulation_id % self.size
        return (simulation_id + time_step // self.block) % self.size

    def ranks(self, simulation_id: int, time_step: int) -> tuple[int, ...]:
        """Every rank the step is sent to: its owner, then the previous run's owner when the step is in that
        run's overlap."""
        owner = self.owner(simulation_id, time_step)
        if self.bind_simulation or self.size == 1 or time_step < self.block or time_step % self.block >= self.overlap:
            return (owner,)
        return owner, (owner - 1) % self.size

    def holds(self, rank: int, simulation_id: int, steps: np.ndarray) -> np.ndarray:
        """Whether ``rank`` receives each of ``steps`` (an array)."""
        steps = np.asarray(steps, dtype=np.int64)
        held = np.broadcast_to(self.owner(simulation_id, steps) == rank, steps.shape)
        if self.bind_simulation or self.size == 1 or not self.overlap:
            return held
        copied = (steps >= self.block) & (steps % self.block < self.overlap)
        return held | (copied & ((simulation_id + steps // self.block - 1) % self.size == rank))

    def answer(self) -> dict[str, Any]:
        """What the handshake's answer tells a client of the routing."""
        return {"bind_simulation": self.bind_simulation, "block": self.block, "overlap": self.overlap}

    @classmethod
    def from_answer(cls, answer: dict[str, Any]) -> Route:
        """The routing a handshake's answer gives, over its ranks' endpoints."""
        return cls(
            len(answer["endpoints"]), bool(answer["bind_simulation"]), int(answer["block"]), int(answer["overlap"])
        )


def quote(value: Any) -> str:
    """A peer's value as it may appear in a refusal or a log line: repr, cut to ``QUOTE_CHARS``."""
    text = repr(value)
    return text if len(text) <= QUOTE_CHARS else f"{text[:QUOTE_CHARS]}... ({len(text)} characters)"


def describe(layout: Layout) -> str:
    dtype, shape = layout
    return f"{dtype}{list(shape)}"


def encode_json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_json(payload: bytes | memoryview, what: str) -> Any:
    """Decode a JSON payload; malformed text is the sender's fault, not ours."""
    try:
        return json.loads(bytes(payload))
    except (ValueError, RecursionError) as error:
        raise ProtocolError(f"{what}: invalid JSON ({quote(str(error))})", "malformed") from None


def integers(body: dict[str, Any], keys: Sequence[str]) -> list[int] | None:
    """The values of ``keys`` in a decoded JSON object if every one is an integer (not a bool or a float)."""
    values = [value for key in keys if type(value := body.get(key)) is int]
    return values if len(values) == len(keys) else None


@functools.lru_cache(maxsize=1024)  # asked again for every data frame: a study has a few layouts
def payload_bytes(dtype: str, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize  # Python ints: no overflow on absurd shapes


def check_layout(where: str, decl: Any, max_bytes: int) -> Layout:
    """Validate a declared ``[dtype, shape]`` of one field slice (or ``[dtype, shape, block]`` of a block,
    :mod:`melissa_dl.wire.blocks`); ``where`` names it."""
    if not (isinstance(decl, list) and len(decl) in (2, 3) and isinstance(decl[1], list)):
        raise ProtocolError(
            f"{where}: expected [dtype, shape] or [dtype, shape, block], got {quote(decl)}", "malformed"
        )
    dtype, shape = decl[:2]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ProtocolError(f"{where}: dtype {quote(dtype)} not in {DTYPES}", "dtype")
    if len(shape) > MAX_NDIM or not all(type(n) is int and 0 <= n < 1 << 32 for n in shape):
        raise ProtocolError(f"{where}: bad shape {quote(shape)}", "shape")
    size = payload_bytes(dtype, tuple(shape))
    if size > max_bytes:
        raise ProtocolError(f"{where}: {size} bytes per step exceed server.max_message_bytes={max_bytes}", "oversize")
    return dtype, tuple(shape)
