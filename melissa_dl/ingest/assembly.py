"""Turning a rank's incoming frames into complete samples.

The assembler is the protocol's server side without the sockets: it checks
every frame against the study and the client's declaration, keeps the slices
of each ``(simulation, step)`` until all fields from all client ranks are in,
drops steps the ledger already holds, and tracks what each simulation
announced in its finalize messages. It raises ``ProtocolError`` for a bad
frame and is otherwise unaffected by it, so nothing already received is lost.

Everything a peer can make a rank hold here is bounded: pieces of incomplete
steps share a byte budget (``max_partial_bytes``; the oldest incomplete step
is evicted and counted as an ``incomplete`` refusal), a newer attempt of a
simulation drops its older attempt's pieces and refuses its later frames, and
a finished simulation's pieces are freed. A single-rank client's field of at
least ``COPY_FROM`` bytes is a view on the received frame (no copy); smaller
payloads are copied, because a view would pin the whole ZeroMQ receive chunk
it sits in and make the buffer's byte count a lie. A slice larger than
``PART_BYTES`` arrives in parts (:mod:`melissa_dl.wire.protocol`): its array is
allocated at the first part, counted in the budget from then on, and filled
part by part (each offset once). Slices of MPI-parallel
clients are concatenated along axis 0 in client-rank order once the step is
whole; blocks are written straight into their field's global array, made at
the step's first piece of the field and counted in the budget from then on
(:mod:`melissa_dl.wire.blocks`). Every assembled
field must match the study's pinned dtype and shape (from the configuration,
or from the first complete sample), so one odd simulation cannot break a batch.
"""

from __future__ import annotations

import functools
import hmac
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from melissa_dl.buffers.sample import Sample
from melissa_dl.errors import ProtocolError
from melissa_dl.ingest.finite import all_finite, prepare
from melissa_dl.ingest.ledger import Ledger
from melissa_dl.wire.blocks import Block, destination, joined, parse_block, write_flat
from melissa_dl.wire.protocol import (
    PART_BYTES,
    Header,
    Kind,
    Layout,
    Route,
    check_layout,
    decode_json,
    describe,
    parts,
    payload_bytes,
    quote,
    simulation_key,
    unpack_header,
)
from melissa_dl.wire.rejections import RejectionLog

if TYPE_CHECKING:
    from melissa_dl.config.sections import ServerConfig, StudyConfig, WindowConfig

COPY_FROM = 1 << 16  # smaller payloads are copied out of ZeroMQ's shared receive chunks


@dataclass(frozen=True)
class StreamSpec:
    """What every rank knows about the study's data streams."""

    fields: Sequence[str]
    parameters: np.ndarray  # one row per simulation, NaN until rank 0 has drawn it (``Receiver.follow``)
    token: bytes
    server_rank: int
    server_size: int
    bind_simulation: bool = False
    time_steps: int | None = None
    max_message_bytes: int = 1 << 26
    reject_non_finite: bool = True
    max_partial_bytes: int = 1 << 28
    layouts: Mapping[str, Layout] | None = None  # pinned dtype and whole shape per field, if configured
    trained: int | None = None  # the simulations trained on; those after them (held out for validation) are not
    block: int = 1  # consecutive steps routed to one rank (``Route``)
    overlap: int = 0  # steps of the next run its rank also receives: with windows, a window's length less one
    consecutive: bool = False  # windows of steps are trained: a simulation's steps must come in order, none skipped

    @property
    def simulations(self) -> int:
        return len(self.parameters)

    @functools.cached_property
    def route(self) -> Route:
        return Route(self.server_size, self.bind_simulation, self.block, self.overlap)

    def held_out(self, simulation: int) -> bool:
        """Whether ``simulation`` is one of the held-out ones (``study.validation``): its samples are not trained on."""
        return self.trained is not None and simulation >= self.trained

    @property
    def part_bytes(self) -> int:
        """The largest payload of one DATA message in this study (a larger slice comes in parts)."""
        return min(self.max_message_bytes, PART_BYTES)

    @classmethod
    def from_config(
        cls,
        server: ServerConfig,
        study: StudyConfig,
        parameters: np.ndarray,
        token: bytes,
        rank: int,
        size: int,
        window: WindowConfig | None = None,
    ) -> StreamSpec:
        """Rank ``rank`` of ``size``'s view of the study the ``server`` and ``study`` sections describe, its steps
        routed so that each ``window`` lies on one rank."""
        return cls(
            fields=study.field_names,
            parameters=parameters,
            token=token,
            server_rank=rank,
            server_size=size,
            bind_simulation=server.bind_simulation_to_server_rank,
            time_steps=study.time_steps,
            max_message_bytes=server.max_message_bytes,
            reject_non_finite=server.reject_non_finite,
            max_partial_bytes=server.max_partial_bytes,
            layouts=study.field_layouts,
            trained=study.simulations,
            consecutive=window is not None,
            **(window.routing if window is not None else {}),
        )


