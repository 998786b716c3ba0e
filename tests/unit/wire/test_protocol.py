"""The data protocol's fixed header, credentials, routing rule and layout checks."""

from __future__ import annotations

import hashlib
import hmac
import itertools
import struct

import numpy as np
import pytest

from melissa_dl.errors import ProtocolError
from melissa_dl.wire.protocol import (
    DTYPES,
    HEADER_BYTES,
    KEY_BYTES,
    MAGIC,
    MAX_NDIM,
    PROTOCOL_VERSION,
    Header,
    Kind,
    Route,
    check_layout,
    decode_json,
    encode_json,
    payload_bytes,
    simulation_key,
    unpack_header,
)

pytestmark = pytest.mark.timeout(60)

TOKEN = bytes(range(32))
SHAPES = [(), (7,), (2, 3), (1, 2, 3), (4, 1, 2, 3), (1, 2, 3, 4, 5), (6, 5, 4, 3, 2, 1)]
# Offsets and struct formats of the little-endian header fields that clients in other languages rely on.
WIRE = {
    "magic": (0, "4s"),
    "version": (4, "<H"),
    "kind": (6, "B"),
    "dtype": (7, "B"),
    "key": (8, f"{KEY_BYTES}s"),
    "simulation_id": (16, "<I"),
    "attempt": (20, "<I"),
    "time_step": (24, "<I"),
    "client_rank": (28, "<H"),
    "client_size": (30, "<H"),
    "field_id": (32, "<H"),
    "ndim": (34, "B"),
    "payload_bytes": (35 + 4 * MAX_NDIM, "<Q"),
    "offset": (43 + 4 * MAX_NDIM, "<Q"),
}


def header(**overrides: object) -> Header:
    fields = dict(
        kind=Kind.DATA,
        key=simulation_key(TOKEN, 5, 7),
        simulation_id=5,
        attempt=7,
        time_step=11,
        client_rank=1,
        client_size=3,
        field_id=2,
        dtype="float64",
        shape=(2, 3),
        payload_bytes=48,
        offset=0,
    )
    fields.update(overrides)
    return Header(**fields)  # type: ignore[arg-type]


def patched(name: str, value: object) -> bytes:
    """A valid packed header with one wire field overwritten."""
    data = bytearray(header().pack())
    offset, fmt = WIRE[name]
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


@pytest.mark.parametrize("kind, shape", list(itertools.product(Kind, SHAPES)))
def test_header_round_trip(kind: Kind, shape: tuple[int, ...]) -> None:
    sent = header(kind=kind, shape=shape, dtype=DTYPES[len(shape) % len(DTYPES)])
    packed = sent.pack()
    assert len(packed) == HEADER_BYTES
    received = unpack_header(memoryview(packed))
    assert received == sent
    assert received.kind is kind and isinstance(received.shape, tuple)


def test_header_round_trip_at_the_field_limits() -> None:
    sent = header(
        simulation_id=(1 << 32) - 1,
        attempt=(1 << 32) - 1,
        time_step=(1 << 32) - 1,
        client_rank=(1 << 16) - 2,
        client_size=(1 << 16) - 1,
        field_id=(1 << 16) - 1,
        shape=((1 << 32) - 1,) * MAX_NDIM,
        payload_bytes=(1 << 64) - 1,
        dtype=DTYPES[-1],
        offset=(1 << 64) - 1,
    )
    assert unpack_header(sent.pack()) == sent


def test_header_wire_layout_is_fixed_little_endian() -> None:
    packed = header().pack()
    assert HEADER_BYTES == 35 + 4 * MAX_NDIM + 16
    decoded = {name: struct.unpack_from(fmt, packed, offset)[0] for name, (offset, fmt) in WIRE.items()}
    assert decoded == {
        "magic": MAGIC,
        "version": PROTOCOL_VERSION,
        "kind": int(Kind.DATA),
        "dtype": DTYPES.index("float64"),
        "key": simulation_key(TOKEN, 5, 7),
        "simulation_id": 5,
        "attempt": 7,
        "time_step": 11,
        "client_rank": 1,
        "client_size": 3,
        "field_id": 2,
        "ndim": 2,
        "payload_bytes": 48,
        "offset": 0,
    }
    assert struct.unpack_from(f"<{MAX_NDIM}I", packed, 35) == (2, 3, 0, 0, 0, 0)


