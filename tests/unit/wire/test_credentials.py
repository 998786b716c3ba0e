"""The security level's credentials, checks and numbers (no sockets)."""

from __future__ import annotations

import json

import pytest
import zmq
from zmq.utils import z85

from melissa_dl.wire.protocol import MAX_KEEPALIVE, PROTOCOL_VERSION, keepalive
from melissa_dl.wire.security import Security, hello_bytes

TOKEN = bytes(range(32))


def test_the_token_level_admits_plain_with_the_token_only() -> None:
    security = Security.generate("token", TOKEN)
    assert security.client_environment() == {"MELISSA_SECURITY": "token"}
    assert security.admits(b"PLAIN", [b"anyone", TOKEN.hex().encode()])
    assert not security.admits(b"PLAIN", [b"melissa", TOKEN.hex().encode()[:-1] + b"0"])
    assert not security.admits(b"PLAIN", [b"melissa"])
    assert not security.admits(b"NULL", [])
    assert not security.admits(b"CURVE", [bytes(32)])


def test_the_curve_level_admits_the_studys_client_key_only() -> None:
    security = Security.generate("curve", TOKEN)
    environ = security.client_environment()
    assert environ["MELISSA_SECURITY"] == "curve"
    assert environ["MELISSA_CURVE_SERVER_KEY"] == security.server_public.decode()
    public, secret = environ["MELISSA_CURVE_PUBLIC_KEY"], environ["MELISSA_CURVE_SECRET_KEY"]
    assert zmq.curve_public(secret.encode()) == public.encode()  # a keypair
    assert len({public, environ["MELISSA_CURVE_SERVER_KEY"]}) == 2
    assert security.admits(b"CURVE", [z85.decode(public)])
    assert not security.admits(b"CURVE", [z85.decode(zmq.curve_keypair()[0])])
    assert not security.admits(b"PLAIN", [b"melissa", TOKEN.hex().encode()])
    assert Security.generate("curve", TOKEN).client_public != security.client_public  # drawn per study
    assert "secret" not in repr(security) and security.server_secret.decode() not in repr(security)


@pytest.mark.parametrize(
    "timeout, held",
    [
        (300.0, MAX_KEEPALIVE),  # a client behind a slow server hears from it every few seconds
        (1.0, 0.25),  # well inside the client's timeout, after which it takes a silent rank for dead
    ],
)
def test_a_question_is_held_well_inside_the_client_timeout(timeout: float, held: float) -> None:
    assert keepalive(timeout) == held


def test_the_hello_cap_holds_the_largest_hello_of_the_studys_fields() -> None:
    fields = [f"f{i}" for i in range(3000)] + ["température 😀" * 20]
    hello = {
        "protocol": PROTOCOL_VERSION,
        "token": "ab" * 255,
        "simulation_id": 2**32 - 1,
        "attempt": 2**32 - 1,
        "client_rank": 65534,
        "client_size": 65535,
        "fields": {name: ["float64", [2**32 - 1] * 6] for name in fields},
    }
    assert len(json.dumps(hello).encode()) < hello_bytes(fields)
    assert hello_bytes(["field"]) < 80 << 10  # what a peer may make the socket read before it logs in
