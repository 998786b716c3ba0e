"""A rank's assembler: frames as a client sends them -> checked, joined samples."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from melissa_dl.buffers.sample import Sample
from melissa_dl.errors import ProtocolError
from melissa_dl.ingest.assembly import COPY_FROM, Assembler, Progress, StreamSpec
from melissa_dl.ingest.ledger import Ledger
from melissa_dl.wire.blocks import Block
from melissa_dl.wire.protocol import PART_BYTES, Header, Kind, encode_json, simulation_key, unpack_header
from melissa_dl.wire.rejections import RejectionLog

pytestmark = pytest.mark.timeout(60)

TOKEN = b"study-token"
FIELDS = ("u", "v")
PARAMETERS = np.arange(6.0).reshape(3, 2)  # three simulations
Layouts = dict[str, tuple[str, tuple[int, ...]]]
LAYOUTS: Layouts = {"u": ("float32", (4,)), "v": ("int64", (2,))}
TWO_RANK_LAYOUTS: list[Layouts] = [
    {"u": ("float32", (2,)), "v": ("int64", (1, 3))},
    {"u": ("float32", (3,)), "v": ("int64", (2, 3))},
]


def make_spec(**overrides: Any) -> StreamSpec:
    options: dict[str, Any] = dict(fields=FIELDS, parameters=PARAMETERS, token=TOKEN, server_rank=0, server_size=1)
    options.update(overrides)
    return StreamSpec(**options)


def array_for(layout: tuple[str, tuple[int, ...]], seed: int) -> np.ndarray:
    dtype, shape = layout
    return np.random.default_rng(seed).integers(-1000, 1000, size=shape).astype(dtype)


@dataclass(frozen=True)
class Sender:
    """One client rank of one simulation, framing its messages as melissa_dl.wire.client does."""

    sim: int
    rank: int = 0
    size: int = 1
    token: bytes = TOKEN
    attempt: int = 0

    def message(self, kind: Kind, payload: bytes, **header: Any) -> list[bytes]:
        """Two frames; ``header`` overrides the defaults of a control message (step 0, field 0, uint8, 0-d)."""
        fields: dict[str, Any] = dict(
            kind=kind,
            key=simulation_key(self.token, self.sim, self.attempt),
            simulation_id=self.sim,
            attempt=self.attempt,
            time_step=0,
            client_rank=self.rank,
            client_size=self.size,
            field_id=0,
            dtype="uint8",
            shape=(),
            payload_bytes=len(payload),
        )
        fields.update(header)
        return [Header(**fields).pack(), payload]

    def control(self, kind: Kind, body: Any) -> list[bytes]:
        return self.message(kind, encode_json(body))

    def declare(self, layouts: Layouts = LAYOUTS) -> list[bytes]:
        return self.control(Kind.DECLARE, {"fields": {n: [d, list(s)] for n, (d, s) in layouts.items()}})

    def finalize(self, steps: int) -> list[bytes]:
        return self.control(Kind.FINALIZE, {"steps": steps})

    def data(self, step: int, name: str, array: Any, **overrides: Any) -> list[bytes]:
        array = np.asarray(array)  # not ascontiguousarray, which makes 0-d arrays 1-d
        layout = dict(time_step=step, field_id=FIELDS.index(name), dtype=array.dtype.name, shape=array.shape)
        return self.message(Kind.DATA, array.tobytes(), **{**layout, **overrides})


def step_arrays(sim: int, step: int, layouts: Layouts = LAYOUTS, rank: int = 0) -> dict[str, np.ndarray]:
    """The distinct, reproducible field slices a client rank sends for one step."""
    return {name: array_for(layouts[name], 10_000 * sim + 100 * step + 10 * rank + i) for i, name in enumerate(FIELDS)}


def send_step(assembler: Assembler, sender: Sender, step: int) -> Sample | None:
    """Send every field of one step of a single-rank client; return what the last frame completed."""
    results = [assembler.handle(sender.data(step, n, a)) for n, a in step_arrays(sender.sim, step).items()]
    assert results[:-1] == [None] * (len(results) - 1)
    return results[-1]


def assert_fields(sample: Sample | None, expected: dict[str, np.ndarray]) -> None:
    assert sample is not None
    assert sample.fields.keys() == expected.keys()
    for name, array in expected.items():
        assert sample.fields[name].dtype == array.dtype
        np.testing.assert_array_equal(sample.fields[name], array)


def refused(assembler: Assembler, frames: list[bytes], kind: str, message: str = "") -> None:
    with pytest.raises(ProtocolError) as info:
        assembler.handle(frames)
    assert info.value.kind == kind
    assert message in str(info.value)


BIG_LAYOUTS: Layouts = {"u": ("float32", (COPY_FROM // 4,)), "v": ("int64", (3, COPY_FROM // 8))}


@pytest.mark.parametrize(
    "layouts, views",
    [(LAYOUTS, False), ({"u": ("float16", ()), "v": ("uint8", (2, 1, 3))}, False), (BIG_LAYOUTS, True)],
    ids=["1-d", "0-d,3-d", "large"],
)
@pytest.mark.parametrize("wrap", [bytes, memoryview])
def test_single_rank_sample_views_large_payloads_and_copies_small_ones(
    wrap: Callable[[bytes], Any], layouts: Layouts, views: bool
) -> None:
    """A view of a small payload would pin ZeroMQ's whole receive chunk, uncounted by the buffer."""
    assembler = Assembler(make_spec())
    sender = Sender(sim=1)
    assert assembler.handle([wrap(f) for f in sender.declare(layouts)]) is None
    arrays = step_arrays(1, 2, layouts)
    messages = {name: sender.data(2, name, array) for name, array in arrays.items()}
    assert assembler.handle([wrap(f) for f in messages["u"]]) is None
    sample = assembler.handle([wrap(f) for f in messages["v"]])
    assert_fields(sample, arrays)
    assert sample is not None and (sample.simulation_id, sample.time_step) == (1, 2)
    assert sample.fields["u"].shape == layouts["u"][1]
    np.testing.assert_array_equal(sample.parameters, PARAMETERS[1])
    for name, frames in messages.items():
        assert np.shares_memory(sample.fields[name], np.frombuffer(frames[1], np.uint8)) is views, name
    payload = sum(len(frames[1]) for frames in messages.values())
    assert sample.nbytes == PARAMETERS[1].nbytes + payload
    assert assembler.bytes_received == payload
    assert (1, 2) not in assembler.ledger  # the receiver commits once the buffer took the sample
    assembler.commit(sample)
    assert (1, 2) in assembler.ledger and assembler.ledger.total() == 1


