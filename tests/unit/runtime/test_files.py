"""Writes into the output folder: atomic, temporary files removed on failure, one-line verdicts."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from launcher.schedulers import LogUnwritable, open_log
from melissa_dl.errors import ConfigError
from melissa_dl.runtime import files
from melissa_dl.runtime.files import check_writable, remove_temporaries, unwritable, write_atomic
from melissa_dl.runtime.logs import setup_logging

pytestmark = pytest.mark.timeout(60)


def fail_with(number: int):
    def fail(*args: object, **options: object) -> None:
        raise OSError(number, os.strerror(number))

    return fail


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_a_full_disk_leaves_no_temporary_file_and_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    target = tmp_path / "report.json"
    target.write_text("the previous report")
    monkeypatch.setattr(files.os, where, fail_with(errno.ENOSPC))
    with pytest.raises(OSError) as caught:
        write_atomic(target, b"x" * 100_000)
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
    assert target.read_text() == "the previous report"  # the old file stays whole
    assert caught.value.filename == str(target)
    line = unwritable(caught.value)
    assert line == (
        f"cannot write {target}: ENOSPC (No space left on device); free space or fix the output "
        "folder, then run the same command to resume"
    )


def test_a_file_size_limit_is_reported_like_a_full_disk(tmp_path: Path) -> None:
    """What ``ulimit -f`` does to a writer (Python ignores SIGXFSZ): EFBIG part-way through a write."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, hard))
    try:
        with pytest.raises(OSError) as caught:
            write_atomic(tmp_path / "dense.pt", b"x" * (1 << 20))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert caught.value.errno == errno.EFBIG and list(tmp_path.iterdir()) == []
    assert f"cannot write {tmp_path / 'dense.pt'}: EFBIG" in str(unwritable(caught.value))


def test_other_errors_are_not_called_an_unwritable_folder() -> None:
    assert unwritable(OSError(errno.EIO, "Input/output error")) is None
    assert unwritable(ValueError("bug")) is None
    wrapped = RuntimeError("tensorboard writer failed")
    wrapped.__cause__ = OSError(errno.EROFS, "Read-only file system", "/out/tensorboard/events")
    assert "cannot write /out/tensorboard/events: EROFS (Read-only file system)" in str(unwritable(wrapped))


def test_an_output_folder_under_a_regular_file_is_refused_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(ConfigError) as caught:
        check_writable(tmp_path / "file" / "study")
    assert str(caught.value) == f"output_dir: cannot write {tmp_path / 'file' / 'study'}: ENOTDIR (Not a directory)"


def test_checking_a_folder_creates_nothing(tmp_path: Path) -> None:
    check_writable(tmp_path / "a" / "b")
    assert list(tmp_path.iterdir()) == []


def test_a_read_only_output_folder_is_refused_naming_the_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(files.tempfile, "TemporaryFile", fail_with(errno.EROFS))
    with pytest.raises(ConfigError) as caught:
        check_writable(tmp_path / "out")
    assert str(caught.value) == f"output_dir: cannot write {tmp_path / 'out'}: EROFS (Read-only file system)"


def test_a_folder_the_server_writes_into_is_checked_with_the_output_folder(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "logs").write_text("a file where the log folder goes")
    with pytest.raises(ConfigError, match=f"^output_dir: cannot write {tmp_path / 'out' / 'logs'}: ENOTDIR "):
        check_writable(tmp_path / "out")


def test_a_simulation_log_that_cannot_be_opened_is_the_output_folders_fault(tmp_path: Path) -> None:
    """Not an OSError: the launcher must not count it as a simulation that failed to start."""
    (tmp_path / "simulations").write_text("in the way")
    with pytest.raises(LogUnwritable) as caught:
        open_log(tmp_path / "simulations" / "simulation0.attempt0.log")
    assert not isinstance(caught.value, OSError)
    assert unwritable(caught.value) == (
        f"cannot write {tmp_path / 'simulations'}: EEXIST (File exists); free space "
        "or fix the output folder, then run the same command to resume"
    )


def test_temporaries_of_a_killed_writer_are_removed(tmp_path: Path) -> None:
    for name in (".report.json.tmp", ".LATEST.tmp", "report.json", ".hidden"):
        (tmp_path / name).write_text("x")
    remove_temporaries(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".hidden", "report.json"]


def test_a_log_file_that_cannot_be_written_says_so_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup_logging(0, tmp_path)
        handler = root.handlers[-1]
        assert isinstance(handler, logging.FileHandler)
        handler.stream.write = fail_with(errno.ENOSPC)  # type: ignore[method-assign]
        for n in range(3):
            logging.getLogger("melissa_dl.test").warning("line %d", n)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    err = capsys.readouterr().err
    assert err.count("logging to stderr only") == 1 and "Traceback" not in err and "Logging error" not in err
    assert all(f"line {n}" in err for n in range(3))


@pytest.mark.parametrize("levels", ["INFO", {"pde": "INFO"}])
def test_other_libraries_info_lines_stay_out_of_the_log_unless_named(tmp_path: Path, levels: Any) -> None:
    """A training module's library logging at INFO filled 252 of 321 lines of a study's log (issue 13, item 5)."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        setup_logging(0, tmp_path, levels)
        logging.getLogger("melissa_dl.study.study").info("ours")
        logging.getLogger("pde").info("theirs")
        logging.getLogger("pde.solver").warning("their warning")
        logging.getLogger("other").info("unnamed")
        for handler in root.handlers:
            handler.flush()
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        for name in ("pde", "melissa_dl", "launcher"):
            logging.getLogger(name).setLevel(logging.NOTSET)
    lines = (tmp_path / "rank0.log").read_text()
    assert "ours" in lines and "their warning" in lines and "unnamed" not in lines
    assert ("theirs" in lines) == (levels != "INFO")
