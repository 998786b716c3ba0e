"""Turning a rank's incoming frames into complete samples.

The assembler is the protocol's server side without the sockets: it checks
every frame against the study and the client's declaration, keeps the slices
of each ``(simulation, step)`` until all fields from all client ranks are in,
drops steps the ledger already holds, and tracks what each simulation
announced in its finalize messages. It raises ``ProtocolError`` for a bad
frame and is otherwise unaffected by it, so nothing already received is lost.
A single-rank client's field is a view on the received frame (no copy); slices
of MPI-parallel clients are concatenated along axis 0 in client-rank order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from melissa_dl.errors import ProtocolError
from melissa_dl.ledger import Ledger
from melissa_dl.protocol import (
    Header,
    check_layout,
    Kind,
    decode_json,
    owner_rank,
    payload_bytes,
    simulation_key,
    unpack_header,
)
from melissa_dl.sample import Sample

Layout = tuple[str, tuple[int, ...]]  # dtype and local shape of one field slice


@dataclass(frozen=True)
class StreamSpec:
    """What every rank knows about the study's data streams."""

    fields: Sequence[str]
    parameters: np.ndarray  # one row per simulation
    token: bytes
    server_rank: int
    server_size: int
    bind_simulation: bool = False
    time_steps: int | None = None
    max_message_bytes: int = 1 << 26
    reject_non_finite: bool = True

    @property
    def simulations(self) -> int:
        return len(self.parameters)


@dataclass
class _Stream:
    """One simulation as seen by this rank."""

    client_size: int
    layouts: dict[int, dict[int, Layout]] = field(default_factory=dict)  # client rank -> field -> layout
    finalized: dict[int, int] = field(default_factory=dict)  # client rank -> steps announced
    pending: dict[int, dict[tuple[int, int], np.ndarray]] = field(default_factory=dict)


@dataclass
class Progress:
    """A rank's view of one simulation, as reported to rank 0."""

    received: int
    expected: int | None  # None until every client rank has finalized