def _two_rank_orders() -> list[tuple[tuple[int, str], ...]]:
    """Every arrival order of two client ranks' (declare, u, v) where each rank's declaration comes first."""
    events = [(r, what) for r in (0, 1) for what in ("declare", *FIELDS)]
    return [
        order
        for order in itertools.permutations(events)
        if all(order.index((r, "declare")) < order.index((r, n)) for r in (0, 1) for n in FIELDS)
    ]


@pytest.mark.parametrize("order", _two_rank_orders())
def test_two_client_ranks_complete_only_with_every_slice(order: tuple[tuple[int, str], ...]) -> None:
    assembler = Assembler(make_spec())
    senders = [Sender(2, rank, size=2) for rank in (0, 1)]
    arrays = [step_arrays(2, 5, TWO_RANK_LAYOUTS[r], rank=r) for r in (0, 1)]
    results = []
    for rank, what in order:
        sender = senders[rank]
        if what == "declare":
            results.append(assembler.handle(sender.declare(TWO_RANK_LAYOUTS[rank])))
        else:
            results.append(assembler.handle(sender.data(5, what, arrays[rank][what])))
    assert results[:-1] == [None] * 5
    assert_fields(results[-1], {n: np.concatenate([arrays[0][n], arrays[1][n]]) for n in FIELDS})
    assert results[-1].fields["v"].shape == (3, 3)


def test_interleaved_steps_are_assembled_separately() -> None:
    assembler = Assembler(make_spec())
    sender = Sender(0)
    assembler.handle(sender.declare())
    step0, step1 = step_arrays(0, 0), step_arrays(0, 1)
    assert assembler.handle(sender.data(0, "u", step0["u"])) is None
    assert assembler.handle(sender.data(1, "v", step1["v"])) is None
    second = assembler.handle(sender.data(1, "u", step1["u"]))
    first = assembler.handle(sender.data(0, "v", step0["v"]))
    assert_fields(second, step1)
    assert_fields(first, step0)
    assert (first.time_step, second.time_step) == (0, 1)  # type: ignore[union-attr]


def test_duplicates_after_commit_are_dropped_and_counted() -> None:
    assembler = Assembler(make_spec())
    sender = Sender(0)
    assembler.handle(sender.declare())
    sample = send_step(assembler, sender, 3)
    assert sample is not None
    assembler.commit(sample)
    received = assembler.bytes_received
    assert send_step(assembler, sender, 3) is None  # a relaunched simulation sends step 3 again
    assert assembler.duplicates == 2
    assert assembler.bytes_received == received
    assert assembler.ledger.count(0) == 1
    assert_fields(send_step(assembler, sender, 4), step_arrays(0, 4))


