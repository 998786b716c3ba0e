"""Fields split in blocks: each client rank sends its block of a global array, the server places it.

A domain-decomposed code holds a block of each field: 2x2 in 2-D, 2x2x2 in 3-D,
uneven at the edges, as ADIOS2's global arrays describe it (a global shape, and
per rank a start and a count). A client rank declares such a field as
``[dtype, shape, {"start": [...], "global": [...], "order": "C"}]``, where
``shape`` is its block's own (a rank that holds no block of the field declares
a shape with a 0 and sends empty arrays); ``order`` ``"F"`` says that the
block's bytes are column-major (a Fortran array, sent as it lies in memory:
shapes and starts are then in the Fortran code's axis order, and the field has
that order, ``field[i, j] == p(i + 1, j + 1)``). Without the third element a
rank's slice is stacked on axis 0 in rank order, as before blocks existed.

The blocks of one field must tile its global shape: every rank declares a
block (or every rank none), all of one global shape, each inside it, no two
overlapping, and together covering it. The handshake refuses anything else
(:func:`check_tiling`), naming the ranks and the region, and so does each
server rank for the declarations it receives. A block's values, in parts as
they come, are written straight into the field's global array (its
:func:`destination`, :func:`write_flat`): one strided copy per part, no copy
of the block of its own.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from melissa_dl.config.limits import MAX_NDIM
from melissa_dl.errors import ProtocolError
from melissa_dl.wire.protocol import Layout, describe, payload_bytes

ORDERS = ("C", "F")
CORNERS_SEARCHED = 100_000  # candidate corners examined to name a gap; beyond, the gap is only counted


@dataclass(frozen=True)
class Block:
    """Where a client rank's block of a field lies in the global array."""

    start: tuple[int, ...]
    global_shape: tuple[int, ...]
    order: str = "C"

    def to_json(self) -> dict[str, Any]:
        return {"start": list(self.start), "global": list(self.global_shape), "order": self.order}


Declared = tuple[Layout, Block | None]  # a client rank's slice of a field, and where its block lies if it has one


def region(start: Sequence[int], shape: Sequence[int]) -> str:
    """``[0:50, 50:101]``: the part of the global array a block (or a gap) covers."""
    return "[" + ", ".join(f"{s}:{s + n}" for s, n in zip(start, shape)) + "]"


def parse_block(where: str, decl: Any, shape: tuple[int, ...], max_whole_bytes: int) -> Block | None:
    """The block a field declaration ``[dtype, shape(, block)]`` gives (None: an axis-0 slice); ``where`` names it.
    A step's global array is held whole until its last block is in, so it may not exceed ``max_whole_bytes``
    (``server.max_partial_bytes``): a rank would otherwise allocate what one client's declaration asks."""
    if len(decl) == 2:
        return None
    extra = decl[2]
    if not isinstance(extra, dict) or set(extra) - {"start", "global", "order"}:
        raise ProtocolError(f"{where}: expected a block {{start, global, order}}, got {extra!r:.200}", "malformed")
    start, whole, order = extra.get("start"), extra.get("global"), extra.get("order", "C")
    if not (isinstance(start, list) and isinstance(whole, list) and _dims(start) and _dims(whole) and order in ORDERS):
        raise ProtocolError(
            f"{where}: a block's start and global shape are lists of at most {MAX_NDIM} integers in [0, 2**32), its "
            f"order 'C' or 'F'; got {extra!r:.200}",
            "shape",
        )
    if not len(start) == len(whole) == len(shape):
        raise ProtocolError(
            f"{where}: block of {len(shape)} dimensions, start of {len(start)}, global shape of {len(whole)}", "shape"
        )
    size = payload_bytes(decl[0], tuple(whole))
    if size > max_whole_bytes:
        raise ProtocolError(
            f"{where}: a global array of {size} bytes a step exceeds server.max_partial_bytes={max_whole_bytes} "
            "(a step's blocks are assembled in it)",
            "oversize",
        )
    return Block(tuple(start), tuple(whole), order)


def _dims(value: list[Any]) -> bool:
    return len(value) <= MAX_NDIM and all(type(n) is int and 0 <= n < 1 << 32 for n in value)


def check_tiling(
    where: str, blocks: Mapping[int, tuple[tuple[int, ...], Block | None]], complete: bool, new: int | None = None
) -> tuple[int, ...] | None:
    """Refuse blocks of one field (client rank -> its shape and block) that cannot tile one global array: some
    ranks with a block and some without, two global shapes, a block outside, two overlapping, and once every rank
    declared (``complete``) a gap. The global shape; None for axis-0 slices. ``new``: the rank that just declared,
    the others' blocks checked against each other already (so that a simulation of n ranks costs O(n^2) pairs,
    not O(n^3))."""
    ranks = sorted(blocks)
    with_block = [r for r in ranks if blocks[r][1] is not None]
    if not with_block:
        return None
    if len(with_block) < len(ranks):
        without = next(r for r in ranks if blocks[r][1] is None)
        raise ProtocolError(
            f"{where}: client rank {with_block[0]} declares a block, rank {without} none: declare every rank's block "
            "or none (slices stacked on axis 0)",
            "shape",
        )
    first = blocks[with_block[0]][1]
    assert first is not None
    whole = first.global_shape
    boxes = []
    for rank in with_block:
        shape, block = blocks[rank]
        assert block is not None
        if block.global_shape != whole:
            raise ProtocolError(
                f"{where}: client ranks {with_block[0]} and {rank} disagree on the global shape: {list(whole)} and "
                f"{list(block.global_shape)}",
                "shape",
            )
        if any(s + n > g for s, n, g in zip(block.start, shape, whole)):
            raise ProtocolError(
                f"{where}: client rank {rank}'s block {region(block.start, shape)} is outside the global shape "
                f"{list(whole)}",
                "shape",
            )
        if math.prod(shape):
            boxes.append((rank, block.start, shape))
    _refuse_overlaps(where, boxes, new)
    missing = math.prod(whole) - sum(math.prod(shape) for _, _, shape in boxes)
    if complete and missing:
        gap = _gap(whole, boxes, missing)
        raise ProtocolError(f"{where}: the blocks of the {len(ranks)} client ranks {gap}", "shape")
    return whole