@dataclass
class _Parts:
    """A slice arriving in parts: its array, filled so far, and the offsets of the parts still missing."""

    array: np.ndarray
    missing: set[int]


@dataclass
class _Stream:
    """One simulation as seen by this rank."""

    client_size: int
    layouts: dict[int, dict[int, Layout]] = field(default_factory=dict)  # client rank -> field -> layout
    blocks: dict[int, dict[int, Block | None]] = field(default_factory=dict)  # client rank -> field -> its block
    finalized: dict[int, int] = field(default_factory=dict)  # client rank -> steps announced
    pending: dict[int, dict[tuple[int, int], np.ndarray]] = field(default_factory=dict)  # step -> whole pieces
    parts: dict[tuple[int, int, int], _Parts] = field(default_factory=dict)  # (step, field, client rank) -> a slice
    wholes: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # (step, field) -> its blocks' array

    def placed(self, block: Block | None) -> bool:
        """Whether a field declared in ``block``s is written into a global array as it comes (one rank's block in
        C order is the field itself: it is taken as it came, as a slice is)."""
        return block is not None and (self.client_size > 1 or block.order == "F")

    def drop_parts(self, step: int) -> int:
        """Forget the slices of ``step`` still arriving in parts and its blocks' arrays; returns how many slices
        there were."""
        keys = [key for key in self.parts if key[0] == step]
        for key in keys:
            del self.parts[key]
        for whole in [whole for whole in self.wholes if whole[0] == step]:
            del self.wholes[whole]
        return len(keys)


@dataclass(frozen=True, slots=True)
class Progress:
    """A rank's view of one simulation, as reported to rank 0 (immutable: the study shares the first one)."""

    received: int
    expected: int | None  # None until every client rank has finalized


@dataclass(frozen=True)
class Delivery:
    """How many messages of a client rank a server rank has read, and whether its FINALIZE was among them."""

    read: int
    finalized: bool
    ended: bool  # the simulation is done or failed, or this attempt was replaced: nothing more to deliver


