"""The compiled row loops themselves: the packed sort of the ids, and the loops on keys of either width."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from melissa_dl.embeddings import row_kernels
from melissa_dl.embeddings.row_kernels import Kernels, SortedKeys

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def kernels() -> Kernels:
    loaded = row_kernels.load()
    assert loaded is not None, "numba is a dependency: its loops must load here"
    return loaded


def test_sorted_keys_order_ids_then_positions_in_32_bits_when_they_fit(kernels: Kernels) -> None:
    ids = torch.tensor([5, 2, 5, 0, 2, 5])
    keys = kernels.sorted_keys(ids, limit=6)
    assert keys is not None and keys.keys.dtype == np.uint32 and keys.bits == 3
    assert [(int(k) >> 3, int(k) & 7) for k in keys.keys] == [(0, 3), (2, 1), (2, 4), (5, 0), (5, 2), (5, 5)]
    wide = kernels.sorted_keys(torch.tensor([1 << 40, 3, 1 << 40]), limit=1 << 41)
    assert wide is not None and wide.keys.dtype == np.int64
    assert [(int(k) >> wide.bits, int(k) & 3) for k in wide.keys] == [(3, 1), (1 << 40, 0), (1 << 40, 2)]


@pytest.mark.parametrize("n", [1, 2, 3, 4096, 4097])
def test_keys_are_32_bits_up_to_the_largest_id_that_fits_and_64_from_the_next(kernels: Kernels, n: int) -> None:
    bits = max(n - 1, 1).bit_length()
    for top, width in ((2 ** (32 - bits) - 1, np.uint32), (2 ** (32 - bits), np.int64)):
        ids = torch.arange(n) % 7 * (top // 7)
        ids[-1] = top  # the last position, the largest key
        keys = kernels.sorted_keys(ids, limit=top + 1)
        assert keys is not None and keys.keys.dtype == width and keys.bits == bits
        decoded = sorted((int(k) >> bits, int(k) & (1 << bits) - 1) for k in keys.keys)
        assert decoded == sorted((int(i), p) for p, i in enumerate(ids)), (n, top)


@pytest.mark.parametrize("ids, limit", [([3, 6], 6), ([-1, 2], 6), ([2**62, 3], 2**63 - 1), ([3, 1 << 40], 1 << 40)])
def test_sorted_keys_refuse_ids_outside_the_limit_or_too_large_to_pack(
    kernels: Kernels, ids: list[int], limit: int
) -> None:
    assert kernels.sorted_keys(torch.tensor(ids), limit) is None


def test_unique_through_keys_of_either_width(kernels: Kernels) -> None:
    for ids in ([7, 1, 7, 3], [1 << 40, 1, 1 << 40, 3]):
        found = kernels.unique(torch.tensor(ids))
        assert found is not None
        expected = torch.unique(torch.tensor(ids), sorted=True, return_inverse=True)
        assert all(torch.equal(a, b) for a, b in zip(found, expected))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name", ["sgd", "adagrad", "row_adagrad", "adam"])
def test_each_loop_gives_the_same_rows_from_keys_of_32_and_64_bits(kernels: Kernels, name: str, dtype: type) -> None:
    """The loops are compiled once per key width; both must update the same rows to the same bits."""
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.zipf(1.5, 300) % 40)  # repeated ids, runs of every length
    keys = kernels.sorted_keys(ids, limit=40)
    assert keys is not None and keys.keys.dtype == np.uint32
    grads = rng.standard_normal((300, 8)).astype(dtype)
    results = []
    for width_keys in (keys, SortedKeys(keys.keys.astype(np.int64), keys.bits)):
        weight = np.linspace(-1, 1, 40 * 8, dtype=dtype).reshape(40, 8)
        state = {
            "sgd": [],
            "adagrad": [np.ones_like(weight)],
            "row_adagrad": [np.ones(40, dtype)],
            "adam": [np.ones((40, 2, 8), dtype)],
        }[name]
        hyper = {"sgd": (0.1,), "adagrad": (0.1, 1e-10), "row_adagrad": (0.1, 1e-10), "adam": (0.9, 0.999, 0.01, 1e-8)}[
            name
        ]
        rows = getattr(kernels, name)(weight, *state, width_keys, grads, *hyper)
        results.append((rows, weight, *state))
    assert results[0][0] == results[1][0] == len(torch.unique(ids))
    for narrow, wide in zip(results[0][1:], results[1][1:]):
        assert np.array_equal(narrow, wide)
    assert not np.array_equal(results[0][1], np.linspace(-1, 1, 40 * 8, dtype=dtype).reshape(40, 8))
