"""Versioned atomic checkpoints: round trip, commit point, corruption fallback, pruning, background writer.

Two ranks are simulated by calling ``write_rank_files`` for rank 0 and 1 in one process.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from mpi4py import MPI

from melissa_dl.checkpoint.manager import CheckpointManager
from melissa_dl.checkpoint.recovery import checkpoint_root, find_checkpoint, module_digest
from melissa_dl.checkpoint.serialization import dumps, loads
from melissa_dl.checkpoint.snapshots import (
    BackgroundCopies,
    BackgroundCopy,
    BackgroundWriter,
    Live,
    release,
    settled,
)
from melissa_dl.checkpoint.versions import (
    FORMAT_VERSION,
    LATEST,
    MANIFEST,
    FileRecord,
    _manifest_crc32,
    commit,
    ever_committed,
    latest_valid,
    next_version,
    verify,
    version_dir,
    write_rank_files,
)
from melissa_dl.config.sections import parse_config
from melissa_dl.errors import CheckpointCorrupt

pytestmark = pytest.mark.timeout(60)


def rank_files(rank: int, version: int) -> dict[str, bytes]:
    return {
        "model.pt": dumps({"w": torch.full((4, 3), float(version)), "rank": rank}),
        "buffer.pkl": dumps([np.arange(10) * rank, lambda x: x + version]),
    }


def save(root: Path, version: int | None = None, *, ranks: int = 2, keep: int = 3, do_commit: bool = True) -> int:
    version = next_version(root) if version is None else version
    records = [write_rank_files(version_dir(root, version), r, rank_files(r, version)) for r in range(ranks)]
    if do_commit:
        commit(root, version, records, {"progress": version}, batch=10 * version, config_digest="abc", keep=keep)
    return version


def folders(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir())


def test_round_trip(tmp_path: Path) -> None:
    assert latest_valid(tmp_path) is None and next_version(tmp_path) == 1
    assert save(tmp_path) == 1
    version = latest_valid(tmp_path)
    assert version is not None and version.number == 1 and version.path == tmp_path / "v1"
    manifest = version.manifest
    assert (manifest["format"], manifest["ranks"], manifest["batch"], manifest["config_digest"]) == (2, 2, 10, "abc")
    assert manifest["meta"] == {"progress": 1} and version.meta == {"progress": 1}
    assert {f["path"] for f in manifest["files"]} == {
        "rank0/model.pt",
        "rank0/buffer.pkl",
        "rank1/model.pt",
        "rank1/buffer.pkl",
    }
    assert (tmp_path / LATEST).read_text().strip() == "v1"
    assert sorted(version.names(1)) == ["buffer.pkl", "model.pt"]
    model = loads(version.read(1, "model.pt"))
    assert model["rank"] == 1 and torch.equal(model["w"], torch.full((4, 3), 1.0))
    array, function = loads(version.read(1, "buffer.pkl"))
    assert np.array_equal(array, np.arange(10)) and function(1) == 2
    with pytest.raises(KeyError):
        version.read(0, "missing.pt")
    assert not list(tmp_path.rglob("*.tmp"))


def test_records_and_bad_names(tmp_path: Path) -> None:
    records = write_rank_files(tmp_path / "v1", 3, {"a": b"hello", "b": memoryview(b"")})
    assert records[0] == FileRecord("rank3/a", 5, "3610a686")
    assert records[1].size == 0
    for name in ("", "../x", "a/b", ".hidden"):
        with pytest.raises(ValueError):
            write_rank_files(tmp_path / "v1", 0, {name: b"x"})


def test_latest_is_the_commit_point(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save(tmp_path)
    save(tmp_path, do_commit=False)  # crash between the rank files and the commit
    assert (tmp_path / "v2" / "rank1" / "model.pt").exists() and not (tmp_path / "v2" / MANIFEST).exists()
    with caplog.at_level(logging.WARNING, logger="melissa_dl.checkpoint.versions"):
        version = latest_valid(tmp_path)
    assert version is not None and version.number == 1
    assert "v2" in caplog.text and "never committed" in caplog.text
    assert next_version(tmp_path) == 3  # the torn folder is never reused


def test_missing_latest_pointer_walks_folders(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save(tmp_path)
    save(tmp_path, do_commit=False)
    (tmp_path / LATEST).unlink()
    with caplog.at_level(logging.WARNING, logger="melissa_dl.checkpoint.versions"):
        version = latest_valid(tmp_path)
    assert version is not None and version.number == 1
    assert "checkpoint v2: missing manifest" in caplog.text


@pytest.mark.parametrize("damage, reason", [("truncate", "size"), ("flip", "checksum"), ("delete", "missing file")])
def test_damaged_newest_falls_back(tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str, reason: str) -> None:
    save(tmp_path)
    save(tmp_path)
    path = tmp_path / "v2" / "rank1" / "buffer.pkl"
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(data[:-7])
    elif damage == "flip":
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(data)
    else:
        path.unlink()
    with caplog.at_level(logging.WARNING, logger="melissa_dl.checkpoint.versions"):
        version = latest_valid(tmp_path)
    assert version is not None and version.number == 1
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "v2" in warning and "rank1/buffer.pkl" in warning and reason in warning
    with pytest.raises(CheckpointCorrupt, match=reason):
        verify(tmp_path / "v2")


@pytest.mark.parametrize(
    "content, reason",
    [
        (None, "missing manifest"),
        (b"{not json", "unreadable manifest"),
        (b"\xff\xfe", "unreadable manifest"),
        (b"[1, 2]", "unsupported manifest"),
        (b'{"format": 99}', "unsupported manifest format 99"),
    ],
)
def test_bad_manifest_falls_back(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, content: bytes | None, reason: str
) -> None:
    save(tmp_path)
    save(tmp_path)
    manifest = tmp_path / "v2" / MANIFEST
    if content is None:
        manifest.unlink()
    else:
        manifest.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="melissa_dl.checkpoint.versions"):
        version = latest_valid(tmp_path)
    assert version is not None and version.number == 1
    assert f"checkpoint v2: {reason}" in caplog.text


def rename_path_key(manifest: dict) -> None:
    manifest["files"][0]["file"] = manifest["files"][0].pop("path")


def set_ranks(ranks: int) -> Callable[[dict], None]:
    return lambda manifest: manifest.update(ranks=ranks)


def escape(manifest: dict) -> None:
    manifest["files"][0]["path"] = "rank0/../../../etc/hostname"


@pytest.mark.parametrize(
    "edit, reason",
    [
        (rename_path_key, "malformed file record"),
        (set_ranks(3), "manifest says 3 ranks, its files are of ranks [0, 1]"),
        (set_ranks(1), "manifest says 1 ranks, its files are of ranks [0, 1]"),
        (lambda manifest: manifest.update(ranks="2"), "manifest field 'ranks' missing or not int"),
        (lambda manifest: manifest.pop("meta"), "manifest field 'meta' missing or not dict"),
        (lambda manifest: manifest["files"][1].update(size=-1), "malformed file record"),
        (escape, "malformed file record"),
        (lambda manifest: manifest.update(ranks=0, files=[]), "manifest says 0 ranks, its files are of ranks []"),
        (set_ranks(10**10), "manifest says 10000000000 ranks"),
    ],
)
@pytest.mark.parametrize("resigned", [False, True], ids=["edited", "edited-and-resigned"])
def test_an_edited_manifest_is_a_damaged_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, edit: Callable[[dict], None], reason: str, resigned: bool
) -> None:
    """Without its checksum the edit is caught as such; re-signed, the field checks still catch it, never a crash."""
    save(tmp_path)
    save(tmp_path)
    path = tmp_path / "v2" / MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    if resigned:
        manifest["crc32"] = _manifest_crc32(manifest)
    path.write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="melissa_dl.checkpoint.versions"):
        version = latest_valid(tmp_path)
    assert version is not None and version.number == 1
    expected = reason if resigned else "manifest checksum mismatch (edited or torn)"
    assert f"checkpoint v2: {expected}" in caplog.text
    with pytest.raises(CheckpointCorrupt, match=re.escape(expected)):
        verify(tmp_path / "v2")


def test_a_version_without_a_file_its_reader_requires_is_damaged(tmp_path: Path) -> None:
    save(tmp_path)
    save(tmp_path)
    required = {0: ("model.pt", "buffer.pkl"), 1: ("model.pt", "buffer.pkl")}
    assert verify(tmp_path / "v2", required.__getitem__).number == 2
    required[1] = ("model.pt", "ledger.pt", "extra.pt")
    with pytest.raises(CheckpointCorrupt, match=r"^checkpoint v2: no extra.pt, ledger.pt for rank 1$"):
        verify(tmp_path / "v2", required.__getitem__)
    assert latest_valid(tmp_path, required.__getitem__) is None


def test_a_deeply_nested_manifest_is_a_damaged_version(tmp_path: Path) -> None:
    save(tmp_path)
    save(tmp_path)
    (tmp_path / "v2" / MANIFEST).write_text("[" * 100_000)
    with pytest.raises(CheckpointCorrupt, match="unreadable manifest"):
        verify(tmp_path / "v2")
    assert (version := latest_valid(tmp_path)) is not None and version.number == 1


def test_a_file_that_cannot_be_read_is_a_damaged_version(tmp_path: Path) -> None:
    save(tmp_path)
    save(tmp_path)
    file = tmp_path / "v2" / "rank1" / "model.pt"
    file.unlink()
    file.symlink_to(file)  # a symlink loop: ELOOP, as a bad disk block gives EIO
    with pytest.raises(CheckpointCorrupt, match=r"checkpoint v2: cannot read rank1/model.pt \(\[Errno 40\]"):
        verify(tmp_path / "v2")
    assert (version := latest_valid(tmp_path)) is not None and version.number == 1


def test_a_manifest_of_another_format_is_refused_by_name(tmp_path: Path) -> None:
    save(tmp_path)
    path = tmp_path / "v1" / MANIFEST
    manifest = json.loads(path.read_text())
    manifest["format"] = FORMAT_VERSION - 1
    path.write_text(json.dumps(manifest))
    with pytest.raises(
        CheckpointCorrupt,
        match=f"unsupported manifest format {FORMAT_VERSION - 1} \\(this server reads format {FORMAT_VERSION}\\)",
    ):
        verify(tmp_path / "v1")


@pytest.mark.parametrize("pointer", ["directory", "garbage", "binary", "missing version"])
def test_a_damaged_pointer_falls_back_to_the_newest_intact_version(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, pointer: str
) -> None:
    save(tmp_path)
    save(tmp_path)
    latest = tmp_path / LATEST
    latest.unlink()
    if pointer == "directory":
        latest.mkdir()
    elif pointer == "garbage":
        latest.write_text("v2; rm -rf /\n")
    elif pointer == "binary":
        latest.write_bytes(b"\xff\xfe\x00")
    else:
        latest.write_text("v9\n")
    with caplog.at_level(logging.WARNING, logger="melissa_dl.checkpoint.versions"):
        version = latest_valid(tmp_path)
    assert version is not None and version.number == 2
    assert (
        "v9 named by LATEST is missing" in caplog.text if pointer == "missing version" else "unreadable" in caplog.text
    )
    assert next_version(tmp_path) == (10 if pointer == "missing version" else 3)
    committed = save(tmp_path)  # the next commit replaces the damaged pointer
    version = latest_valid(tmp_path)
    assert version is not None and version.number == committed and latest.read_text() == f"v{committed}\n"


def test_everything_corrupt_gives_none(tmp_path: Path) -> None:
    save(tmp_path)
    (tmp_path / "v1" / MANIFEST).unlink()
    assert latest_valid(tmp_path) is None
    assert next_version(tmp_path) == 2


def test_ever_committed_sees_a_pointer_or_any_manifest(tmp_path: Path) -> None:
    """What tells "every version is damaged" (refuse) from "nothing was ever committed" (start)."""
    assert not ever_committed(tmp_path)
    save(tmp_path, do_commit=False)
    assert not ever_committed(tmp_path)  # rank files of a first version that never got its manifest
    save(tmp_path, 2)
    (tmp_path / LATEST).unlink()
    (tmp_path / "v2" / MANIFEST).write_text("{torn")
    assert latest_valid(tmp_path) is None and ever_committed(tmp_path)
    (tmp_path / "v2" / MANIFEST).unlink()
    (tmp_path / LATEST).mkdir()
    assert ever_committed(tmp_path)


def test_keep_prunes_only_after_commit(tmp_path: Path) -> None:
    save(tmp_path, keep=2)
    save(tmp_path, keep=2)
    assert folders(tmp_path) == ["v1", "v2"]
    save(tmp_path, keep=2, do_commit=False)  # v3 written, not committed: nothing pruned yet
    assert folders(tmp_path) == ["v1", "v2", "v3"]
    save(tmp_path, 4, keep=2)  # committing v4 prunes v1 and the torn v3
    assert folders(tmp_path) == ["v2", "v4"]
    version = latest_valid(tmp_path)
    assert version is not None and version.number == 4 and version.manifest["batch"] == 40
    assert next_version(tmp_path) == 5
    with pytest.raises(ValueError):
        commit(tmp_path, 5, [], {}, batch=0, config_digest="", keep=0)


def test_manifest_is_json_with_sizes(tmp_path: Path) -> None:
    save(tmp_path, ranks=1)
    manifest = json.loads((tmp_path / "v1" / MANIFEST).read_text())
    for record in manifest["files"]:
        assert (tmp_path / "v1" / record["path"]).stat().st_size == record["size"]
        assert len(record["crc32"]) == 8


def test_large_file_hashed_in_parallel(tmp_path: Path) -> None:
    data = np.random.default_rng(0).integers(0, 255, 40 << 20, dtype=np.uint8)
    [record] = write_rank_files(tmp_path / "v1", 0, {"big": memoryview(data)})
    commit(tmp_path, 1, [[record]], {}, batch=0, config_digest="")
    version = latest_valid(tmp_path)
    assert version is not None and version.read(0, "big") == data.tobytes()


def test_background_writer_in_order_and_wait() -> None:
    done: list[int] = []
    with BackgroundWriter() as writer:
        for i in range(5):
            writer.submit(lambda i=i: (time.sleep(0.01), done.append(i)))
        writer.wait()
        assert done == list(range(5))
        gate = threading.Event()
        writer.submit(gate.wait)
        waiter = threading.Thread(target=writer.wait)
        waiter.start()
        waiter.join(0.2)
        assert waiter.is_alive()  # wait() waits for the running job
        gate.set()
        waiter.join()
    assert not writer._thread.is_alive()


def test_background_writer_propagates_errors() -> None:
    def fail() -> None:
        raise OSError("disk full")

    writer = BackgroundWriter()
    writer.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        writer.wait()
    writer.wait()  # raised once
    writer.submit(fail)
    while writer._queue.unfinished_tasks:  # the error is kept before the job counts as done
        time.sleep(0.01)
    with pytest.raises(OSError, match="disk full"):
        writer.submit(lambda: None)
    writer.submit(fail)
    with pytest.raises(OSError, match="disk full"):
        writer.close()
    assert not writer._thread.is_alive()
    with pytest.raises(RuntimeError):
        writer.submit(lambda: None)
    writer.close()


def test_background_writer_close_finishes_jobs(tmp_path: Path) -> None:
    writer = BackgroundWriter()
    snapshot = rank_files(0, 1)
    writer.submit(
        lambda: commit(
            tmp_path, 1, [write_rank_files(version_dir(tmp_path, 1), 0, snapshot)], {}, batch=1, config_digest="d"
        )
    )
    writer.close()
    version = latest_valid(tmp_path)
    assert version is not None and version.number == 1


def test_dumps_keeps_tensors_and_arrays_out_of_band_and_loads_them_writable() -> None:
    base = torch.arange(12, dtype=torch.float64).reshape(3, 4)
    state = {
        "bf16": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "scalar": torch.tensor(7, dtype=torch.int64),
        "transposed": base.t(),  # not contiguous: stored contiguous, same values
        "empty": torch.empty(0, 5),
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "function": lambda x: x + 1,
    }
    chunks = dumps(state)
    big = state["array"].nbytes
    assert any(chunk.nbytes == big and chunk.obj is state["array"] for chunk in chunks if chunk.nbytes)  # not copied
    loaded = loads(bytearray(b"".join(chunks)))
    for name in ("bf16", "flags", "scalar", "transposed", "empty"):
        assert loaded[name].dtype == state[name].dtype and torch.equal(loaded[name], state[name]), name
    np.testing.assert_array_equal(loaded["array"], state["array"])
    assert loaded["function"](1) == 2
    loaded["transposed"].add_(1)  # writable, without a warning about non-writable arrays
    with pytest.raises(ValueError, match="bad magic"):
        loads(b"not a checkpoint")


def test_a_checkpoint_written_before_the_wings_names_its_classes_by_their_old_modules_and_loads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from melissa_dl.buffers import sample as sample_module

    monkeypatch.setitem(sys.modules, "melissa_dl.sample", sample_module)
    monkeypatch.setattr(sample_module.Sample, "__module__", "melissa_dl.sample")
    written = b"".join(dumps([sample_module.Sample(3, 4, np.zeros(2), {"u": np.arange(5.0)})]))
    assert b"melissa_dl.sample" in written
    monkeypatch.undo()
    assert "melissa_dl.sample" not in sys.modules
    [sample] = loads(bytearray(written))
    assert type(sample) is sample_module.Sample and (sample.simulation_id, sample.time_step) == (3, 4)
    np.testing.assert_array_equal(sample.fields["u"], np.arange(5.0))


def test_a_snapshot_copies_a_part_s_live_state_into_the_memory_of_its_last_written_copy() -> None:
    copies = BackgroundCopies()
    live = {"w": torch.zeros(1000)}
    state = copies.start("trainer", {"tables": Live(live), "step": 3})
    copies.wait()  # what a step does before its optimizer changes the state
    live["w"].add_(1)
    first = settled(state)
    assert first["step"] == 3 and float(first["tables"]["w"].sum()) == 0
    release(state)  # written: its memory goes to the next copy of trainer.tables
    again = settled(copies.start("trainer", {"tables": Live(live), "step": 4}))
    assert again["tables"]["w"].data_ptr() == first["tables"]["w"].data_ptr()
    assert float(again["tables"]["w"].sum()) == 1000
    other = settled(copies.start("dense", {"tables": Live(live)}))
    assert other["tables"]["w"].data_ptr() != first["tables"]["w"].data_ptr()  # another part's copy is its own


def test_background_copy_reuses_an_earlier_copy_and_is_not_changed_by_later_steps() -> None:
    weights = {"w": torch.zeros(1000), "step": 3, "nested": [torch.ones(2, 2)]}
    first = BackgroundCopy(weights).wait()
    weights["w"].add_(1)  # training goes on after the copy
    assert float(first["w"].sum()) == 0 and first["step"] == 3
    second = BackgroundCopy(weights, into=first).wait()
    assert second["w"].data_ptr() == first["w"].data_ptr() and float(second["w"].sum()) == 1000
    other_shape = BackgroundCopy({"w": torch.zeros(7), "step": 3, "nested": [torch.ones(2, 2)]}, into=second).wait()
    assert other_shape["w"].data_ptr() != second["w"].data_ptr()  # nothing reused that does not fit


class Snapshots:
    """Stands in for ``recovery.Checkpointer``: counts snapshots and commits."""

    def __init__(self) -> None:
        self.snapshots: list[int] = []
        self.syncs = 0

    def snapshot(self, batch: int, samples: int) -> None:
        self.snapshots.append(batch)

    def sync(self) -> None:
        self.syncs += 1


def manager_with(seconds: float) -> tuple[CheckpointManager, Snapshots]:
    config = parse_config(
        {
            "study": {"fields": ["u"], "parameters": [{"name": "a", "low": 0, "high": 1}], "simulations": 3},
            "launcher": {"command": ["sim"]},
            "checkpoint": {"seconds": seconds},
        },
        Path("/studies/x"),
    )
    manager = CheckpointManager(config, MPI.COMM_SELF)
    snapshots = Snapshots()
    manager._checkpointer = snapshots  # type: ignore[assignment]
    return manager, snapshots


def test_simulations_that_ended_are_snapshot_after_the_next_step_or_when_idle() -> None:
    manager, snapshots = manager_with(seconds=0)
    manager.sync(ended=False)
    manager.when_idle(0, 0)
    assert not manager.due(1) and snapshots.snapshots == []  # nothing ended: no snapshot
    manager.sync(ended=True)
    assert manager.due(1)  # the next step keeps no batch ahead, and is followed by the snapshot
    manager.after_step(1, 4)
    assert snapshots.snapshots == [1] and not manager.due(2)
    manager.sync(ended=True)
    manager.when_idle(1, 4)  # data is late: the snapshot is taken in a round where no rank holds a batch
    manager.when_idle(1, 4)
    assert snapshots.snapshots == [1, 1] and snapshots.syncs == 3


def test_checkpoint_seconds_spaces_the_snapshots_of_ended_simulations_and_forgets_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    manager, snapshots = manager_with(seconds=30)
    manager.sync(ended=True)
    manager.when_idle(0, 0)
    now[0] += 10
    manager.sync(ended=True)  # within 30 s of the last: waits
    manager.when_idle(0, 0)
    assert snapshots.snapshots == [0]
    now[0] += 19
    manager.sync(ended=False)
    manager.when_idle(0, 0)
    assert snapshots.snapshots == [0]
    now[0] += 2  # 31 s after the first: the simulation that ended meanwhile is recorded, though none ended now
    manager.sync(ended=False)
    manager.when_idle(0, 0)
    manager.sync(ended=False)
    manager.when_idle(0, 0)
    assert snapshots.snapshots == [0, 0]


def test_a_checkpoint_that_holds_every_schedulers_section_resumes_without_a_warning_of_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An earlier version's resolved config held every scheduler's section (``launcher.slurm`` of a local study);
    today a section neither chosen nor given is not read: resuming such a checkpoint warns of no change of it,
    and still of a change of what the study reads."""
    (tmp_path / "model.py").write_text("")
    config = parse_config(
        {
            "study": {"fields": ["u"], "parameters": [{"name": "a", "low": 0, "high": 1}], "simulations": 3},
            "launcher": {"command": ["sim"], "job_limit": 2},
            "training": {"module": "model.py", "class_name": "M"},
        },
        tmp_path,
    )
    root = checkpoint_root(config)

    def resume(saved: dict) -> list[str]:
        shutil.rmtree(root, ignore_errors=True)
        files = {name: b"" for name in ("stream.pt", "trainer.pt", "dense.pt", "study.pt")}
        records = [write_rank_files(version_dir(root, 1), 0, {**files, "config.json": json.dumps(saved).encode()})]
        commit(root, 1, records, {"module_digest": module_digest(config)}, batch=1, config_digest="x")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="melissa_dl.checkpoint.recovery"):
            assert find_checkpoint(config) is not None
        return [record.getMessage() for record in caplog.records]

    older = config.to_dict()
    older["launcher"]["slurm"] = {"partition": None, "account": None}
    older["launcher"]["srun"] = {}
    assert "slurm" not in config.to_dict()["launcher"] and resume(older) == []
    older["launcher"]["job_limit"] = 4
    assert resume(older) == ["resuming with launcher.job_limit changed: 4 -> 2"]
