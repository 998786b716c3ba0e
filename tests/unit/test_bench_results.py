"""bench/RESULTS.md is what bench/results.py writes from bench/history/, and the script's median and met."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_results", ROOT / "bench" / "results.py")
assert _spec is not None and _spec.loader is not None
results = importlib.util.module_from_spec(_spec)
sys.modules["bench_results"] = results  # dataclasses look their module up
_spec.loader.exec_module(results)

HEADER = "# commit: {commit}\n# machine: AMD EPYC\n# date: {date}\n# command: {command}\n# source: raw output\n"


def session(folder: Path, name: str, date: str, body: str, commit: str = "abc1234", extra: str = "") -> None:
    header = HEADER.format(commit=commit, date=date, command="python bench/toy.py")
    (folder / name).write_text(header + extra + body)


def test_the_page_is_what_the_script_writes_and_under_20_kb() -> None:
    page = results.PAGE.read_text()
    assert page == results.page(), "stale: run `python bench/results.py`"
    assert len(page.encode()) < 20_000


def test_check_says_in_one_line_when_the_page_is_stale(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(results, "PAGE", tmp_path / "RESULTS.md")
    results.PAGE.write_text("by hand\n")
    assert results.main(["--check"]) == 1
    assert capsys.readouterr().err.count("\n") == 1
    assert results.main([]) == 0
    assert results.main(["--check"]) == 0


def test_the_newest_file_gives_each_name_its_median_target_and_met(tmp_path: Path) -> None:
    session(tmp_path, "2026-01-01-01-toy.txt", "2026-01-01", "RESULT toy ratio=9.0 target=2\n")
    body = "noise\nRESULT toy ratio=3.0 target=2 unit=bytes\nRESULT step_overhead_small ratio=1.30 target=1.15\n"
    body += "RESULT toy ratio=1.0 target=2 unit=bytes\nRESULT step_overhead_small ratio=1.10 target=1.15\n"
    body += "RESULT toy ratio=2.5 target=2 unit=bytes\nRESULT toy_free ratio=0.5 target=-\n"
    session(tmp_path, "2026-01-02-01-toy.txt", "2026-01-02", body, extra="# load: 0.1, 0.2, 0.3\n")
    session(tmp_path, "2026-01-02-00-toy.txt", "2026-01-02", "RESULT toy_free ratio=7 target=-\n", commit="older")
    wide = "RESULT toy ratio=0.5 target=2\nRESULT toy ratio=0.7 target=2\n"
    session(tmp_path, "2026-01-03-01-toy-wide.txt", "2026-01-03", wide, extra="# variant: batch 8\n# user: root\n")
    sessions = [results.read_session(path) for path in sorted(tmp_path.glob("*.txt"))]
    rows = [(r.name, r.figure, r.target, r.met, r.commit, r.date) for r in results.current_rows(sessions)]
    assert rows == [
        ("`toy`", "2.5 bytes (3.0, 1.0, 2.5)", ">= 2", "yes (2 of 3 runs)", "abc1234", "2026-01-02"),
        ("`step_overhead_small`", "1.20 (1.30, 1.10)", "<= 1.15", "no (1 of 2 runs)", "abc1234", "2026-01-02"),
        ("`toy_free`", "0.5 (one run)", "none", "—", "abc1234", "2026-01-02"),
        ("`toy` (batch 8)", "0.6 (0.5, 0.7)", ">= 2", "no", "abc1234", "2026-01-03"),
    ]
    lines = results.table(results.current_rows(sessions))
    assert [line.rsplit("| ", 1)[1] for line in lines[2:]] == [
        "`python bench/toy.py` |",
        "as above |",
        "as above |",
        "`python bench/toy.py` (root) |",
    ]


@pytest.mark.parametrize(
    ("values", "middle"),
    [(["0.751", "0.830", "0.762"], "0.762"), (["0.621", "0.571", "0.911", "0.763"], "0.692"), (["2", "4"], "3")],
)
def test_the_median_is_a_printed_value_or_the_mean_of_two_to_their_decimals(values: list[str], middle: str) -> None:
    assert results.median(values) == middle


@pytest.mark.parametrize(
    ("header", "message"),
    [
        ("# commit: x\n# machine: m\n# date: 2026-01-01\n# command: c\n", "lacks source"),
        (HEADER.format(commit="x", date="2026-1-1", command="c"), "not YYYY-MM-DD"),
        (HEADER.format(commit="x", date="2026-01-01", command="c") + "# colour: red\n", "unknown header key"),
        (HEADER.format(commit="x", date="2026-01-01", command="c") + "RESULT toy target=1\n", "without a number"),
    ],
)
def test_a_file_that_breaks_the_format_is_named_with_what_is_wrong(tmp_path: Path, header: str, message: str) -> None:
    path = tmp_path / "2026-01-01-01-toy.txt"
    path.write_text(header)
    with pytest.raises(ValueError, match=message):
        results.read_session(path)
