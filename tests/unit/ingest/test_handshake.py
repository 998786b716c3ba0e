"""Rank 0's handshake checks, called directly (no socket): every refusal counted, none fatal to the thread."""

from __future__ import annotations

import json
from typing import Any

import pytest

from melissa_dl.ingest.handshake import HandshakeServer
from melissa_dl.wire.protocol import PROTOCOL_VERSION, encode_json

pytestmark = pytest.mark.timeout(60)

TOKEN = bytes(range(32))
FIELDS = ["u", "v"]
GOOD = {"u": ["float32", [4, 8]], "v": ["int64", []]}


def service(
    client_size: int = 1, layouts: dict[str, Any] | None = None, predictions: dict[str, Any] | None = None
) -> HandshakeServer:
    handshake = HandshakeServer(
        token=TOKEN,
        fields=FIELDS,
        simulations=4,
        endpoints=[("tcp://a:1", "tcp://a:3"), ("tcp://a:2", "tcp://a:4")],
        bind_simulation=False,
        max_message_bytes=1 << 20,
        bind_address="127.0.0.1",
        client_size=client_size,
        layouts=layouts,
        predictions=predictions,
    )
    for sim in range(3):
        handshake.expect(sim, 0)
    return handshake


def hello(**change: Any) -> dict[str, Any]:
    return {
        "protocol": PROTOCOL_VERSION,
        "token": TOKEN.hex(),
        "simulation_id": 0,
        "attempt": 0,
        "client_rank": 0,
        "client_size": 1,
        "fields": GOOD,
        **change,
    }


def ask(handshake: HandshakeServer, message: Any) -> dict[str, Any]:
    request = message if isinstance(message, bytes) else encode_json(message)
    return handshake.answer([request])


def test_a_good_hello_gets_the_data_and_delivery_endpoints() -> None:
    reply = ask(service(), hello())
    assert reply == {
        "ok": True,
        "endpoints": ["tcp://a:1", "tcp://a:2"],
        "acks": ["tcp://a:3", "tcp://a:4"],
        "fields": FIELDS,
        "bind_simulation": False,
        "block": 1,
        "overlap": 0,
        "predictions": None,  # no serving.online
    }


def test_with_online_serving_a_good_hello_also_gets_the_prediction_services() -> None:
    predictions = {"endpoints": ["tcp://a:5", "tcp://a:6"], "inputs": {"x": ["float32", [3]]}, "max_batch": 8}
    assert ask(service(predictions=predictions), hello())["predictions"] == predictions


BAD_HELLOS: dict[str, tuple[Any, str, str]] = {
    # name: (request, kind, part of the message)
    "lone surrogate token": (b'{"protocol": 4, "token": "\\ud800"}', "credentials", "bad or missing token"),
    "non-ASCII token": (hello(token="\u00e9" * 64), "credentials", "bad or missing token"),
    "token not a string": (hello(token=[1]), "credentials", "bad or missing token"),
    "deep JSON": (b"[" * 100_000 + b"]" * 100_000, "malformed", "invalid JSON"),
    "not an object": ([1, 2], "malformed", "expected a JSON object"),
    "bool as an integer": (hello(client_rank=True), "malformed", "must be integers"),
    "attempt missing": (hello(attempt=None), "malformed", "must be integers"),
    "huge version": (hello(protocol="9" * 10**6), "version", "... (1000002 characters)"),
    "unknown simulation": (hello(simulation_id=7), "unknown_simulation", "simulation 7 is not in the study"),
    "not launched": (hello(simulation_id=3), "not_expected", "simulation 3 is not expected"),
    "dead attempt": (hello(attempt=1), "stale_attempt", "attempt 1, the running one is 0"),
}


@pytest.mark.parametrize("name", list(BAD_HELLOS))
def test_a_bad_hello_is_a_counted_refusal_that_fails_no_simulation(name: str) -> None:
    request, kind, message = BAD_HELLOS[name]
    handshake = service()
    reply = ask(handshake, request)
    assert (reply["ok"], reply["kind"]) == (False, kind)
    assert message in reply["error"] and len(json.dumps(reply)) < 600
    assert handshake.rejections.counts() == {f"handshake_{kind}": 1}
    assert handshake.take_failures() == []
    assert ask(handshake, hello())["ok"]  # the service goes on


