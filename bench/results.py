"""Write bench/RESULTS.md, the current figure of every benchmark, from the raw outputs in bench/history/.

    python bench/results.py          # (re)writes bench/RESULTS.md
    python bench/results.py --check  # exit 1, with one line, when bench/RESULTS.md is not what it would write

bench/history/ holds one text file per recorded measurement session of one command, named
``<date>-<nn>-<bench>[-<what>].txt`` (``nn`` orders one day's files). A file starts with a header of
``# key: value`` lines; from its first other line on it is the command's raw output, several runs of the command
one after the other (their ``RESULT`` lines and whatever else they printed)::

    # commit: aba4805             the code measured: a commit, "code of 6ea0bf4, not yet committed", "not stated"
    # machine: AMD EPYC           the CPU model or GPU, as the table shows it
    # date: 2026-11-27
    # command: .venv/bin/python bench/ingest.py
    # source: raw output          or "transcribed from bench/RESULTS.md at <commit>" where only figures were kept
    # load: 0.94, 0.31            optional: the 1-minute load (`uptime`) before each run, or "not recorded"
    # variant: batch 65536        optional: its lines become rows "<name> (batch 65536)", beside the default's
    # user: root                  optional: who ran the command, shown after it
    # note: ...                   optional, repeatable: machine details, what the record lacks

A line ``RESULT <name> ratio=<x> [target=<t>] [unit=<u>] ...`` is one run's figure for ``<name>``. For every name
(and variant) the page shows the newest file holding it (by date, then file name): the median of that file's
values, then every run's value in order; the target from ``target=`` (``none``, ``-`` or no ``target=``: no
target), compared ``>=`` unless AT_MOST lists the name (NOT_ITS_TARGET and TARGET_LABELS: the exceptions); met
when the median meets it, with "(k of n runs)" when the runs disagree. bench/readings.md, a short reading per
benchmark, follows the table as it is.

To add a measurement: save the command's output as a new file in bench/history/ with the header above (keep
``uptime`` before each run), run ``python bench/results.py``, and commit the file and the page together.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from decimal import ROUND_HALF_EVEN, Decimal, InvalidOperation
from fnmatch import fnmatch
from pathlib import Path

BENCH = Path(__file__).resolve().parent
HISTORY = BENCH / "history"
PAGE = BENCH / "RESULTS.md"
READINGS = BENCH / "readings.md"

KEYS = ("commit", "machine", "date", "command", "source", "load", "variant", "user", "note")
REQUIRED = KEYS[:5]
REPEATABLE = ("load", "note")
AT_MOST = (
    *("step_overhead_*", "checkpoint_stall", "scale_round_p99", "scale_memory_per_simulation", "scale_cost_growth"),
    "windows_memory",
    "inference_latency_*",
)
NOT_ITS_TARGET = {"train_step_unpinned_cuda": "the same target printed"}  # the line's target= is another line's
TARGET_LABELS = {"sparse_rowadagrad_*_cuda": "the CPU's", "sparse_adam_*_cuda": "the CPU's"}
ORDER = (  # the benchmarks' rows in this order, each named by its bench/<name>.py
    *("ingest", "parts", "pipeline", "online_vs_offline", "sparse_optim", "train_step", "sharded"),
    *("step_overhead", "checkpoint", "spawn", "active_sampling", "scale", "persistent"),
    *("blocks", "windows", "online_vs_offline_rollout", "inference"),
)
NO_TARGET = ("none", "-")

HEADER_LINE = re.compile(r"# ([a-z]+): (.*)")
RESULT_LINE = re.compile(r"RESULT (\S+)(.*)")
DATE = re.compile(r"\d{4}-\d\d-\d\d")
COLUMNS = ("RESULT name", "current figure", "target", "met", "commit", "machine", "date", "command")

INTRO = """\
# Benchmark results

<!-- Written by `python bench/results.py` from bench/history/ and bench/readings.md: edit those, not this page. -->

The current figure of every `RESULT <name> ratio=<x> target=<t> ...` line that a `bench/*.py` script prints, a
ratio against a baseline measured in the same run (what each measures: docs/explanation/performance.md).

- **Current figure**: the median of the newest recorded session's runs, then every run's value in order.
- **Target**: the line's `target=`, as `>=` or `<=`; **met**: the median against it, and how many runs met it
  where they disagree. "not stated": the record does not say.
- **Machine**: 2-core virtualised **Intel Xeon** or **AMD EPYC**, whose ratios are not comparable (FBGEMM ran ten
  times faster on the AMD machine); the `_cuda` lines ran on one **NVIDIA H200** (driver 580.159.04, torch
  2.11.0+cu130, 16 cores) through `scripts/gpu-checklist`.
