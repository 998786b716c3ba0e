"""Blocks of a global array: what tiles it, what is refused in one line naming the ranks and the region, and how a
block is read and placed (issue 54, item 1)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from melissa_dl.errors import ClientError, ProtocolError
from melissa_dl.wire.blocks import Block, check_tiling, destination, joined, parse_block, write_flat
from melissa_dl.wire.client import _block

pytestmark = pytest.mark.timeout(60)

WHERE = "simulation 3, field 'p'"


def quarters(whole: tuple[int, int] = (101, 101), split: tuple[int, int] = (50, 51)) -> dict[int, Any]:
    """A 2x2 decomposition of ``whole``, uneven: rank 2r + c holds rows of part r and columns of part c."""
    rows = [(0, split[0]), (split[0], whole[0] - split[0])]
    cols = [(0, split[1]), (split[1], whole[1] - split[1])]
    return {
        2 * r + c: ((rows[r][1], cols[c][1]), Block((rows[r][0], cols[c][0]), whole))
        for r in range(2)
        for c in range(2)
    }


def octants(whole: tuple[int, int, int] = (7, 6, 5)) -> dict[int, Any]:
    """A 2x2x2 decomposition of ``whole``, uneven on every axis."""
    cuts = [(0, n // 2 + 1, n) for n in whole]
    blocks = {}
    for rank in range(8):
        parts = [(rank >> (2 - d)) & 1 for d in range(3)]
        start = tuple(cuts[d][parts[d]] for d in range(3))
        shape = tuple(cuts[d][parts[d] + 1] - cuts[d][parts[d]] for d in range(3))
        blocks[rank] = (shape, Block(start, whole))
    return blocks


@pytest.mark.parametrize(
    "blocks", [quarters(), octants(), {0: ((4, 5), Block((0, 0), (4, 5)))}], ids=["2x2", "2x2x2", "one"]
)
def test_blocks_that_tile_the_global_array_give_its_shape(blocks: dict[int, Any]) -> None:
    whole = next(iter(blocks.values()))[1].global_shape
    assert check_tiling(WHERE, blocks, complete=True) == whole
    assert joined(WHERE, {r: (("float32", s), b) for r, (s, b) in blocks.items()}, len(blocks)) == ("float32", whole)


def test_a_rank_without_a_block_of_the_field_declares_an_empty_one() -> None:
    blocks = {**quarters(), 4: ((0, 0), Block((0, 0), (101, 101)))}
    assert check_tiling(WHERE, blocks, complete=True) == (101, 101)


def test_axis_0_slices_have_no_global_shape_and_stack() -> None:
    assert check_tiling(WHERE, {0: ((2, 3), None), 1: ((1, 3), None)}, complete=True) is None
    assert joined(WHERE, {0: (("int64", (2, 3)), None), 1: (("int64", (1, 3)), None)}, 2) == ("int64", (3, 3))


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {3: ((51, 50), Block((50, 50), (101, 101)))},
            "the blocks of client ranks 2 and 3 overlap in [50:101, 50:51]",
        ),
        (
            {3: ((51, 49), Block((50, 51), (101, 101)))},
            "the blocks of the 4 client ranks leave 51 of its 10201 elements uncovered, the first at [50, 100]",
        ),
        (
            {1: ((50, 51), Block((0, 51), (101, 101)))},
            "client rank 1's block [0:50, 51:102] is outside the global shape [101, 101]",
        ),
        (
            {2: ((51, 51), Block((50, 0), (101, 102)))},
            "client ranks 0 and 2 disagree on the global shape: [101, 101] and [101, 102]",
        ),
        (
            {1: ((50, 50), None)},
            "client rank 0 declares a block, rank 1 none: declare every rank's block or none (slices stacked on "
            "axis 0)",
        ),
    ],
    ids=["overlap", "gap", "outside", "global shapes", "some without"],
)
def test_blocks_that_cannot_tile_are_refused_in_one_line_naming_the_ranks_and_the_region(
    change: dict[int, Any], message: str
) -> None:
    with pytest.raises(ProtocolError) as refused:
        check_tiling(WHERE, {**quarters(), **change}, complete=True)
    assert refused.value.kind == "shape" and str(refused.value) == f"{WHERE}: {message}"
    assert "\n" not in str(refused.value)


def test_a_gap_is_only_refused_once_every_rank_has_declared() -> None:
    three = {r: block for r, block in quarters().items() if r != 3}
    assert check_tiling(WHERE, three, complete=False) == (101, 101)
    with pytest.raises(ProtocolError, match="leave 2550 of its 10201 elements uncovered, the first at \\[50, 51\\]"):
        check_tiling(WHERE, three, complete=True)


@pytest.mark.parametrize(
    "decl, message",
    [
        (["float32", [2, 2], {"start": [0], "global": [4, 4]}], "block of 2 dimensions, start of 1, global shape of 2"),
        (["float32", [2, 2], {"start": [0, -1], "global": [4, 4]}], "lists of at most"),
        (["float32", [2, 2], {"start": [0, 0], "global": [4, 4], "order": "X"}], "its order 'C' or 'F'"),
        (["float32", [2, 2], {"start": [0, 0], "global": [4, 4], "extra": 1}], "expected a block"),
        (["float32", [2, 2], [0, 0]], "expected a block"),
        (  # a rank must not allocate what one client's declaration asks: 64 GiB here
            ["float64", [1, 1], {"start": [0, 0], "global": [1 << 16, 1 << 17]}],
            "a global array of 68719476736 bytes a step exceeds server.max_partial_bytes=268435456",
        ),
    ],
)
def test_malformed_blocks_are_refused(decl: list[Any], message: str) -> None:
    with pytest.raises(ProtocolError, match=message):
        parse_block(WHERE, decl, tuple(decl[1]), 1 << 28)


def test_a_fortran_block_is_read_column_major_and_placed_in_the_codes_axis_order() -> None:
    """A Fortran code's p(3, 2) block starting at p(2, 1) (1-based) of a global p(5, 4): its bytes as they lie in
    memory, column-major; the field keeps the code's axis order, field[i, j] == p(i + 1, j + 1)."""
    whole = np.arange(20.0).reshape(5, 4)  # what the code's global p holds, p(i + 1, j + 1) = whole[i, j]
    block = Block((1, 0), (5, 4), order="F")
    memory = np.asfortranarray(whole[1:4, 0:2]).ravel(order="K")  # column-major, as Fortran sends it
    assembled = np.zeros((5, 4))
    write_flat(destination(assembled, block, (3, 2)), 0, memory)
    np.testing.assert_array_equal(assembled[1:4, 0:2], whole[1:4, 0:2])
    assert assembled.sum() == whole[1:4, 0:2].sum()  # nothing written outside the block
    assert parse_block(WHERE, ["float64", [3, 2], block.to_json()], (3, 2), 160) == block


