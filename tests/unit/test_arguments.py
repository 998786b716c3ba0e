"""melissa-server's command line, as parsed (the commands themselves: integration/test_cli.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from melissa_dl.cli import parse_args


@pytest.mark.parametrize(
    "argv",
    [
        ["--try-simulation", "config.json", "--parameters", "160", "3.0"],
        ["--try-simulation", "--parameters", "160", "3.0", "config.json"],  # argparse alone took it as a value
    ],
)
def test_the_configuration_may_follow_the_parameters(argv: list[str]) -> None:
    args = parse_args(argv)
    assert (args.config, args.parameters) == ("config.json", [160.0, 3.0])


def test_a_parameter_that_is_not_a_number_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        parse_args(["config.json", "--try-simulation", "--parameters", "160", "hot"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip().endswith("error: argument --parameters: 'hot' is not a number")


STATUS = {
    "state": "running",
    "updated": 0.0,
    "elapsed_s": 20.0,
    "percent": 50.0,
    "eta_s": 20.0,
    "simulations": {"queued": 0, "running": 2, "ending": 0, "done": 2, "failed": 0, "total": 4},
    "samples": {"received": 200, "expected": 400, "consumed": 150},
    "MB_per_s": 1.5,
    "buffers": [10, 12],
    "refused": {},
    "training": None,
}


@pytest.mark.parametrize("command", ["--help", "--status", "--check"])
def test_help_status_and_a_configurations_parsing_do_not_import_torch(command: str, tmp_path: Path) -> None:
    """torch takes 1.5 s to import on an idle machine, 15 s on a busy login node: what reads a file or parses the
    command line does without it (issue 57, item 2)."""
    (tmp_path / "status.json").write_text(json.dumps(STATUS))
    (tmp_path / "config.json").write_text(json.dumps({"study": {"no_such_key": 1}}))
    argv = {"--help": ["--help"], "--status": ["--status", str(tmp_path)], "--check": ["--check", "config.json"]}
    probe = (
        "import sys\nfrom melissa_dl.cli import main\ntry:\n    code = main(sys.argv[1:])\n"
        "except SystemExit as exit_:\n    code = exit_.code\n"
        "print('exit', code, 'torch' in sys.modules)"
    )
    run = subprocess.run(
        [sys.executable, "-c", probe, *argv[command]], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    expected = {"--help": 0, "--status": 0, "--check": 2}[command]
    assert run.stdout.strip().splitlines()[-1] == f"exit {expected} False", run
    if command == "--status":
        assert "50% done" in run.stdout
    if command == "--check":
        assert "no_such_key" in run.stderr