@pytest.mark.parametrize(
    "frame, kind, message",
    [
        (header().pack()[:-1], "malformed", f"header of {HEADER_BYTES - 1} bytes instead of {HEADER_BYTES}"),
        (header().pack() + b"\0", "malformed", f"header of {HEADER_BYTES + 1} bytes"),
        (b"", "malformed", "header of 0 bytes"),
        (patched("magic", b"MLDX"), "malformed", "bad magic b'MLDX'"),
        (patched("version", PROTOCOL_VERSION + 1), "version", f"version {PROTOCOL_VERSION + 1}, server speaks"),
        (patched("kind", 0), "malformed", "kind 0"),
        (patched("kind", max(Kind) + 1), "malformed", f"kind {max(Kind) + 1}"),
        (patched("dtype", len(DTYPES)), "malformed", f"dtype code {len(DTYPES)}"),
        (patched("ndim", MAX_NDIM + 1), "malformed", f"ndim {MAX_NDIM + 1}"),
        (patched("client_rank", 3), "malformed", "client rank 3 of 3"),
        (patched("client_size", 0), "malformed", "client rank 1 of 0"),
    ],
    ids=[
        "short",
        "long",
        "empty",
        "magic",
        "version",
        "kind-0",
        "kind-high",
        "dtype",
        "ndim",
        "crank=csize",
        "csize-0",
    ],
)
def test_unpack_refuses_bad_headers(frame: bytes, kind: str, message: str) -> None:
    with pytest.raises(ProtocolError) as info:
        unpack_header(frame)
    assert info.value.kind == kind
    assert message in str(info.value)


def test_simulation_key_is_a_deterministic_per_attempt_credential() -> None:
    pairs = [(s, a) for s in range(500) for a in range(4)]
    keys = [simulation_key(TOKEN, s, a) for s, a in pairs]
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    assert keys == [simulation_key(bytes(TOKEN), s, a) for s, a in pairs]
    assert len(set(keys)) == len(keys)  # a dead attempt's key opens nothing for the next one
    assert simulation_key(TOKEN[:-1] + b"\0", 0, 0) != keys[0]
    assert simulation_key(b"another token", 499, 3) != keys[-1]
    assert simulation_key(TOKEN, (1 << 32) - 1, 0) not in keys
    expected = hmac.new(TOKEN, (5).to_bytes(4, "little") + (7).to_bytes(4, "little"), hashlib.sha256).digest()[:8]
    assert simulation_key(TOKEN, 5, 7) == expected  # the C library computes the same


@pytest.mark.parametrize("server_size", [1, 2, 3, 5])
def test_owner_rank_spreads_steps_over_all_ranks(server_size: int) -> None:
    for sim in range(7):
        owners = [Route(server_size).owner(sim, step) for step in range(4 * server_size)]
        assert all(0 <= r < server_size for r in owners)
        # consecutive steps of one simulation visit every rank in turn, and simulations start staggered
        assert sorted(owners[:server_size]) == list(range(server_size))
        assert owners[0] == sim % server_size
        assert owners == owners[:server_size] * 4


@pytest.mark.parametrize("server_size", [1, 2, 3, 5])
def test_owner_rank_binds_every_step_to_s_mod_k(server_size: int) -> None:
    for sim in range(12):
        assert {Route(server_size, bind_simulation=True).owner(sim, step) for step in range(50)} == {sim % server_size}


def test_owner_rank_examples() -> None:
    assert Route(4).owner(3, 4) == 3
    assert Route(4, bind_simulation=True).owner(3, 4) == 3
    assert Route(4).owner(3, 6) == 1
    assert Route(3).owner((1 << 32) - 1, (1 << 32) - 1) == ((1 << 33) - 2) % 3
    assert Route(3).ranks(5, 7) == (0,)  # without windows, one rank per step