- **History**: each session's raw output, with its commit, machine, date, command and load, is a file in
  `bench/history/` (its header: `bench/results.py`'s docstring); every run up to 60a956f, with what was tried,
  is the old diary: `git show 60a956f:bench/RESULTS.md`. To add a measurement: save its output there under
  such a header, then run `python bench/results.py`.
"""


@dataclass
class Session:
    """One file of bench/history/: its header and, per RESULT name, each run's fields in order."""

    path: Path
    header: dict[str, str]
    runs: dict[str, list[dict[str, str]]]


@dataclass(frozen=True)
class Row:
    name: str
    figure: str
    target: str
    met: str
    commit: str
    machine: str
    date: str
    command: str


def read_header(path: Path, lines: list[str]) -> tuple[dict[str, str], int]:
    """The ``# key: value`` lines at the top (repeatable keys joined by "; ") and how many there are."""
    header: dict[str, str] = {}
    count = 0
    for line in lines:
        match = HEADER_LINE.fullmatch(line)
        if not match:
            break
        key, value = match.groups()
        if key not in KEYS:
            raise ValueError(f"{path.name}: unknown header key {key!r} (known: {', '.join(KEYS)})")
        if key in header and key not in REPEATABLE:
            raise ValueError(f"{path.name}: header key {key!r} twice")
        header[key] = f"{header[key]}; {value}" if key in header else value
        count += 1
    missing = [key for key in REQUIRED if key not in header]
    if missing:
        raise ValueError(f"{path.name}: header lacks {', '.join(missing)}")
    if not DATE.fullmatch(header["date"]):
        raise ValueError(f"{path.name}: date {header['date']!r} is not YYYY-MM-DD")
    return header, count


def read_session(path: Path) -> Session:
    lines = path.read_text().splitlines()
    header, start = read_header(path, lines)
    runs: dict[str, list[dict[str, str]]] = {}
    for number, line in enumerate(lines[start:], start + 1):
        match = RESULT_LINE.match(line)
        if not match:
            continue
        name, rest = match.groups()
        fields = dict(item.split("=", 1) for item in rest.split() if "=" in item)
        try:
            Decimal(fields["ratio"])
        except (KeyError, InvalidOperation):
            raise ValueError(f"{path.name}:{number}: a RESULT line without a number as its ratio=") from None
        runs.setdefault(name, []).append(fields)
    return Session(path, header, runs)


def median(values: list[str]) -> str:
    """The middle value as printed, or the mean of the two middle ones to as many decimals as they have."""
    ordered = sorted(values, key=lambda v: (Decimal(v).is_nan(), Decimal(v) if not Decimal(v).is_nan() else 0))
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    low, high = ordered[middle - 1], ordered[middle]
    places = max(decimals(low), decimals(high))
    mean = (Decimal(low) + Decimal(high)) / 2
    return str(mean if mean.is_nan() else mean.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_EVEN))


def decimals(value: str) -> int:
    exponent = Decimal(value).as_tuple().exponent
    return -exponent if isinstance(exponent, int) and exponent < 0 else 0


def meets(value: str, target: str, at_most: bool) -> bool:
    number = Decimal(value)
    if number.is_nan():
        return False
    return number <= Decimal(target) if at_most else number >= Decimal(target)


def target_and_met(name: str, runs: list[dict[str, str]], figure: str) -> tuple[str, str]:
    """The target column (direction, value, label) and the met column of one RESULT name's runs."""
    target = runs[-1].get("target", "none")
    if name in NOT_ITS_TARGET:
        return f"none ({NOT_ITS_TARGET[name]})", "—"
    if target in NO_TARGET:
        return "none", "—"
    at_most = any(fnmatch(name, pattern) for pattern in AT_MOST)
    labels = [label for pattern, label in TARGET_LABELS.items() if fnmatch(name, pattern)]
    text = f"{'<=' if at_most else '>='} {target}" + "".join(f" ({label})" for label in labels)
    met = "yes" if meets(figure, target, at_most) else "no"
    hits = sum(meets(run["ratio"], target, at_most) for run in runs)
    if 0 < hits < len(runs):
        met += f" ({hits} of {len(runs)} runs)"
    return text, met


def row(session: Session, name: str) -> Row:
    runs = session.runs[name]
    values = [run["ratio"] for run in runs]
    figure = median(values)
    target, met = target_and_met(name, runs, figure)
    unit = f" {runs[-1]['unit']}" if "unit" in runs[-1] else ""
    every = ", ".join(values) if len(values) > 1 else "one run"
    header = session.header
    label = f"`{name}`" + (f" ({header['variant']})" if "variant" in header else "")
    command = f"`{header['command']}`" + (f" ({header['user']})" if "user" in header else "")
    return Row(
        label, f"{figure}{unit} ({every})", target, met, header["commit"], header["machine"], header["date"], command
    )


def bench_of(session: Session) -> int:
    """Where the session's benchmark (the ``bench/<name>.py`` of its command) stands in ORDER; unknown ones last."""
    match = re.search(r"bench/(\w+)\.py", session.header["command"])
    return ORDER.index(match.group(1)) if match and match.group(1) in ORDER else len(ORDER)


def current_rows(sessions: list[Session]) -> list[Row]:
    """One row per RESULT name and variant, from the newest session holding it (by date, then file name)."""
    newest: dict[tuple[str, str], tuple[Session, str]] = {}
    for session in sorted(sessions, key=lambda s: (s.header["date"], s.path.name)):
        for name in session.runs:
            newest[(name, session.header.get("variant", ""))] = (session, name)
    chosen = sorted(newest.values(), key=lambda pair: order_key(*pair))
    return [row(session, name) for session, name in chosen]


def order_key(session: Session, name: str) -> tuple[int, str, str, int]:
    return bench_of(session), session.header["date"], session.path.name, list(session.runs).index(name)


def table(rows: list[Row]) -> list[str]:
    """The markdown table; a command the same as the row above's reads "as above"."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    previous = None
    for one in rows:
        cells = [one.name, one.figure, one.target, one.met, one.commit, one.machine, one.date]
        cells.append("as above" if one.command == previous else one.command)
        previous = one.command
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines


def page(history: Path = HISTORY, readings: Path = READINGS) -> str:
    sessions = [read_session(path) for path in sorted(history.glob("*.txt"))]
    text = INTRO + "\n" + "\n".join(table(current_rows(sessions))) + "\n"
    if readings.exists():
        text += "\n" + readings.read_text()
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if bench/RESULTS.md is not what it would write")
    args = parser.parse_args(argv)
    text = page()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print("bench/RESULTS.md is stale: run `python bench/results.py`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