@pytest.mark.parametrize("order", ["C", "F"])
def test_a_zero_dimensional_block_is_written_into_its_array_not_a_copy(order: str) -> None:
    assembled = np.zeros(())
    write_flat(destination(assembled, Block((), (), order), ()), 0, np.array([2.5]))
    assert assembled == 2.5


@pytest.mark.parametrize("order", ["C", "F"])
def test_a_blocks_values_written_in_parts_of_any_size_land_where_one_copy_would_put_them(order: str) -> None:
    """Parts start and end inside rows, planes, or span several: each is cut into a few strided copies straight
    into the global array, and together they put every value where placing the whole block puts it."""
    rng = np.random.default_rng(7)
    start, shape, whole_shape = (1, 2, 3), (4, 5, 6), (7, 9, 11)
    block = Block(start, whole_shape, order=order)
    values = rng.random(shape)
    memory = (np.asfortranarray(values) if order == "F" else values).ravel(order="K")
    expected = np.zeros(whole_shape)
    expected[1:5, 2:7, 3:9] = values
    for part in (1, 5, 6, 7, 29, 30, 31, 119, 120):
        assembled = np.zeros(whole_shape)
        target = destination(assembled, block, shape)
        for first in range(0, memory.size, part):
            write_flat(target, first, memory[first : first + part])
        np.testing.assert_array_equal(assembled, expected, err_msg=f"parts of {part} elements")


def test_a_new_ranks_block_is_checked_against_the_others_only() -> None:
    """The others' blocks were checked against each other when they came: an overlap between two of them is not
    looked for again (a simulation of n ranks costs O(n^2) pairs), one with the new rank's is."""
    overlapping = {**quarters(), 3: ((51, 50), Block((50, 50), (101, 101)))}  # ranks 2 and 3 overlap
    assert check_tiling(WHERE, {r: b for r, b in overlapping.items() if r != 2}, complete=False, new=1)
    with pytest.raises(ProtocolError, match="the blocks of client ranks 2 and 3 overlap"):
        check_tiling(WHERE, overlapping, complete=False, new=3)


def test_blocks_of_two_dtypes_are_refused_as_such() -> None:
    declared = {0: (("float32", (50, 51)), quarters()[0][1]), 1: (("float64", (50, 50)), quarters()[1][1])}
    with pytest.raises(ProtocolError, match="client rank 1's block is float64, rank 0 float32\\[50, 51\\]: one dtype"):
        joined(WHERE, declared, 4, new=1)


def test_the_python_client_takes_numpys_integers_in_a_block_and_refuses_other_numbers() -> None:
    block = _block("p", ("float32", (2, 3), Block((np.int64(4), np.int32(0)), (np.int64(6), 3))))
    assert block == Block((4, 0), (6, 3)) and json.dumps(block.to_json())
    with pytest.raises(ClientError, match="field 'p': a block's start and global shape are integers"):
        _block("p", ("float32", (2,), Block((0.5,), (3,))))  # type: ignore[arg-type]
    with pytest.raises(ClientError, match="the third element must be a Block"):
        _block("p", ("float32", (2,), ((0,), (3,))))
