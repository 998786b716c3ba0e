"""The security level's credentials, checks and numbers (no sockets)."""
from __future__ import annotations

import json

import pytest
import zmq
from zmq.utils import z85

from melissa_dl.security import MAX_TTL_MS, Security, heartbeat_ms, hello_bytes

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


@pytest.mark.parametrize("timeout, interval, ttl", [
    (300.0, 30_000, 150_000),  # a frozen server is dropped after half the client timeout
    (1.0, 100, 500),
    (0.05, 20, 100),  # the TTL travels in deciseconds
    (1e6, MAX_TTL_MS // 5, MAX_TTL_MS),  # on 16 bits
])
def test_heartbeats_follow_the_client_timeout(timeout: float, interval: int, ttl: int) -> None:
    assert heartbeat_ms(timeout) == (interval, ttl)


def test_the_hello_cap_holds_the_largest_hello_of_the_studys_fields() -> None:
    fields = [f"f{i}" for i in range(3000)] + ["température 😀" * 20]
    hello = {"protocol": 2, "token": "ab" * 255, "simulation_id": 2**32 - 1, "attempt": 2**32 - 1,
             "client_rank": 65534, "client_size": 65535,
             "fields": {name: ["float64", [2**32 - 1] * 6] for name in fields}}
    assert len(json.dumps(hello).encode()) < hello_bytes(fields)
    assert hello_bytes(["field"]) < 300 << 10