BAD_FRAMES: dict[str, tuple[Callable[[Sender], list[bytes]], str, str]] = {
    # name: (frames from simulation 0's client, expected kind, part of the message)
    "one frame": (lambda s: s.data(0, "u", U_OTHER)[:1], "malformed", "message of 1 frames instead of 2"),
    "three frames": (lambda s: s.data(0, "u", U_OTHER) + [b""], "malformed", "message of 3 frames"),
    "short header": (lambda s: [b"MLDL", b""], "malformed", "header of 4 bytes"),
    "payload length": (
        lambda s: s.data(0, "u", U_OTHER, payload_bytes=15),
        "malformed",
        "payload of 16 bytes at offset 0, header says 15 in all",
    ),
    "declaration JSON": (lambda s: s.message(Kind.DECLARE, b"{fields"), "malformed", "declaration: invalid JSON"),
    "declaration body": (lambda s: s.control(Kind.DECLARE, {"field": {}}), "malformed", "declaration without fields"),
    "declaration layout": (
        lambda s: s.control(Kind.DECLARE, {"fields": {"u": ["float32"], "v": ["int64", [2]]}}),
        "malformed",
        "field 'u': expected [dtype, shape]",
    ),
    "finalize JSON": (lambda s: s.message(Kind.FINALIZE, b"steps=3"), "malformed", "finalize: invalid JSON"),
    "finalize negative": (lambda s: s.finalize(-1), "malformed", "bad finalize"),
    "finalize not int": (lambda s: s.control(Kind.FINALIZE, {"steps": "3"}), "malformed", "bad finalize"),
    "wrong token": (lambda s: Sender(0, token=b"guess").data(0, "u", U_OTHER), "credentials", "bad credentials"),
    "key of another simulation": (
        lambda s: s.data(0, "u", U_OTHER, key=simulation_key(TOKEN, 1, 0)),
        "credentials",
        "simulation 0: bad credentials",
    ),
    "key of another attempt": (
        lambda s: s.data(0, "u", U_OTHER, attempt=1),
        "credentials",
        "simulation 0: bad credentials",
    ),
    "same slice twice": (lambda s: s.data(0, "u", U_OTHER), "duplicate", "field 'u', client rank 0: this slice is"),
    "peer text is cut": (
        lambda s: s.control(Kind.FINALIZE, {"steps": "x" * 10**6}),
        "malformed",
        "... (1000013 characters)",
    ),
    "unknown simulation": (
        lambda s: Sender(3).data(0, "u", U_OTHER),
        "unknown_simulation",
        "simulation 3 is not in the study",
    ),
    "routing": (lambda s: s.data(1, "u", U_OTHER), "routing", "step 1: sent to rank 0, not its owner"),
    "time step": (
        lambda s: s.data(4, "u", U_OTHER),
        "time_step",
        "step 4: the study has 4 steps, numbered 0 to 3 (send each step's index, 0, 1, 2, ..., not your code's "
        "own step counter)",
    ),
    "field id": (lambda s: s.data(0, "u", U_OTHER, field_id=2), "unknown_field", "unknown field id 2"),
    "field not declared": (
        lambda s: s.declare({"u": LAYOUTS["u"]}),
        "unknown_field",
        "simulation 0: field 'v' not declared",
    ),
    "extra field declared": (
        lambda s: s.declare({**LAYOUTS, "w": ("float32", (1,))}),
        "unknown_field",
        "unknown field 'w'",
    ),
    "data before declaration": (
        lambda s: Sender(1).data(1, "u", U_OTHER),
        "undeclared",
        "no declaration from this client rank",
    ),
    "other client size": (
        lambda s: Sender(0, rank=1, size=2).data(0, "u", U_OTHER),
        "undeclared",
        "no declaration",
    ),
    "finalize before declaration": (
        lambda s: Sender(1).finalize(2),
        "undeclared",
        "finalize from undeclared client rank",
    ),
    "data dtype": (lambda s: s.data(0, "u", U_OTHER.astype("float64")), "dtype", "dtype float64, declared float32"),
    "declared dtype": (lambda s: s.declare({**LAYOUTS, "u": ("complex64", (4,))}), "dtype", "'complex64'"),
    "data shape": (lambda s: s.data(0, "u", U_OTHER[:3]), "shape", "shape [3], declared [4]"),
    "declared shape": (
        lambda s: s.control(Kind.DECLARE, {"fields": {"u": ["float32", [-4]], "v": ["int64", [2]]}}),
        "shape",
        "bad shape [-4]",
    ),
    "NaN": (lambda s: s.data(0, "u", np.where(U_OTHER > 1, np.nan, U_OTHER)), "non_finite", "NaN or infinite values"),
    "infinity": (lambda s: s.data(0, "u", np.where(U_OTHER > 1, -np.inf, U_OTHER)), "non_finite", "field 'u'"),
    "oversize declaration": (
        lambda s: s.declare({**LAYOUTS, "u": ("float32", (17,))}),
        "oversize",
        "68 bytes per step exceed server.max_message_bytes=64",
    ),
}
U_OTHER = np.array([1.5, 2.5, -3.0, 0.0], dtype=np.float32)  # a valid slice that must never replace the pending one


@pytest.mark.parametrize("name", list(BAD_FRAMES))
def test_refused_frame_loses_nothing(name: str) -> None:
    make_frames, kind, message = BAD_FRAMES[name]
    assembler = Assembler(make_spec(server_size=2, time_steps=4, max_message_bytes=64))
    sender = Sender(0)
    assembler.handle(sender.declare())
    arrays = step_arrays(0, 0)
    assert assembler.handle(sender.data(0, "u", arrays["u"])) is None  # a pending partial sample
    refused(assembler, make_frames(sender), kind, message)
    assert_fields(assembler.handle(sender.data(0, "v", arrays["v"])), arrays)
    assert assembler.bytes_received == 32 and assembler.duplicates == 0
    assert_fields(send_step(assembler, sender, 2), step_arrays(0, 2))  # the declaration still holds


@pytest.mark.parametrize("size", [8, 15])
def test_payload_smaller_than_the_declared_layout_is_refused(size: int) -> None:
    assembler = Assembler(make_spec())
    sender = Sender(0)
    assembler.handle(sender.declare())
    frames = sender.message(Kind.DATA, bytes(size), dtype="float32", shape=(4,))
    refused(assembler, frames, "malformed")


def test_non_finite_values_are_accepted_when_allowed() -> None:
    assembler = Assembler(make_spec(reject_non_finite=False))
    sender = Sender(0)
    assembler.handle(sender.declare())
    u = np.array([np.nan, np.inf, -np.inf, 1.0], dtype=np.float32)
    assert assembler.handle(sender.data(0, "u", u)) is None
    sample = assembler.handle(sender.data(0, "v", step_arrays(0, 0)["v"]))
    assert sample is not None
    np.testing.assert_array_equal(sample.fields["u"], u)