@pytest.mark.parametrize("server_size", [1, 2, 3])
def test_routing_with_windows_gives_each_rank_its_blocks_and_the_next_blocks_first_steps(server_size: int) -> None:
    """Blocks of 8 steps go round the ranks; each block's rank also gets the next block's first 3 steps (a window
    of 4 less one), and ``holds`` says the same as ``ranks``."""
    route = Route(server_size, block=8, overlap=3)
    for sim in range(4):
        for step in range(64):
            block = step // 8
            expected = [(sim + block) % server_size]
            if server_size > 1 and block and step % 8 < 3:
                expected.append((sim + block - 1) % server_size)
            assert list(route.ranks(sim, step)) == expected
            for rank in range(server_size):
                assert bool(route.holds(rank, sim, np.array([step]))[0]) == (rank in expected)
        # every window of 4 steps has all its steps on the rank of its first
        for start in range(61):
            owner = route.owner(sim, start)
            assert all(owner in route.ranks(sim, s) for s in range(start, start + 4))
    assert Route(2, bind_simulation=True, block=8, overlap=3).ranks(1, 9) == (1,)


@pytest.mark.parametrize(
    "decl, expected",
    [
        (["float32", []], ("float32", ())),
        (["uint8", [0]], ("uint8", (0,))),
        (["float64", [2, 4]], ("float64", (2, 4))),
        (["int16", [1] * MAX_NDIM], ("int16", (1,) * MAX_NDIM)),
    ],
)
def test_check_layout_accepts_valid_declarations(decl: list, expected: tuple) -> None:
    assert check_layout("field 'u'", decl, max_bytes=64) == expected


@pytest.mark.parametrize(
    "decl, kind",
    [
        ("float32", "malformed"),
        (["float32"], "malformed"),
        (["float32", 3], "malformed"),
        (["float32", (3,)], "malformed"),
        (["float32", [3], {}, "C"], "malformed"),  # a third element is a block's (melissa_dl.wire.blocks)
        (["complex64", [3]], "dtype"),
        ([None, [3]], "dtype"),
        (["float32", [-1]], "shape"),
        (["float32", [2.0]], "shape"),
        (["float32", ["2"]], "shape"),
        (["float32", [1 << 32]], "shape"),
        (["float32", [1] * (MAX_NDIM + 1)], "shape"),
        (["float64", [9]], "oversize"),
        (["int8", [5, 13]], "oversize"),
    ],
)
def test_check_layout_refusals(decl: object, kind: str) -> None:
    with pytest.raises(ProtocolError) as info:
        check_layout("simulation 4, field 'u'", decl, max_bytes=64)
    assert info.value.kind == kind
    assert str(info.value).startswith("simulation 4, field 'u': ")


def test_check_layout_oversize_names_the_limit() -> None:
    assert check_layout("f", ["float64", [8]], max_bytes=64) == ("float64", (8,))
    with pytest.raises(ProtocolError, match=r"72 bytes per step exceed server.max_message_bytes=64"):
        check_layout("f", ["float64", [9]], max_bytes=64)


def test_check_layout_refuses_shapes_whose_size_overflows_int64() -> None:
    huge = (1 << 32) - 1
    assert payload_bytes("float32", (huge, huge)) == huge * huge * 4
    with pytest.raises(ProtocolError) as info:
        check_layout("f", ["float32", [huge, huge]], max_bytes=1 << 26)
    assert info.value.kind == "oversize"


@pytest.mark.parametrize(
    "dtype, shape, expected",
    [("float32", (), 4), ("float64", (3, 4), 96), ("uint8", (5, 0, 2), 0), ("int16", (7,), 14)],
)
def test_payload_bytes(dtype: str, shape: tuple[int, ...], expected: int) -> None:
    assert payload_bytes(dtype, shape) == expected


def test_json_payloads_round_trip_compactly() -> None:
    body = {"fields": {"u": ["float32", [2, 3]]}, "steps": 4}
    encoded = encode_json(body)
    assert b" " not in encoded
    assert decode_json(memoryview(encoded), "declaration") == body


@pytest.mark.parametrize("payload", [b"{not json", b"", b"\xff\xfe", b'{"a": 1} trailing'])
def test_decode_json_refusal_is_the_senders_fault(payload: bytes) -> None:
    with pytest.raises(ProtocolError) as info:
        decode_json(payload, "simulation 2 finalize")
    assert info.value.kind == "malformed"
    assert str(info.value).startswith("simulation 2 finalize: invalid JSON")


def test_decode_json_refuses_deeply_nested_payloads() -> None:
    with pytest.raises(ProtocolError) as info:
        decode_json(b"[" * 100_000, "declaration")
    assert info.value.kind == "malformed"