Box = tuple[int, tuple[int, ...], tuple[int, ...]]  # a client rank's non-empty block: the rank, its start, its shape


def _refuse_overlaps(where: str, boxes: list[Box], new: int | None) -> None:
    """Refuse two blocks that share an element (one of them ``new``'s, unless None), naming the region."""
    pairs: Iterable[tuple[Box, Box]] = itertools.combinations(boxes, 2)
    if new is not None:
        pairs = ((box, other) for box in boxes if box[0] == new for other in boxes if other[0] != new)
    for (a, start_a, shape_a), (b, start_b, shape_b) in pairs:
        low = [max(s, t) for s, t in zip(start_a, start_b)]
        high = [min(s + n, t + m) for s, n, t, m in zip(start_a, shape_a, start_b, shape_b)]
        if all(lo < hi for lo, hi in zip(low, high)):
            raise ProtocolError(
                f"{where}: the blocks of client ranks {min(a, b)} and {max(a, b)} overlap in "
                f"{region(low, [hi - lo for lo, hi in zip(low, high)])}",
                "shape",
            )


def _gap(whole: tuple[int, ...], boxes: list[Box], missing: int) -> str:
    """Words for what blocks that neither overlap nor leave the global shape miss: its first uncovered element
    (some corner of the gap starts where a block ends or at 0, on every axis) and how many elements."""
    axes = [
        sorted({0} | {start[d] + shape[d] for _, start, shape in boxes if start[d] + shape[d] < whole[d]})
        for d in range(len(whole))
    ]
    if math.prod(len(axis) for axis in axes) <= CORNERS_SEARCHED:
        for point in itertools.product(*axes):
            if not any(all(s <= p < s + n for p, s, n in zip(point, start, shape)) for _, start, shape in boxes):
                return f"leave {missing} of its {math.prod(whole)} elements uncovered, the first at {list(point)}"
    return f"leave {missing} of its {math.prod(whole)} elements uncovered"


def joined(where: str, declared: Mapping[int, Declared], client_size: int, new: int | None = None) -> Layout:
    """The layout of a field of ``client_size`` client ranks, from the declarations of those that declared it so
    far (client rank -> its slice and block; ``new``: the one that just did, see ``check_tiling``): the global array
    their blocks tile, or their slices stacked on axis 0 (so far); refused if they cannot make one."""
    ranks = sorted(declared)
    first = ranks[0]
    dtype, shape = declared[first][0]
    for crank in ranks:
        (other, other_shape), block = declared[crank]
        also = "" if crank == first else f", rank {first} {describe((dtype, shape))}"
        if other != dtype and block is not None:
            raise ProtocolError(f"{where}: client rank {crank}'s block is {other}{also}: one dtype per field", "shape")
        if other != dtype or (block is None and client_size > 1 and (not other_shape or other_shape[1:] != shape[1:])):
            raise ProtocolError(
                f"{where}: client rank {crank} declares {describe((other, other_shape))}{also}: slices cannot be "
                "joined on axis 0 unless they share the dtype and the other axes (a field split along other axes "
                "declares each rank's block)",
                "shape",
            )
    blocks = {r: (layout[1], block) for r, (layout, block) in declared.items()}
    whole = check_tiling(where, blocks, len(ranks) == client_size, new)
    if whole is not None:
        return dtype, whole
    return dtype, (sum(declared[r][0][1][0] for r in ranks), *shape[1:]) if client_size > 1 else shape


def destination(whole: np.ndarray, block: Block, shape: tuple[int, ...]) -> np.ndarray:
    """The view of the global array that a block of ``shape`` fills, its axes in the order its values are sent
    (reversed for a column-major block), so that the values fill it in C order."""
    region: tuple[Any, ...] = (..., *(slice(s, s + n) for s, n in zip(block.start, shape)))
    view = whole[region]  # the Ellipsis: a view of a 0-d array too, not a copy of its value
    return view.T if block.order == "F" else view


def write_flat(target: np.ndarray, first: int, values: np.ndarray) -> None:
    """Copy ``values`` into ``target`` (a view, strided in any way) from its element ``first`` on, in C order.

    A part of a block is a run of its elements that may start and end inside a row: it is cut, axis by axis,
    into a partial row at each end and a box of whole rows between them, so that it costs a few strided copies
    (at most two per axis) straight into the global array, not a copy of the block and another to place it."""
    if not values.size:
        return
    if target.ndim == 1 or target.flags.c_contiguous:
        target.reshape(-1)[first : first + values.size] = values  # a view: 1-D, or contiguous
        return
    inner = math.prod(target.shape[1:])
    row, skip = divmod(first, inner)
    done = 0
    if skip:
        done = min(inner - skip, values.size)
        write_flat(target[row], skip, values[:done])
        row += 1
    rows = (values.size - done) // inner
    if rows:
        target[row : row + rows] = values[done : done + rows * inner].reshape(rows, *target.shape[1:])
        done, row = done + rows * inner, row + rows
    if done < values.size:
        write_flat(target[row], 0, values[done:])