@pytest.mark.parametrize(
    "bind, accepted",
    [
        (False, {(s, t) for s in range(3) for t in range(4) if (s + t) % 2 == 1}),
        (True, {(1, t) for t in range(4)}),
    ],
)
def test_routing_rule_decides_what_rank_1_of_2_accepts(bind: bool, accepted: set[tuple[int, int]]) -> None:
    assembler = Assembler(make_spec(server_rank=1, server_size=2, bind_simulation=bind))
    seen = set()
    for sim in range(3):
        sender = Sender(sim)
        assembler.handle(sender.declare())
        for step in range(4):
            try:
                assembler.handle(sender.data(step, "u", U_OTHER))
            except ProtocolError as error:
                assert error.kind == "routing"
            else:
                seen.add((sim, step))
    assert seen == accepted


@pytest.mark.parametrize(
    "rank1_u, message",
    [
        (("float64", (3, 2)), "client rank 1 declares float64[3, 2], rank 0 float32[2, 2]"),
        (("float32", (3, 3)), "cannot be joined on axis 0"),
        (("float32", ()), "cannot be joined on axis 0"),
        (("float32", (2,)), "cannot be joined on axis 0"),
    ],
)
def test_client_ranks_must_declare_joinable_slices(rank1_u: tuple[str, tuple[int, ...]], message: str) -> None:
    assembler = Assembler(make_spec())
    rank0, rank1 = Sender(0, 0, 2), Sender(0, 1, 2)
    assembler.handle(rank0.declare({**TWO_RANK_LAYOUTS[0], "u": ("float32", (2, 2))}))
    refused(assembler, rank1.declare({**TWO_RANK_LAYOUTS[1], "u": rank1_u}), "shape", message)
    refused(assembler, rank1.data(0, "v", step_arrays(0, 0, TWO_RANK_LAYOUTS[1])["v"]), "undeclared")


def test_zero_dimensional_slice_declared_first_cannot_be_joined() -> None:
    """Refused as soon as it is declared, by one of two client ranks: nothing of it could be stacked on axis 0."""
    assembler = Assembler(make_spec())
    refused(
        assembler, Sender(0, 0, 2).declare({**TWO_RANK_LAYOUTS[0], "u": ("float32", ())}), "shape", "declares float32[]"
    )


def test_relaunch_with_another_client_size_starts_a_new_stream() -> None:
    assembler = Assembler(make_spec())
    old = Sender(0)
    assembler.handle(old.declare())
    assembler.handle(old.data(0, "u", step_arrays(0, 0)["u"]))
    new = [Sender(0, rank, size=2) for rank in (0, 1)]
    arrays = [step_arrays(0, 0, TWO_RANK_LAYOUTS[r], rank=r) for r in (0, 1)]
    assembler.handle(new[0].declare(TWO_RANK_LAYOUTS[0]))
    refused(assembler, old.data(0, "v", step_arrays(0, 0)["v"]), "undeclared")
    assembler.handle(new[1].declare(TWO_RANK_LAYOUTS[1]))
    results = [assembler.handle(new[r].data(0, n, arrays[r][n])) for r in (0, 1) for n in FIELDS]
    assert results[:3] == [None] * 3
    assert_fields(results[3], {n: np.concatenate([arrays[0][n], arrays[1][n]]) for n in FIELDS})


def test_progress_expects_the_maximum_once_every_client_rank_finalized() -> None:
    assembler = Assembler(make_spec())
    senders = [Sender(2, rank, size=2) for rank in (0, 1)]
    assert assembler.progress(2) == Progress(0, None)
    for sender in senders:
        assembler.handle(sender.declare(TWO_RANK_LAYOUTS[sender.rank]))
    results = [
        assembler.handle(s.data(0, name, array))
        for s in senders
        for name, array in step_arrays(2, 0, TWO_RANK_LAYOUTS[s.rank]).items()
    ]
    assert results[-1] is not None
    assembler.commit(results[-1])
    assert assembler.progress(2) == Progress(1, None)
    assembler.handle(senders[1].finalize(3))
    assert assembler.progress(2) == Progress(1, None)
    assembler.handle(senders[0].finalize(2))
    assert assembler.progress(2) == Progress(1, 3)
    assert assembler.progress(0) == Progress(0, None)


def test_take_progress_reports_changed_simulations_once() -> None:
    assembler = Assembler(make_spec())
    first, second = Sender(0), Sender(1)
    assert assembler.take_progress() == {}
    assembler.handle(first.declare())
    assembler.handle(second.declare())
    assert assembler.take_progress() == {0: Progress(0, None), 1: Progress(0, None)}
    assert assembler.take_progress() == {}
    sample = send_step(assembler, second, 0)
    assert assembler.take_progress() == {1: Progress(0, None)}  # frames arrived: the simulation is active
    assert sample is not None
    assembler.commit(sample)
    assembler.handle(second.finalize(1))
    assert assembler.take_progress() == {1: Progress(1, 1)}
    assert assembler.take_progress() == {}


def test_partial_steps_are_bounded_by_a_byte_budget_oldest_evicted_first() -> None:
    """One field sent only every 10th step: the incomplete steps must not pile up (issue 10, defect 6)."""
    rejections = RejectionLog()
    assembler = Assembler(make_spec(max_partial_bytes=10 * 16), rejections)  # ten pending 16-byte 'u' slices
    sender = Sender(0)
    assembler.handle(sender.declare())
    complete = []
    for step in range(1000):
        arrays = step_arrays(0, step)
        assembler.handle(sender.data(step, "u", arrays["u"]))
        if step % 10 == 0:
            complete.append(assembler.handle(sender.data(step, "v", arrays["v"])))
    assert assembler.partial_bytes <= 10 * 16
    assert rejections.counts() == {"incomplete": 900 - 10}  # the last ten incomplete steps are still held
    assert [s.time_step for s in complete if s is not None] == list(range(0, 1000, 10))
    # an evicted step can still complete later: a relaunch sends it again
    arrays = step_arrays(0, 1)
    assembler.handle(sender.data(1, "u", arrays["u"]))
    assert_fields(assembler.handle(sender.data(1, "v", arrays["v"])), arrays)