DETERMINISTIC: dict[str, tuple[dict[str, Any], str, str]] = {
    "unknown field": (hello(fields={**GOOD, "w" * 5000: GOOD["u"]}), "unknown_field", "... (5002 characters)"),
    "missing field": (hello(fields={"u": GOOD["u"]}), "missing_field", "field 'v' missing"),
    "dtype outside the protocol": (hello(fields={**GOOD, "u": ["complex64", [4]]}), "dtype", "'complex64'"),
    "oversize": (hello(fields={**GOOD, "u": ["float32", [1 << 20]]}), "oversize", "4194304 bytes per step"),
    "oversize global array": (
        hello(fields={**GOOD, "u": ["float32", [4, 8], {"start": [0, 0], "global": [1 << 16, 1 << 16]}]}),
        "oversize",
        "field 'u': a global array of 17179869184 bytes a step exceeds server.max_partial_bytes=268435456",
    ),
    "forgot comm=": (
        hello(client_size=2, client_rank=1),
        "client_size",
        "client rank 1 of 2, but launcher.client_ranks is 1",
    ),
}


@pytest.mark.parametrize("name", list(DETERMINISTIC))
def test_a_refusal_a_relaunch_would_meet_again_fails_the_simulation(name: str) -> None:
    request, kind, message = DETERMINISTIC[name]
    handshake = service()
    reply = ask(handshake, request)
    assert (reply["ok"], reply["kind"]) == (False, kind) and message in reply["error"]
    assert handshake.take_failures() == [(0, reply["error"])]
    assert handshake.take_failures() == []


def test_a_parallel_simulation_that_forgot_comm_is_refused_by_the_size_it_claims() -> None:
    handshake = service(client_size=2)
    reply = ask(handshake, hello())  # every MPI rank says it is rank 0 of 1
    assert reply["kind"] == "client_size"
    assert "did not pass comm= to Client" in reply["error"]
    assert handshake.take_failures() == [(0, reply["error"])]


def test_the_same_client_rank_twice_in_one_attempt_is_refused_and_a_relaunch_starts_afresh() -> None:
    handshake = service(client_size=2)
    rows = {**GOOD, "v": ["int64", [1]]}
    assert ask(handshake, hello(client_size=2, fields=rows))["ok"]
    reply = ask(handshake, hello(client_size=2, fields=rows))
    assert reply["kind"] == "twice" and "client rank 0 of 2 said hello twice" in reply["error"]
    assert handshake.take_failures() == [(0, reply["error"])]
    handshake.expect(0, 1)  # the study relaunched it
    assert ask(handshake, hello(client_size=2, attempt=1, fields=rows))["ok"]
    assert ask(handshake, hello(client_size=2, attempt=1, client_rank=1, fields=rows))["ok"]


def test_a_hello_sent_again_with_its_nonce_is_answered_again_and_another_process_is_refused() -> None:
    """A client whose connection was lost sends its hello again, with the nonce it drew; a second process claiming
    the same rank draws another."""
    handshake = service(client_size=2)
    rows = {**GOOD, "v": ["int64", [1]]}
    first = ask(handshake, hello(client_size=2, fields=rows, nonce="a1"))
    assert first["ok"] and ask(handshake, hello(client_size=2, fields=rows, nonce="a1")) == first
    reply = ask(handshake, hello(client_size=2, fields=rows, nonce="b2"))
    assert reply["kind"] == "twice"
    assert ask(handshake, hello(client_size=2, client_rank=1, fields=rows, nonce="c3"))["ok"]


def test_the_same_nonce_with_other_fields_is_still_a_second_hello() -> None:
    handshake = service(client_size=2)
    assert ask(handshake, hello(client_size=2, nonce="a1", fields={**GOOD, "v": ["int64", [1]]}))["ok"]
    reply = ask(handshake, hello(client_size=2, nonce="a1", fields={**GOOD, "v": ["int64", [2]]}))
    assert reply["kind"] == "twice"


