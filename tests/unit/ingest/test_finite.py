"""The receiver's non-finite check: one bad value anywhere in a field, of any float dtype, is found."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from melissa_dl.ingest import finite
from melissa_dl.ingest.finite import all_finite

pytestmark = pytest.mark.timeout(60)

BAD = [np.nan, np.inf, -np.inf]


@pytest.fixture(params=["compiled", "numpy"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both paths, on fields of any size: the compiled loop, and numpy's check (small fields, or numba failing)."""
    monkeypatch.setattr(finite, "COMPILED_FROM", 0)
    if request.param == "numpy":
        monkeypatch.setattr(finite, "ready_loop", lambda: None)
    else:
        assert finite.compiled_loop() is not None
        monkeypatch.setattr(finite, "ready_loop", finite.compiled_loop)
    return request.param


@pytest.mark.parametrize("dtype", ["float16", "float32", "float64", ">f4", "<f8"])
def test_one_bad_value_anywhere_is_found_and_extreme_finite_values_are_not(dtype: str, path: str) -> None:
    info = np.finfo(dtype)
    values = np.random.default_rng(0).uniform(-1, 1, (33, 65)).astype(dtype)
    values[0, :6] = [info.max, -info.max, info.smallest_subnormal, -info.smallest_subnormal, -0.0, info.min]
    for good in (values, values[:, ::2], values.T, values[:0], values[3, 4]):
        assert all_finite(good)
    for bad in BAD:
        for where in [(0, 0), (16, 31), (32, 64)]:
            spoiled = values.copy()
            spoiled[where] = bad
            assert not all_finite(spoiled) and not all_finite(spoiled.T) and not all_finite(spoiled[where])


def test_every_nan_bit_pattern_is_found(path: str) -> None:
    # signalling, quiet, and negative NaNs
    bits = np.array([0x7F800001, 0x7FBFFFFF, 0x7FC00000, 0xFFFFFFFF, 0xFF800001], np.uint32)
    for pattern in bits:
        field = np.zeros(1000, np.float32)
        field.view(np.uint32)[500] = pattern
        assert np.isnan(field[500]) and not all_finite(field)


def test_integer_fields_are_finite() -> None:
    assert all_finite(np.array([np.iinfo(np.int64).max, -1]))


def test_a_large_field_is_checked_by_the_compiled_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    loop = finite.compiled_loop()
    assert loop is not None
    monkeypatch.setattr(finite, "ready_loop", lambda: calls.append(1) or loop)
    field = np.zeros(finite.COMPILED_FROM // 4, np.float32)
    assert all_finite(field) and all_finite(field[:-1]) and calls == [1]  # the smaller one: numpy's check
    field[-1] = np.inf
    assert not all_finite(field) and calls == [1, 1]


def test_the_loop_compiles_in_a_thread_of_its_own_while_numpy_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A compile that takes long holds up no field: numpy checks them until the loop is ready, then the loop."""
    loop = finite.compiled_loop()
    assert loop is not None
    go, used = threading.Event(), []

    def slow_compile() -> object:
        go.wait(30)
        return lambda array, magnitude: used.append(1) or loop(array, magnitude)

    monkeypatch.setattr(finite, "compiled_loop", slow_compile)
    monkeypatch.setattr(finite, "_compiler", None)
    field = np.zeros(finite.COMPILED_FROM // 4, np.float32)
    field[7] = np.nan
    assert not all_finite(field) and finite.ready_loop() is None and used == []  # compiling: numpy's check
    compiler = finite._compiler
    assert compiler is not None and compiler.name == "finite-compile"
    go.set()
    compiler.join(30)
    assert not all_finite(field) and used == [1] and finite._compiler is compiler  # compiled once


def test_a_declaration_compiles_the_loop_only_for_a_float_field_that_will_take_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = []
    monkeypatch.setattr(finite, "ready_loop", lambda: calls.append(1))
    finite.prepare("float32", (finite.COMPILED_FROM // 4 - 1,))  # a byte short: numpy's check
    finite.prepare("int64", (finite.COMPILED_FROM,))
    assert calls == []
    finite.prepare("float64", (2, finite.COMPILED_FROM // 16))
    assert calls == [1]
