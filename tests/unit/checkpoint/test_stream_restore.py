"""A rank's stream part of a checkpoint (buffer, ledger, counters) written and restored, on the same or another K."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from melissa_dl.buffers.kinds import make_buffer
from melissa_dl.buffers.sample import Sample
from melissa_dl.checkpoint.recovery import STREAM, Part, restore
from melissa_dl.checkpoint.serialization import dumps
from melissa_dl.checkpoint.versions import commit, latest_valid, version_dir, write_rank_files
from melissa_dl.ingest.assembly import StreamSpec
from melissa_dl.ingest.receiver import Receiver

pytestmark = pytest.mark.timeout(60)

TOKEN = bytes(range(32))


def receiver(rank: int, size: int) -> Receiver:
    """A rank's receiver, never started: only its buffer, assembler and counters are used."""
    spec = StreamSpec(["u"], np.zeros((4, 1)), TOKEN, server_rank=rank, server_size=size)
    buffer = make_buffer("fifo", capacity_samples=10, capacity_bytes=None, watermark=1, seed=0)
    return Receiver(spec, buffer, "127.0.0.1", receive_queue_bytes=1 << 20)


def checkpoint(tmp_path: Path, streams: list[dict]) -> Path:
    root = tmp_path / "checkpoints"
    records = [write_rank_files(version_dir(root, 1), r, {f"{STREAM}.pt": dumps(s)}) for r, s in enumerate(streams)]
    commit(root, 1, records, {}, batch=1, config_digest="x", keep=2)
    return root


def old_rank(rank: int, refused: dict[str, int], duplicates: int) -> dict:
    """What ``Receiver.state_dict`` of a rank of a 2-rank run holds after one step and some bad input."""
    old = receiver(rank, 2)
    sample = Sample(rank, 1 - rank, np.zeros(1), {"u": np.full(3, rank, dtype=np.float32)})
    assert old.buffer.put(sample, on_insert=lambda: old._assembler.commit(sample))
    for kind, count in refused.items():
        for _ in range(count):
            old.rejections.reject(kind, "bad input")
    old._assembler.duplicates = duplicates
    return old.state_dict()


@pytest.mark.parametrize("size", [2, 1])
def test_refusals_and_duplicates_counted_before_a_restart_are_restored(tmp_path: Path, size: int) -> None:
    """A restart must not make the final report forget what was refused before it (issue 10, defect 13)."""
    streams = [old_rank(0, {"malformed": 3, "credentials": 1}, 2), old_rank(1, {"malformed": 4, "data_auth": 5}, 7)]
    version = latest_valid(checkpoint(tmp_path, streams))
    assert version is not None
    restored = [receiver(rank, size) for rank in range(size)]
    for rank, new in enumerate(restored):
        restore(version, [Part(STREAM, new)], rank, size)
    reports = [new.report() for new in restored]
    if size == 2:  # each rank continues its own counts
        assert [r.rejected for r in reports] == [{"malformed": 3, "credentials": 1}, {"malformed": 4, "data_auth": 5}]
        assert [r.duplicate_frames for r in reports] == [2, 7]
    else:  # the old ranks' counts, added up once on the new rank 0
        assert reports[0].rejected == {"credentials": 1, "data_auth": 5, "malformed": 7}
        assert reports[0].duplicate_frames == 9
    assert sum(r.samples for r in reports) == 2 and sum(len(new.buffer) for new in restored) == 2