class Assembler:
    def __init__(self, spec: StreamSpec) -> None:
        self.spec = spec
        self.ledger = Ledger()
        self.duplicates = 0
        self.bytes_received = 0
        self._streams: dict[int, _Stream] = {}
        self._keys = [simulation_key(spec.token, s) for s in range(spec.simulations)]
        self._changed: set[int] = set()

    # -- frames ---------------------------------------------------------------

    def handle(self, frames: Sequence[bytes | memoryview]) -> Sample | None:
        """Process one message; return the sample it completes, if any."""
        if len(frames) != 2:
            raise ProtocolError(f"message of {len(frames)} frames instead of 2", "malformed")
        header = unpack_header(frames[0])
        payload = frames[1]
        sim = header.simulation_id
        if sim >= self.spec.simulations:
            raise ProtocolError(f"simulation {sim} is not in the study", "unknown_simulation")
        if header.key != self._keys[sim]:
            raise ProtocolError(f"simulation {sim}: bad credentials", "credentials")
        if header.payload_bytes != len(payload):
            raise ProtocolError(
                f"simulation {sim}: payload of {len(payload)} bytes, header says {header.payload_bytes}", "malformed"
            )
        self._changed.add(sim)
        if header.kind is Kind.DECLARE:
            self._declare(header, decode_json(payload, f"simulation {sim} declaration"))
            return None
        if header.kind is Kind.FINALIZE:
            self._finalize(header, decode_json(payload, f"simulation {sim} finalize"))
            return None
        return self._data(header, payload)

    def _declare(self, header: Header, body: object) -> None:
        sim, crank, csize = header.simulation_id, header.client_rank, header.client_size
        fields = body.get("fields") if isinstance(body, dict) else None
        if not isinstance(fields, dict):
            raise ProtocolError(f"simulation {sim}: declaration without fields", "malformed")
        layouts = {}
        for fid, name in enumerate(self.spec.fields):
            decl = fields.get(name)
            if decl is None:
                raise ProtocolError(f"simulation {sim}: field '{name}' not declared", "unknown_field")
            layouts[fid] = check_layout(f"simulation {sim}, field '{name}'", decl, self.spec.max_message_bytes)
        unknown = set(fields) - set(self.spec.fields)
        if unknown:
            raise ProtocolError(f"simulation {sim}: unknown field '{sorted(unknown)[0]}'", "unknown_field")
        stream = self._streams.get(sim)
        if stream is None or stream.client_size != csize:  # first contact, or a relaunch with another size
            stream = self._streams[sim] = _Stream(csize)
        for fid, (dtype, shape) in layouts.items():
            for other_rank, other in stream.layouts.items():
                odtype, oshape = other[fid]
                if other_rank != crank and (odtype != dtype or oshape[1:] != shape[1:] or not shape or not oshape):
                    raise ProtocolError(
                        f"simulation {sim}, field '{self.spec.fields[fid]}': client rank {crank} declares "
                        f"{dtype}{list(shape)}, rank {other_rank} {odtype}{list(oshape)}: cannot be joined on axis 0",
                        "shape",
                    )
        stream.layouts[crank] = layouts
        stream.finalized.pop(crank, None)  # a relaunched attempt announces its steps anew

    def _finalize(self, header: Header, body: object) -> None:
        sim = header.simulation_id
        steps = body.get("steps") if isinstance(body, dict) else None
        if not isinstance(steps, int) or steps < 0:
            raise ProtocolError(f"simulation {sim}: bad finalize {body!r}", "malformed")
        stream = self._streams.get(sim)
        if stream is None or header.client_rank not in stream.layouts:
            raise ProtocolError(f"simulation {sim}: finalize from undeclared client rank", "undeclared")
        stream.finalized[header.client_rank] = steps

    def _data(self, header: Header, payload: bytes | memoryview) -> Sample | None:
        sim, step, crank, fid = header.simulation_id, header.time_step, header.client_rank, header.field_id
        spec = self.spec
        where = f"simulation {sim}, step {step}"
        if owner_rank(sim, step, spec.server_size, spec.bind_simulation) != spec.server_rank:
            raise ProtocolError(f"{where}: sent to rank {spec.server_rank}, not its owner", "routing")
        if spec.time_steps is not None and step >= spec.time_steps:
            raise ProtocolError(f"{where}: the study has {spec.time_steps} steps", "time_step")
        if fid >= len(spec.fields):
            raise ProtocolError(f"{where}: unknown field id {fid}", "unknown_field")
        name = spec.fields[fid]
        where += f", field '{name}', client rank {crank}"
        stream = self._streams.get(sim)
        if stream is None or crank not in stream.layouts or stream.client_size != header.client_size:
            raise ProtocolError(f"{where}: no declaration from this client rank", "undeclared")
        dtype, shape = stream.layouts[crank][fid]
        if header.dtype != dtype:
            raise ProtocolError(f"{where}: dtype {header.dtype}, declared {dtype}", "dtype")
        if header.shape != shape:
            raise ProtocolError(f"{where}: shape {list(header.shape)}, declared {list(shape)}", "shape")
        if len(payload) != payload_bytes(dtype, shape):
            raise ProtocolError(f"{where}: payload of {len(payload)} bytes for {dtype}{list(shape)}", "malformed")
        if (sim, step) in self.ledger:
            self.duplicates += 1
            return None
        array = np.frombuffer(payload, dtype=dtype).reshape(shape)
        if spec.reject_non_finite and array.dtype.kind == "f" and not np.isfinite(array).all():
            raise ProtocolError(f"{where}: NaN or infinite values", "non_finite")
        pending = stream.pending.setdefault(step, {})
        pending[(fid, crank)] = array
        self.bytes_received += len(payload)
        if len(pending) < len(spec.fields) * stream.client_size:
            return None
        del stream.pending[step]
        return Sample(sim, step, spec.parameters[sim], self._join(pending, stream.client_size))

    def _join(self, pending: dict[tuple[int, int], np.ndarray], client_size: int) -> dict[str, np.ndarray]:
        if client_size == 1:
            return {name: pending[(fid, 0)] for fid, name in enumerate(self.spec.fields)}
        return {
            name: np.concatenate([pending[(fid, r)] for r in range(client_size)])
            for fid, name in enumerate(self.spec.fields)
        }

    def commit(self, sample: Sample) -> None:
        """Record a sample once the buffer has taken it."""
        self.ledger.add(sample.simulation_id, sample.time_step)
        self._changed.add(sample.simulation_id)

    def restore(self, ledger: Ledger, bytes_received: int) -> None:
        """Continue from a checkpoint: its steps count as received and will be dropped on arrival."""
        self.ledger = ledger
        self.bytes_received = bytes_received
        self._changed.update(ledger.simulations())

    # -- bookkeeping ----------------------------------------------------------

    def take_progress(self) -> dict[int, Progress]:
        """Progress of the simulations that saw any frame since the last call."""
        changed, self._changed = self._changed, set()
        return {s: self.progress(s) for s in changed}

    def progress(self, sim: int) -> Progress:
        stream = self._streams.get(sim)
        expected = None
        if stream is not None and len(stream.finalized) == stream.client_size:
            expected = max(stream.finalized.values())
        return Progress(self.ledger.count(sim), expected)
