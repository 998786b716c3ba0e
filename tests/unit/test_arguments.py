"""melissa-server's command line, as parsed (the commands themselves: integration/test_cli.py)."""

from __future__ import annotations

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