PARTED_LAYOUTS: Layouts = {"u": ("float64", (5 * PART_BYTES // 16 + 3,)), "v": ("int64", (2,))}  # u: 3 parts


def parts_of(sender: Sender, step: int, name: str, array: np.ndarray) -> list[list[bytes]]:
    """The messages of a slice over PART_BYTES, as the clients send them."""
    octets = array.tobytes()
    return [
        sender.data(step, name, array, offset=offset, payload_bytes=len(octets))[:1]
        + [octets[offset : offset + PART_BYTES]]
        for offset in range(0, len(octets), PART_BYTES)
    ]


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
def test_a_slice_over_part_bytes_is_assembled_from_its_parts_in_any_order(order: tuple[int, ...]) -> None:
    assembler = Assembler(make_spec(max_message_bytes=8 * PART_BYTES))
    sender = Sender(0)
    assembler.handle(sender.declare(PARTED_LAYOUTS))
    arrays = step_arrays(0, 0, PARTED_LAYOUTS)
    u_parts = parts_of(sender, 0, "u", arrays["u"])
    assert len(u_parts) == 3 and [len(p[1]) for p in u_parts] == [
        PART_BYTES,
        PART_BYTES,
        arrays["u"].nbytes % PART_BYTES,
    ]
    assert assembler.handle(sender.data(0, "v", arrays["v"])) is None
    for i in order[:-1]:
        assert assembler.handle(u_parts[i]) is None
    assert assembler.partial_bytes == arrays["u"].nbytes + arrays["v"].nbytes  # the slice, from its first part
    assert_fields(assembler.handle(u_parts[order[-1]]), arrays)
    assert assembler.partial_bytes == 0
    assert assembler.bytes_received == arrays["u"].nbytes + arrays["v"].nbytes


def test_parts_out_of_place_are_refused_and_the_slice_still_completes() -> None:
    assembler = Assembler(make_spec(max_message_bytes=8 * PART_BYTES))
    sender = Sender(0)
    assembler.handle(sender.declare(PARTED_LAYOUTS))
    arrays = step_arrays(0, 0, PARTED_LAYOUTS)
    first, second, last = parts_of(sender, 0, "u", arrays["u"])
    header = first[0]
    assert assembler.handle(first) is None
    refused(assembler, first, "duplicate", "field 'u', client rank 0: the part at offset 0 is already pending")
    refused(
        assembler,
        [sender.data(0, "u", arrays["u"], offset=PART_BYTES // 2, payload_bytes=arrays["u"].nbytes)[0], second[1]],
        "malformed",
        "at offset 524288",
    )
    refused(assembler, [second[0], second[1][:-1]], "malformed", f"payload of {PART_BYTES - 1} bytes at offset")
    refused(
        assembler,
        [sender.data(0, "u", arrays["u"], offset=3 * PART_BYTES, payload_bytes=arrays["u"].nbytes)[0], b""],
        "malformed",
        "at offset 3145728",
    )
    assert header == first[0]
    assert assembler.handle(second) is None
    assert assembler.handle(sender.data(0, "v", arrays["v"])) is None
    assert_fields(assembler.handle(last), arrays)


def test_a_slice_in_parts_is_refused_at_its_non_finite_part_and_may_be_sent_again() -> None:
    """Each part is checked as it comes, before it is written: the refused slice is forgotten, and sent again it
    starts afresh."""
    assembler = Assembler(make_spec(max_message_bytes=8 * PART_BYTES))
    sender = Sender(0)
    assembler.handle(sender.declare(PARTED_LAYOUTS))
    arrays = step_arrays(0, 0, PARTED_LAYOUTS)
    u = arrays["u"].copy()
    u[-1] = np.nan
    *head, last = parts_of(sender, 0, "u", u)
    for frames in head:
        assert assembler.handle(frames) is None
    refused(assembler, last, "non_finite", "step 0, field 'u', client rank 0: NaN or infinite values")
    assert assembler.partial_bytes == 0  # the refused slice's array is no longer held nor counted
    for frames in parts_of(sender, 0, "u", arrays["u"]):  # the same slice, finite: a fresh start
        assembler.handle(frames)
    assert assembler.partial_bytes == u.nbytes
    assert_fields(assembler.handle(sender.data(0, "v", arrays["v"])), arrays)


def test_a_slice_arriving_in_parts_counts_in_the_budget_and_is_evicted_whole() -> None:
    arrays = {step: step_arrays(0, step, PARTED_LAYOUTS) for step in (0, 1)}
    budget = arrays[0]["u"].nbytes + 100
    rejections = RejectionLog()
    assembler = Assembler(make_spec(max_message_bytes=8 * PART_BYTES, max_partial_bytes=budget), rejections)
    sender = Sender(0)
    assembler.handle(sender.declare(PARTED_LAYOUTS))
    assert assembler.handle(parts_of(sender, 0, "u", arrays[0]["u"])[0]) is None
    assert assembler.partial_bytes == arrays[0]["u"].nbytes
    assert assembler.handle(parts_of(sender, 1, "u", arrays[1]["u"])[0]) is None  # step 0 goes
    assert assembler.partial_bytes == arrays[1]["u"].nbytes
    assert rejections.counts() == {"incomplete": 1}
    for frames in parts_of(sender, 1, "u", arrays[1]["u"])[1:]:
        assert assembler.handle(frames) is None
    assert_fields(assembler.handle(sender.data(1, "v", arrays[1]["v"])), arrays[1])
    assert assembler.partial_bytes == 0


def test_a_newer_attempt_drops_the_older_ones_pieces_and_refuses_its_frames() -> None:
    assembler = Assembler(make_spec())
    old, new = Sender(0, attempt=0), Sender(0, attempt=1)
    assembler.handle(old.declare())
    assembler.handle(old.data(0, "u", U_OTHER))
    assert assembler.partial_bytes == U_OTHER.nbytes
    assembler.handle(new.declare())
    assert assembler.partial_bytes == 0
    refused(assembler, old.data(0, "v", step_arrays(0, 0)["v"]), "stale_attempt", "attempt 0, replaced by attempt 1")
    assert_fields(send_step(assembler, new, 0), step_arrays(0, 0))


def test_rank_0s_news_of_a_relaunch_or_an_end_frees_pieces_and_refuses_later_frames() -> None:
    assembler = Assembler(make_spec())
    first, second = Sender(0), Sender(1)
    for sender in (first, second):
        assembler.handle(sender.declare())
        assembler.handle(sender.data(0, "u", U_OTHER))
    assembler.start_attempt(0, 2)  # rank 0 relaunched simulation 0 before its new attempt sent anything here
    assembler.finish(1)  # simulation 1 is done or failed
    assert assembler.partial_bytes == 0
    refused(assembler, first.data(0, "v", step_arrays(0, 0)["v"]), "stale_attempt")
    refused(
        assembler, second.data(0, "v", step_arrays(1, 0)["v"]), "finished", "simulation 1 is already done or failed"
    )
    relaunched = Sender(0, attempt=2)
    assembler.handle(relaunched.declare())
    assert_fields(send_step(assembler, relaunched, 1), step_arrays(0, 1))


@pytest.mark.parametrize("configured", [True, False])
def test_every_sample_has_the_pinned_dtype_and_shape(configured: bool) -> None:
    """A simulation that declares another shape or dtype must not reach a batch (issue 10, defect 10)."""
    layouts = {"u": ("float32", (4,)), "v": ("int64", (2,))}
    assembler = Assembler(make_spec(layouts=layouts if configured else None))
    assembler.handle(Sender(0).declare())
    assert_fields(send_step(assembler, Sender(0), 0), step_arrays(0, 0))
    odd = Sender(1)
    assembler.handle(odd.declare({**LAYOUTS, "u": ("float64", (4,))}))
    assembler.handle(odd.data(0, "u", step_arrays(1, 0)["u"].astype("float64")))
    refused(
        assembler,
        odd.data(0, "v", step_arrays(1, 0)["v"]),
        "shape",
        "simulation 1, step 0, field 'u': float64[4], the study's samples are float32[4]",
    )
    assert assembler.ledger.total() == 0 and assembler.partial_bytes == 0


def block_declaration(blocks: dict[str, tuple[str, tuple[int, ...], Block]]) -> dict[str, Any]:
    return {"fields": {n: [d, list(s), b.to_json()] for n, (d, s, b) in blocks.items()}}


@pytest.mark.parametrize("order", ["C", "F"])
def test_uneven_blocks_of_four_client_ranks_are_placed_in_the_global_arrays(order: str) -> None:
    """u (5x7, split 3+2 rows, 4+3 columns) in 2x2 blocks, v in 4 column blocks of a 2x3 array, one of them
    empty: each sample's fields are the global arrays, whatever order the blocks come in, and however their
    bytes lie (``order``); a block larger than PART_BYTES is gathered in parts."""
    u = np.arange(35, dtype=np.float32).reshape(5, 7)
    v = np.arange(6, dtype=np.int64).reshape(2, 3) * 10
    rows, cols = [(0, 3), (3, 5)], [(0, 4), (4, 7)]
    vcols = [(0, 1), (1, 1), (1, 3), (3, 3)]  # rank 1 and rank 3 hold no column of v
    assembler = Assembler(make_spec(parameters=np.zeros((3, 2))))
    senders = [Sender(0, rank, size=4) for rank in range(4)]
    pieces: dict[int, dict[str, np.ndarray]] = {}
    for rank, sender in enumerate(senders):
        (r0, r1), (c0, c1), (v0, v1) = rows[rank // 2], cols[rank % 2], vcols[rank]
        pieces[rank] = {"u": u[r0:r1, c0:c1], "v": v[:, v0:v1]}
        blocks = {
            "u": ("float32", (r1 - r0, c1 - c0), Block((r0, c0), (5, 7), order)),
            "v": ("int64", (2, v1 - v0), Block((0, v0), (2, 3), order)),
        }
        assert assembler.handle(sender.control(Kind.DECLARE, block_declaration(blocks))) is None
    sample = None
    for rank in (3, 0, 2, 1):
        for name in FIELDS:
            piece = pieces[rank][name]
            memory = np.asarray(piece, order=order).ravel(order="K")
            frames = senders[rank].data(0, name, piece)
            sample = assembler.handle([frames[0], memory.tobytes()])
    assert_fields(sample, {"u": u, "v": v})
    assert sample is not None and sample.fields["u"].flags.c_contiguous


def test_a_block_larger_than_a_part_arrives_in_parts_in_either_order() -> None:
    rows = PART_BYTES // 4 // 64 + 3  # each rank's half is over one part
    whole = np.arange(2 * rows * 64, dtype=np.float32).reshape(64, 2 * rows)
    assembler = Assembler(make_spec(fields=("u",), parameters=np.zeros((1, 1))))
    for rank, order in enumerate("CF"):
        sender = Sender(0, rank, size=2)
        block = Block((0, rank * rows), (64, 2 * rows), order)
        assembler.handle(sender.control(Kind.DECLARE, block_declaration({"u": ("float32", (64, rows), block)})))
    sample = None
    for rank, order in enumerate("CF"):
        piece = whole[:, rank * rows : (rank + 1) * rows]
        octets = np.asarray(piece, order=order).ravel(order="K").view(np.uint8)
        for offset in range(0, octets.nbytes, PART_BYTES):
            header = Sender(0, rank, 2).data(0, "u", piece)[0]
            fields = Header(**{**unpack_header(header)._asdict(), "payload_bytes": octets.nbytes, "offset": offset})
            sample = assembler.handle([fields.pack(), octets[offset : offset + PART_BYTES].tobytes()])
    assert sample is not None
    np.testing.assert_array_equal(sample.fields["u"], whole)


def test_a_client_rank_whose_block_overlaps_anothers_is_refused_at_its_declaration() -> None:
    assembler = Assembler(make_spec(fields=("u",), parameters=np.zeros((1, 1))))
    first = block_declaration({"u": ("float32", (2, 3), Block((0, 0), (4, 3)))})
    assembler.handle(Sender(0, 0, size=2).control(Kind.DECLARE, first))
    second = block_declaration({"u": ("float32", (3, 3), Block((1, 0), (4, 3)))})
    refused(
        assembler,
        Sender(0, 1, size=2).control(Kind.DECLARE, second),
        "shape",
        "simulation 0, field 'u': the blocks of client ranks 0 and 1 overlap in [1:2, 0:3]",
    )


def test_a_client_rank_that_declares_other_blocks_drops_the_pieces_held_under_the_old_ones() -> None:
    """Pieces received under a declaration would not fit the one that replaces it: the step starts again."""
    assembler = Assembler(make_spec(fields=("u", "v"), parameters=np.zeros((1, 1))))
    sender = Sender(0)
    four = {"u": ("float32", (4,), Block((0,), (4,))), "v": ("float32", (4,), Block((0,), (4,)))}
    two = {"u": ("float32", (2,), Block((0,), (2,))), "v": ("float32", (2,), Block((0,), (2,)))}
    assembler.handle(sender.control(Kind.DECLARE, block_declaration(four)))
    assert assembler.handle(sender.data(0, "u", np.arange(4, dtype=np.float32))) is None
    assert assembler.partial_bytes == 16
    assembler.handle(sender.control(Kind.DECLARE, block_declaration(two)))
    assert assembler.partial_bytes == 0
    assert assembler.handle(sender.data(0, "u", np.arange(2, dtype=np.float32))) is None
    sample = assembler.handle(sender.data(0, "v", np.ones(2, dtype=np.float32)))
    assert_fields(sample, {"u": np.arange(2, dtype=np.float32), "v": np.ones(2, dtype=np.float32)})


def test_a_field_in_blocks_counts_its_global_array_from_its_first_piece_and_is_evicted_whole() -> None:
    """Blocks are written straight into the field's global array, made at the step's first piece: the budget
    counts all of it from then on, and an evicted step frees it."""
    rejections = RejectionLog()
    assembler = Assembler(make_spec(fields=("u",), parameters=np.zeros((1, 1)), max_partial_bytes=100), rejections)
    senders = [Sender(0, rank, size=2) for rank in range(2)]
    for rank, sender in enumerate(senders):
        block = Block((0, 3 * rank), (4, 6))
        assembler.handle(sender.control(Kind.DECLARE, block_declaration({"u": ("float32", (4, 3), block)})))
    wholes = {step: np.arange(24, dtype=np.float32).reshape(4, 6) + 100 * step for step in (0, 1)}
    assert assembler.handle(senders[0].data(0, "u", wholes[0][:, :3])) is None
    assert assembler.partial_bytes == 96  # the whole 4x6 field, from rank 0's 4x3 block
    assert assembler.handle(senders[0].data(1, "u", wholes[1][:, :3])) is None  # step 0 goes
    assert assembler.partial_bytes == 96 and rejections.counts() == {"incomplete": 1}
    sample = assembler.handle(senders[1].data(1, "u", wholes[1][:, 3:]))
    assert sample is not None and sample.time_step == 1
    np.testing.assert_array_equal(sample.fields["u"], wholes[1])
    assert assembler.partial_bytes == 0


def test_a_block_whose_global_array_exceeds_the_partial_budget_is_refused_at_its_declaration() -> None:
    """One client rank's declaration must not make the rank allocate its global array: it is refused, in one line,
    before any piece comes (the rank would otherwise fail on ``np.empty``)."""
    assembler = Assembler(make_spec(fields=("u",), parameters=np.zeros((1, 1)), max_partial_bytes=1 << 20))
    huge = block_declaration({"u": ("float64", (1, 1), Block((0, 0), (1 << 31, 1 << 31)))})
    refused(
        assembler,
        Sender(0, 0, size=2).control(Kind.DECLARE, huge),
        "oversize",
        "simulation 0, field 'u': a global array of 36893488147419103232 bytes a step exceeds "
        "server.max_partial_bytes=1048576",
    )


def windowed_assembler(rank: int = 1, size: int = 2) -> Assembler:
    """Rank ``rank`` of ``size`` of a study trained on windows of 3 steps, in blocks of 4."""
    return Assembler(make_spec(server_rank=rank, server_size=size, block=4, overlap=2, consecutive=True))


def test_with_windows_a_rank_takes_its_blocks_and_the_next_blocks_first_steps_and_counts_those_copies() -> None:
    assembler = windowed_assembler()
    sender = Sender(0)
    assembler.handle(sender.declare())
    taken = []
    for step in range(12):  # simulation 0: blocks 0-3 to rank 0, 4-7 to rank 1, 8-11 to rank 0
        try:
            sample = send_step(assembler, sender, step)
        except ProtocolError as error:
            assert error.kind == "routing"
        else:
            assert sample is not None
            assembler.commit(sample)
            taken.append(step)
    assert taken == [4, 5, 6, 7, 8, 9]
    assert (assembler.ledger.total(), assembler.copies) == (6, 2)
    restored = windowed_assembler()
    restored.load_state_dict(assembler.state_dict())
    assert restored.copies == 2  # recounted from the ledger


def test_with_windows_a_step_that_does_not_follow_the_one_before_it_is_refused() -> None:
    assembler = windowed_assembler(rank=0, size=1)
    sender = Sender(1)
    assembler.handle(sender.declare())
    for step in (0, 1, 2):
        sample = send_step(assembler, sender, step)
        assert sample is not None
        assembler.commit(sample)
    with pytest.raises(ProtocolError) as info:
        send_step(assembler, sender, 4)  # step 3 skipped
    assert info.value.kind == "order"
    assert str(info.value) == (
        "simulation 1, step 4: sent after step 2 without step 3; windows of steps (training.window) need every step, "
        "in order"
    )
    sample = send_step(assembler, sender, 3)  # the step it skipped: it follows
    assert sample is not None and sample.time_step == 3


def test_with_windows_the_first_step_of_a_rank_s_block_follows_nothing_on_it() -> None:
    """Rank 1 of 2 gets simulation 0's steps 4 to 9 only: step 4 is its first, after nothing it holds."""
    assembler = windowed_assembler()
    sender = Sender(0)
    assembler.handle(sender.declare())
    sample = send_step(assembler, sender, 4)
    assert sample is not None and sample.time_step == 4


def test_with_windows_a_step_the_server_evicted_incomplete_is_the_simulations_refusal_not_the_next_steps_order() -> (
    None
):
    """Client rank 0 runs ahead of client rank 1: step 1 is evicted to keep incomplete steps in budget, so step 2
    is refused as out of order; the simulation's refusal says why (an eviction, which a relaunch repairs)."""
    layouts = [{"u": ("float32", (8,)), "v": ("int64", (1, 3))}, {"u": ("float32", (1,)), "v": ("int64", (1, 3))}]
    assembler = Assembler(make_spec(max_partial_bytes=150, block=4, overlap=2, consecutive=True))
    ranks = [Sender(0, r, size=2) for r in range(2)]
    for r, sender in enumerate(ranks):
        assembler.handle(sender.declare(layouts[r]))

    def send(r: int, t: int) -> Sample | None:
        done = None
        for name, array in step_arrays(0, t, layouts[r], r).items():
            done = assembler.handle(ranks[r].data(t, name, array))
        return done

    send(0, 0)
    first = send(1, 0)
    assert first is not None
    assembler.commit(first)
    for t in (1, 2, 3):
        send(0, t)
    assert assembler.rejections.counts() == {"incomplete": 1}
    send(1, 1)  # its other half is gone: it waits again
    with pytest.raises(ProtocolError) as info:
        send(1, 2)
    assert info.value.kind == "order"
    kind, message = assembler.take_refused()[0]
    assert kind == "incomplete" and message.startswith("simulation 0, step 1: 2 pieces evicted incomplete")


def test_with_windows_a_step_a_restart_left_out_of_the_ledger_comes_again_and_the_stream_goes_on() -> None:
    """After a restart on another number of ranks, the ledger may hold steps 0-9 and 11-20 (step 10: a copy that
    never reached its rank): the relaunched simulation's step 10 is taken, then its step 21."""
    assembler = windowed_assembler(rank=0, size=1)
    ledger = Ledger()
    for t in [*range(10), *range(11, 21)]:
        ledger.add(1, t)
    assembler.load_state_dict({"ledger": ledger.state_dict(), "bytes_received": 0, "duplicates": 0})
    sender = Sender(1)
    assembler.handle(sender.declare())
    for t in (10, 21):
        sample = send_step(assembler, sender, t)
        assert sample is not None and sample.time_step == t
        assembler.commit(sample)


def test_with_windows_and_simulations_bound_to_ranks_nothing_is_a_copy_after_a_restart() -> None:
    spec = make_spec(server_rank=1, server_size=2, bind_simulation=True, block=4, overlap=2, consecutive=True)
    assembler = Assembler(spec)
    sender = Sender(1)
    assembler.handle(sender.declare())
    for t in range(6):
        sample = send_step(assembler, sender, t)
        assert sample is not None
        assembler.commit(sample)
    restored = Assembler(spec)
    restored.load_state_dict(assembler.state_dict())
    assert (restored.ledger.total(), restored.copies, assembler.copies) == (6, 0, 0)
