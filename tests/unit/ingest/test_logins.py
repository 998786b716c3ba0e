"""A socket's connections followed from its monitor's events: who is logging in, and how each refused one ended."""

from __future__ import annotations

import pytest

from melissa_dl.ingest.connections import Logins

pytestmark = pytest.mark.timeout(30)


def test_a_login_admitted_then_ended_is_no_refusal() -> None:
    logins = Logins()
    assert logins.accepted(7, "10.0.0.1") is None
    logins.admitted.append("10.0.0.1")
    logins.succeeded()
    assert logins.accepted(8, "10.0.0.1") is None  # pending: 1
    assert logins.ended(7) is False
    assert logins.open == 1


def test_an_end_while_logging_in_with_no_reason_of_its_own_is_a_cut() -> None:
    logins = Logins()
    logins.accepted(7, "10.0.0.1")
    assert logins.ended(7) is True
    assert logins.open == 0


def test_a_failed_login_or_a_zap_refusal_explains_the_end_that_follows() -> None:
    logins = Logins()
    logins.accepted(7, "10.0.0.1")
    logins.accepted(8, "10.0.0.1")
    logins.failed()
    assert logins.ended(7) is False  # its failure was counted with its own event
    logins.refused()
    logins.accepted(9, "10.0.0.2")
    assert logins.ended(8) is False  # the ZAP handler counted it
    assert logins.ended(9) is True


def test_a_connection_closed_before_its_host_was_read_is_still_followed() -> None:
    logins = Logins(per_host=1, in_all=1)
    assert logins.accepted(7, "10.0.0.1") is None
    assert logins.accepted(8, "") is None  # closed by ZeroMQ already: never capped
    assert logins.ended(8) is True


def test_a_slow_peer_of_another_host_does_not_take_the_logins_of_the_study() -> None:
    logins = Logins()
    logins.accepted(5, "10.0.0.9")  # an outsider, logging in slowly
    logins.accepted(6, "10.0.0.1")
    logins.admitted.append("10.0.0.1")
    logins.succeeded()
    assert logins.accepted(7, "10.0.0.1") is None
    assert logins.ended(6) is False  # the study's client logged in
    assert logins.ended(5) is True
    assert logins.ended(7) is True


def test_logins_are_capped_per_host_and_in_all() -> None:
    logins = Logins(per_host=2, in_all=3)
    assert logins.accepted(1, "a") is None and logins.accepted(2, "a") is None
    assert logins.accepted(3, "a") == "2 connections from a still logging in, at most 2"
    assert logins.accepted(4, "b") is None
    assert logins.accepted(5, "c") == "3 connections still logging in, at most 3"
    logins.admitted.append("a")
    logins.succeeded()  # one of a's logged in: a and the whole socket have room again
    assert logins.accepted(6, "a") is None
    assert logins.accepted(7, "c") == "3 connections still logging in, at most 3"
    assert logins.ended(4) is True
    assert logins.accepted(7, "c") is None
    assert logins.open == 4


def test_logins_that_end_out_of_order_are_no_refusals() -> None:
    """Found with a study of two-rank clients: the newer of two connections logged in and ended first."""
    logins = Logins()
    logins.accepted(52, "127.0.0.1")
    logins.accepted(53, "127.0.0.1")
    logins.admitted.append("127.0.0.1")
    logins.succeeded()  # 53's
    assert logins.ended(53) is False
    logins.admitted.append("127.0.0.1")
    logins.succeeded()  # 52's
    assert logins.ended(52) is False


def test_a_login_of_a_connection_whose_host_was_never_read_is_no_refusal() -> None:
    logins = Logins()
    logins.accepted(9, "127.0.0.1")  # still logging in
    logins.accepted(8, "")  # accepted, logged in and ended before the guard read its events
    logins.admitted.append("127.0.0.1")
    logins.succeeded()
    assert logins.ended(8) is False
    assert logins.waiting("127.0.0.1") == 1
    assert logins.ended(9) is True


def test_peers_of_this_host_are_under_the_cap_of_all_only() -> None:
    logins = Logins(per_host=1, in_all=2)
    assert logins.accepted(1, "127.0.0.1", remote=False) is None
    assert logins.accepted(2, "127.0.0.1", remote=False) is None  # the launcher's simulations run here
    assert logins.accepted(3, "127.0.0.1", remote=False) == "2 connections still logging in, at most 2"