class Assembler:
    def __init__(self, spec: StreamSpec, rejections: RejectionLog | None = None) -> None:
        self.spec = spec
        self.rejections = RejectionLog() if rejections is None else rejections
        self.ledger = Ledger()
        self.duplicates = 0
        self.copies = 0  # steps of the ledger that another rank owns (windows: the next block's first steps)
        self.bytes_received = 0
        self.partial_bytes = 0
        self._streams: dict[int, _Stream] = {}
        self._attempts: dict[int, int] = {}  # simulation -> newest attempt seen or announced
        self._finished: set[int] = set()
        self._partial: OrderedDict[tuple[int, int], int] = OrderedDict()  # (simulation, step) -> bytes, oldest first
        self._pins: dict[int, tuple[np.dtype, tuple[int, ...]]] = {  # dtype objects: their names are slow to get
            fid: (np.dtype(spec.layouts[name][0]), spec.layouts[name][1])
            for fid, name in enumerate(spec.fields)
            if spec.layouts and name in spec.layouts
        }
        self._changed: set[int] = set()
        self._read: dict[int, dict[int, int]] = {}  # running simulation -> client rank -> its attempt's messages read
        self._refused: dict[int, tuple[str, str]] = {}  # simulation -> kind and message of its first refused frame

    # -- frames ---------------------------------------------------------------

    def handle(self, frames: Sequence[bytes | memoryview]) -> Sample | None:
        """Process one message; return the sample it completes, if any."""
        if len(frames) != 2:
            raise ProtocolError(f"message of {len(frames)} frames instead of 2", "malformed")
        header = unpack_header(frames[0])
        payload = frames[1]
        sim, attempt = header.simulation_id, header.attempt
        if sim >= self.spec.simulations:
            raise ProtocolError(f"simulation {sim} is not in the study", "unknown_simulation")
        if not hmac.compare_digest(header.key, simulation_key(self.spec.token, sim, attempt)):
            raise ProtocolError(f"simulation {sim}: bad credentials", "credentials")
        if len(payload) != _part_bytes(header):
            raise ProtocolError(
                f"simulation {sim}: payload of {len(payload)} bytes at offset {header.offset}, header "
                f"says {header.payload_bytes} in all",
                "malformed",
            )
        if sim in self._finished:
            raise ProtocolError(f"simulation {sim} is already done or failed", "finished")
        current = self._attempts.get(sim, 0)
        if attempt < current:
            raise ProtocolError(
                f"simulation {sim}: frame of attempt {attempt}, replaced by attempt {current}", "stale_attempt"
            )
        if attempt > current:
            self.start_attempt(sim, attempt)
        read = self._read.setdefault(sim, {})
        read[header.client_rank] = read.get(header.client_rank, 0) + 1
        self._changed.add(sim)
        try:
            if header.kind is Kind.DECLARE:
                self._declare(header, decode_json(payload, f"simulation {sim} declaration"))
                return None
            if header.kind is Kind.FINALIZE:
                self._finalize(header, decode_json(payload, f"simulation {sim} finalize"))
                return None
            return self._data(header, payload)
        except ProtocolError as error:  # a frame of the running attempt, with its credentials: its failure says so
            self._refused.setdefault(sim, (error.kind, str(error)))
            raise

    def _declare(self, header: Header, body: object) -> None:
        sim, crank, csize = header.simulation_id, header.client_rank, header.client_size
        if np.isnan(self.spec.parameters[sim]).any():  # the study launches a simulation after every rank has them
            raise ProtocolError(f"simulation {sim}: not launched yet (no parameters)", "unknown_simulation")
        fields = body.get("fields") if isinstance(body, dict) else None
        if not isinstance(fields, dict):
            raise ProtocolError(f"simulation {sim}: declaration without fields", "malformed")
        layouts, blocks = {}, {}
        for fid, name in enumerate(self.spec.fields):
            decl = fields.get(name)
            if decl is None:
                raise ProtocolError(f"simulation {sim}: field '{name}' not declared", "unknown_field")
            where = f"simulation {sim}, field '{name}'"
            layouts[fid] = check_layout(where, decl, self.spec.max_message_bytes)
            blocks[fid] = parse_block(where, decl, layouts[fid][1], self.spec.max_partial_bytes)
            if self.spec.reject_non_finite:
                prepare(*layouts[fid])
        unknown = set(fields) - set(self.spec.fields)
        if unknown:
            raise ProtocolError(f"simulation {sim}: unknown field {quote(sorted(unknown)[0])}", "unknown_field")
        stream = self._streams.get(sim)
        if stream is None or stream.client_size != csize:  # first contact, or a relaunch with another size
            self._drop(sim)
            stream = self._streams[sim] = _Stream(csize)
        for fid, name in enumerate(self.spec.fields):
            declared = {r: (stream.layouts[r][fid], stream.blocks[r][fid]) for r in stream.layouts if r != crank}
            joined(f"simulation {sim}, field '{name}'", {**declared, crank: (layouts[fid], blocks[fid])}, csize, crank)
        if crank in stream.layouts and (stream.layouts[crank], stream.blocks[crank]) != (layouts, blocks):
            self._forget_pieces(sim, stream)  # held under the declaration it replaces: they would not fit
        stream.layouts[crank] = layouts
        stream.blocks[crank] = blocks
        stream.finalized.pop(crank, None)  # a relaunched attempt announces its steps anew

    def _finalize(self, header: Header, body: object) -> None:
        sim = header.simulation_id
        steps = body.get("steps") if isinstance(body, dict) else None
        if not isinstance(steps, int) or steps < 0:
            raise ProtocolError(f"simulation {sim}: bad finalize {quote(body)}", "malformed")
        stream = self._streams.get(sim)
        if stream is None or header.client_rank not in stream.layouts:
            raise ProtocolError(f"simulation {sim}: finalize from undeclared client rank", "undeclared")
        stream.finalized[header.client_rank] = steps

    def _data(self, header: Header, payload: bytes | memoryview) -> Sample | None:
        sim, step, crank, fid = header.simulation_id, header.time_step, header.client_rank, header.field_id
        where, stream, (dtype, shape) = self._check_data(header)
        if (sim, step) in self.ledger:
            self.duplicates += 1
            return None
        values = np.frombuffer(payload, dtype=dtype)
        if self.spec.reject_non_finite and values.dtype.kind == "f" and not all_finite(values):
            self._forget_piece(sim, stream, (step, fid, crank))  # the slice, sent again, starts afresh
            raise ProtocolError(f"{where}: NaN or infinite values", "non_finite")  # one would poison the model
        pending = stream.pending.setdefault(step, {})
        if (fid, crank) in pending:
            raise ProtocolError(f"{where}: this slice is already pending", "duplicate")
        block = stream.blocks[crank][fid]
        if header.payload_bytes > PART_BYTES or stream.placed(block):
            piece = self._part(stream, header, values, where, block)
            if piece is None:
                return None
            array, held = piece, 0  # counted from its first part
        else:
            array = values.reshape(shape)
            held = array.nbytes  # counted in the budget once the step waits for other pieces
            if array.nbytes < COPY_FROM:
                array = array.copy()
        pending[(fid, crank)] = array
        if held:
            self.bytes_received += len(payload)
        if len(pending) < len(self.spec.fields) * stream.client_size:
            if held:
                self._hold((sim, step), held)
            return None
        del stream.pending[step]
        self._release((sim, step))
        fields = self._join(step, pending, stream)
        self._check_pins(sim, step, fields)
        if self.spec.consecutive:
            self._check_order(sim, step)
        return Sample(sim, step, self.spec.parameters[sim], fields)

    def _check_data(self, header: Header) -> tuple[str, _Stream, Layout]:
        """Where a DATA message belongs (its words for refusals), its stream and its declared layout."""
        sim, step, crank, fid = header.simulation_id, header.time_step, header.client_rank, header.field_id
        spec = self.spec
        where = f"simulation {sim}, step {step}"
        if spec.server_rank not in spec.route.ranks(sim, step):
            raise ProtocolError(f"{where}: sent to rank {spec.server_rank}, not its owner", "routing")
        if spec.time_steps is not None and step >= spec.time_steps:
            raise ProtocolError(
                f"{where}: the study has {spec.time_steps} steps, numbered 0 to {spec.time_steps - 1} (send each "
                "step's index, 0, 1, 2, ..., not your code's own step counter)",
                "time_step",
            )
        if fid >= len(spec.fields):
            raise ProtocolError(f"{where}: unknown field id {fid}", "unknown_field")
        where += f", field '{spec.fields[fid]}', client rank {crank}"
        stream = self._streams.get(sim)
        if stream is None or crank not in stream.layouts or stream.client_size != header.client_size:
            raise ProtocolError(f"{where}: no declaration from this client rank", "undeclared")
        dtype, shape = stream.layouts[crank][fid]
        if header.dtype != dtype:
            raise ProtocolError(f"{where}: dtype {header.dtype}, declared {dtype}", "dtype")
        if header.shape != shape:
            raise ProtocolError(f"{where}: shape {list(header.shape)}, declared {list(shape)}", "shape")
        if header.payload_bytes != payload_bytes(dtype, shape):
            raise ProtocolError(f"{where}: {header.payload_bytes} bytes for {dtype}{list(shape)}", "malformed")
        return where, stream, (dtype, shape)

    def _part(
        self, stream: _Stream, header: Header, values: np.ndarray, where: str, block: Block | None
    ) -> np.ndarray | None:
        """Write one part of a piece where it belongs, in the order the client sent its values: into the slice's
        own array, or a block's straight into its region of the field's global array (made at the step's first
        piece of the field). The piece once its last part is in."""
        sim, step, key = header.simulation_id, header.time_step, (header.time_step, header.field_id, header.client_rank)
        piece = stream.parts.get(key)
        if piece is None:
            if stream.placed(block):
                assert block is not None
                whole, made = stream.wholes.get(key[:2]), 0
                if whole is None:
                    whole = stream.wholes[key[:2]] = np.empty(block.global_shape, header.dtype)
                    made = whole.nbytes
                target = destination(whole, block, header.shape)
            else:
                target = np.empty(header.shape, header.dtype)
                made = target.nbytes
            piece = stream.parts[key] = _Parts(target, set(parts(header.payload_bytes)))
            self._hold((sim, step), made)
            if (sim, step) not in self._partial:
                return None  # alone over the budget: evicted at once, and counted
        if header.offset not in piece.missing:
            raise ProtocolError(f"{where}: the part at offset {header.offset} is already pending", "duplicate")
        write_flat(piece.array, header.offset // values.itemsize, values)
        piece.missing.discard(header.offset)
        self.bytes_received += values.nbytes
        if piece.missing:
            return None
        del stream.parts[key]
        return piece.array

    def _join(self, step: int, pending: Mapping[tuple[int, int], np.ndarray], stream: _Stream) -> dict[str, np.ndarray]:
        """Each field whole: the global array its blocks were written into, or its client ranks' slices stacked on
        axis 0 in rank order (one rank's slice as it came)."""
        size, fields = stream.client_size, {}
        for fid, name in enumerate(self.spec.fields):
            whole = stream.wholes.pop((step, fid), None)
            if whole is not None:
                fields[name] = whole
            else:
                pieces = [pending[(fid, r)] for r in range(size)]
                fields[name] = pieces[0] if size == 1 else np.concatenate(pieces)
        return fields

    def _check_pins(self, sim: int, step: int, fields: dict[str, np.ndarray]) -> None:
        """Every sample of the study has the same dtype and shape per field: the first complete one pins them."""
        for fid, name in enumerate(self.spec.fields):
            layout = (fields[name].dtype, fields[name].shape)
            pinned = self._pins.setdefault(fid, layout)
            if layout != pinned:
                raise ProtocolError(
                    f"simulation {sim}, step {step}, field '{name}': {describe((layout[0].name, layout[1]))}, "
                    f"the study's samples are {describe((pinned[0].name, pinned[1]))}",
                    "shape",
                )

    def _check_order(self, sim: int, step: int) -> None:
        """A window is consecutive steps: once a rank holds a step of the simulation, a step must come after the
        one before it, when that one is routed here too. (Steps of one connection arrive in the order they were
        sent; a relaunched attempt sends every step again from its first, those seen dropped, so a step that a
        restart left out of the ledger on purpose (``Buffer.lacks``) comes after the one before it too.)"""
        last = self.ledger.last(sim)
        if last is None or not step or (sim, step - 1) in self.ledger:
            return
        if self.spec.server_rank in self.spec.route.ranks(sim, step - 1):
            raise ProtocolError(
                f"simulation {sim}, step {step}: sent after step {last} without step {step - 1}; windows of steps "
                "(training.window) need every step, in order",
                "order",
            )

    # -- memory held for incomplete steps and replaced attempts ---------------

    def _hold(self, key: tuple[int, int], nbytes: int) -> None:
        """Count a pending piece; evict the oldest incomplete steps beyond the budget."""
        self._partial[key] = self._partial.get(key, 0) + nbytes
        self.partial_bytes += nbytes
        while self.partial_bytes > self.spec.max_partial_bytes:
            (sim, step), held = next(iter(self._partial.items()))
            stream = self._streams[sim]
            pieces = len(stream.pending.pop(step, ())) + stream.drop_parts(step)
            self._release((sim, step))
            message = (
                f"simulation {sim}, step {step}: {pieces} pieces evicted incomplete ({held} bytes) to keep "
                f"partial steps under server.max_partial_bytes={self.spec.max_partial_bytes}"
            )
            self.rejections.reject("incomplete", message)
            if self.spec.consecutive:  # its next step will be refused for it: the simulation's failure says why
                self._refused.setdefault(sim, ("incomplete", message))

    def _release(self, key: tuple[int, int]) -> None:
        self.partial_bytes -= self._partial.pop(key, 0)

    def _forget_piece(self, sim: int, stream: _Stream, key: tuple[int, int, int]) -> None:
        """Drop the piece of ``sim`` still arriving in parts at ``key`` (step, field, client rank), and the bytes
        its own array counts (a block's region of its field's global array has none of its own)."""
        step, fid, crank = key
        piece = stream.parts.pop(key, None)
        if piece is not None and not stream.placed(stream.blocks[crank][fid]):
            self._partial[(sim, step)] -= piece.array.nbytes
            self.partial_bytes -= piece.array.nbytes

    def _forget_pieces(self, sim: int, stream: _Stream) -> None:
        """Free the pieces of ``sim``'s incomplete steps (every step with a part has its ``pending`` entry)."""
        for step in stream.pending:
            self._release((sim, step))
        stream.pending.clear()
        stream.parts.clear()
        stream.wholes.clear()

    def _drop(self, sim: int) -> None:
        """Forget a simulation's stream and free its pending pieces."""
        stream = self._streams.pop(sim, None)
        if stream is not None:
            self._forget_pieces(sim, stream)

    def start_attempt(self, sim: int, attempt: int) -> None:
        """A newer attempt of ``sim`` runs: the older one's pieces are dropped and its frames refused from now on."""
        if attempt > self._attempts.get(sim, 0):
            self._attempts[sim] = attempt
            self._drop(sim)
            self._read.pop(sim, None)

    def finish(self, sim: int) -> None:
        """``sim`` is done or failed: free what it holds and refuse whatever else it sends."""
        self._finished.add(sim)
        self._drop(sim)
        self._read.pop(sim, None)
        self._attempts.pop(sim, None)  # its frames are refused as finished from now on, whatever their attempt

    def delivery(self, sim: int, attempt: int, client_rank: int) -> Delivery:
        """What this rank has read of one client rank of one attempt, for the client's acknowledged finalize."""
        current = self._attempts.get(sim, 0)
        if sim in self._finished or attempt < current:
            return Delivery(0, False, ended=True)
        if attempt > current:  # none of its frames read yet
            return Delivery(0, False, ended=False)
        stream = self._streams.get(sim)
        finalized = stream is not None and client_rank in stream.finalized
        return Delivery(self._read.get(sim, {}).get(client_rank, 0), finalized, ended=False)

    def commit(self, sample: Sample) -> None:
        """Record a sample once the buffer has taken it."""
        self.ledger.add(sample.simulation_id, sample.time_step)
        if self.spec.overlap and self.spec.route.owner(sample.simulation_id, sample.time_step) != self.spec.server_rank:
            self.copies += 1
        self._changed.add(sample.simulation_id)

    def state_dict(self) -> dict[str, Any]:
        """The steps received and the counters the final report adds up."""
        return {
            "ledger": self.ledger.state_dict(),
            "bytes_received": self.bytes_received,
            "duplicates": self.duplicates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint: its steps count as received and will be dropped on arrival."""
        self.ledger = Ledger()
        self.ledger.load_state_dict(state["ledger"])
        self.copies = self._copies()
        self.bytes_received = state["bytes_received"]
        self.duplicates = state["duplicates"]
        self._changed.update(self.ledger.simulations())

    def _copies(self) -> int:
        """The ledger's steps that another rank owns (with windows: the next block's first steps), recounted."""
        if not self.spec.overlap:
            return 0
        route, rank, copies = self.spec.route, self.spec.server_rank, 0
        for sim in self.ledger.simulations():
            steps = np.array(self.ledger.steps(sim))
            copies += int(np.count_nonzero(np.broadcast_to(route.owner(sim, steps) != rank, steps.shape)))
        return copies

    # -- bookkeeping ----------------------------------------------------------

    def take_progress(self) -> dict[int, Progress]:
        """Progress of the simulations that saw any frame since the last call."""
        changed, self._changed = self._changed, set()
        return {s: self.progress(s) for s in changed}

    def take_refused(self) -> dict[int, tuple[str, str]]:
        """The first frame refused of each simulation since the last call: kind and message."""
        refused, self._refused = self._refused, {}
        return refused

    def progress(self, sim: int) -> Progress:
        stream = self._streams.get(sim)
        expected = None
        if stream is not None and len(stream.finalized) == stream.client_size:
            expected = max(stream.finalized.values())
        return Progress(self.ledger.count(sim), expected)


def _part_bytes(header: Header) -> int | None:
    """The payload length a message with this header must have (None: its offset is not a part's)."""
    if header.kind is not Kind.DATA or header.payload_bytes <= PART_BYTES:
        return header.payload_bytes if header.offset == 0 else None
    if header.offset % PART_BYTES or header.offset >= header.payload_bytes:
        return None
    return min(PART_BYTES, header.payload_bytes - header.offset)