@pytest.mark.parametrize("nonce", [7, "", "x" * 65, "é", ["a"]])
def test_a_nonce_that_is_not_a_short_ascii_string_is_malformed(nonce: Any) -> None:
    reply = ask(service(), hello(nonce=nonce))
    assert reply["kind"] == "malformed" and "nonce" in reply["error"]


def test_the_first_complete_simulation_pins_each_fields_dtype_and_shape() -> None:
    handshake = service(client_size=2)
    halves = [{"u": ["float32", [2, 8]], "v": ["int64", [1]]}, {"u": ["float32", [3, 8]], "v": ["int64", [1]]}]
    assert ask(handshake, hello(client_size=2, client_rank=1, fields=halves[1]))["ok"]
    assert ask(handshake, hello(client_size=2, client_rank=0, fields=halves[0]))["ok"]  # pins u: float32[5, 8]
    assert ask(handshake, hello(simulation_id=1, client_size=2, fields=halves[1]))["ok"]  # 3 of 5 rows so far
    reply = ask(handshake, hello(simulation_id=1, client_size=2, client_rank=1, fields=halves[1]))
    assert reply["kind"] == "shape"
    assert "simulation 1, field 'u': declares float32[6, 8], the study's is float32[5, 8]" in reply["error"]
    reply = ask(handshake, hello(simulation_id=2, client_size=2, fields={**halves[0], "u": ["float64", [2, 8]]}))
    assert reply["kind"] == "dtype" and "float64[2, 8] so far, the study's is float32[5, 8]" in reply["error"]
    assert [sim for sim, _ in handshake.take_failures()] == [1, 2]


def test_slices_that_cannot_join_are_refused() -> None:
    handshake = service(client_size=2)
    assert ask(handshake, hello(client_size=2, fields={**GOOD, "v": ["int64", [2]]}))["ok"]
    reply = ask(
        handshake, hello(client_size=2, client_rank=1, fields={**GOOD, "v": ["int64", [2]], "u": ["float32", [4, 9]]})
    )
    assert (
        reply["kind"] == "shape"
        and "client rank 1 declares float32[4, 9], rank 0 float32[4, 8]: slices cannot be joined on axis 0"
        in reply["error"]
    )
    reply = ask(handshake, hello(simulation_id=1, client_size=2))  # v is 0-d: nothing to stack on axis 0
    assert reply["kind"] == "shape" and "client rank 0 declares int64[]" in reply["error"]


def test_1d_slices_against_a_field_of_more_dimensions_are_refused_with_the_1d_rule() -> None:
    """Melissa's API sends 1-D slices (issue 57, item 3): ``declares float64[5000] so far`` alone hid why."""
    handshake = service(client_size=2, layouts={"u": ("float64", (100, 100))})
    reply = ask(handshake, hello(client_size=2, fields={**GOOD, "u": ["float64", [5000]]}))
    assert reply["kind"] == "shape"
    assert reply["error"].endswith(
        "field 'u': declares float64[5000] so far, the study's is float64[100, 100] (1-D slices, as Melissa's API "
        "always sends, join into a 1-D field: give the field's shape as [10000] and reshape it in the training "
        "module, or declare blocks)"
    ), reply["error"]


def test_configured_layouts_are_pinned_before_any_simulation() -> None:
    handshake = service(layouts={"u": ("float32", (4, 8))})
    reply = ask(handshake, hello(fields={**GOOD, "u": ["float32", [8, 4]]}))
    assert reply["kind"] == "shape"
    assert "simulation 0, field 'u': declares float32[8, 4], the study's is float32[4, 8]" in reply["error"]
    assert ask(handshake, hello(simulation_id=1))["ok"]
    reply = ask(handshake, hello(simulation_id=2, fields={**GOOD, "v": ["int32", []]}))
    assert reply["kind"] == "dtype" and "field 'v': declares int32[], the study's is int64[]" in reply["error"]
