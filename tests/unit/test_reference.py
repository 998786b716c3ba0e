"""The generated references are fresh: the configuration table (docs/reference/configuration.md) and config/schema.json
from config/sections.py's option docs, the command-line options (docs/reference/cli.md) from the argparse parsers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from melissa_dl import reference
from melissa_dl.config.sections import load_config, parse_config
from melissa_dl.errors import ConfigError

STALE = "stale: run `python -m melissa_dl.reference`"
EXAMPLES = sorted((reference.ROOT / "examples").glob("*/config*.json"))


def test_the_configuration_page_table_is_the_generated_one() -> None:
    page = reference.CONFIGURATION.read_text()
    assert reference.configuration_page(page) == page, STALE


def test_the_cli_page_options_are_the_generated_ones() -> None:
    page = reference.CLI.read_text()
    assert reference.cli_page(page) == page, STALE
    assert "`--try-simulation`" in page and "`-n, --ranks RANKS`" in page  # both commands' options


def test_the_schema_file_is_the_generated_one() -> None:
    assert reference.SCHEMA.read_text() == reference.schema_text(), STALE


def test_every_option_has_a_row_with_its_default() -> None:
    rows = {key: (kind, default) for key, kind, default, _ in reference.rows()}
    assert rows["launcher.slurm.partition"] == ("string or null", "`null`")
    assert rows["study.parameters[].low"] == ("number", "required")
    assert rows["buffer.kind"] == ('one of "fifo", "firo", "reservoir"', '`"reservoir"`')
    assert "launcher.slurm" not in rows and "training" not in rows  # sections: their options only


def test_every_key_has_its_anchor_and_every_section_its_heading() -> None:
    """Issue 57, item 5: a link such as configuration.md#buffer-per_server_watermark lands on that key's row."""
    page = reference.CONFIGURATION.read_text()
    keys = [key for key, *_ in reference.rows()]
    ids = [reference.anchor(key) for key in keys]
    assert len(set(ids)) == len(ids) == len(keys) > 70
    for key in keys:
        row = f'| <a id="{reference.anchor(key)}"></a>[`{key}`](#{reference.anchor(key)}) |'
        assert sum(line.startswith(row) for line in page.splitlines()) == 1, key
    assert reference.anchor("buffer.per_server_watermark") == "buffer-per_server_watermark"
    assert reference.anchor("study.parameters[].low") == "study-parameters-low"
    assert reference.anchor("study.fields.<name>.dtype") == "study-fields-name-dtype"
    sections = [key for key, _, _ in reference.sections()]
    wanted = ["study", "launcher", "server", "buffer", "training", "checkpoint", "serving", ""]
    assert [key for key in sections if "." not in key] == wanted
    assert {"launcher.slurm", "launcher.srun", "study.adaptive", "training.window"} <= set(sections)
    for key in sections:
        heading = f"{'#' * (key.count('.') + 2)} {f'`{key}`' if key else 'Top-level keys'} {{#{reference.anchor(key)}}}"
        assert heading in page.splitlines(), heading
    assert not set(map(reference.anchor, sections)) & set(ids)  # a heading's id is no row's
    assert sorted(key for _, _, own in reference.sections() for key, *_ in own) == sorted(keys)  # each key once


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_example_configs_pass_the_schema_and_the_loader(path: Path) -> None:
    data = json.loads(path.read_text())
    jsonschema.validate(data, reference.schema())
    assert data["$schema"] == "../../config/schema.json"
    load_config(path)


@pytest.mark.parametrize(
    "change, culprit",
    [
        (lambda c: c["buffer"].update(kind="reservior"), "'reservior' is not one of"),
        (lambda c: c.update(buffr={}), "Additional properties are not allowed ('buffr' was unexpected)"),
        (lambda c: c["launcher"].update(job_limit="4"), "'4' is not of type 'integer'"),
        (lambda c: c["launcher"].pop("command"), "'command' is a required property"),
        (lambda c: c["launcher"]["slurm"].update(partiton="x"), "('partiton' was unexpected)"),
        (lambda c: c["launcher"].update(job_limit=0), "0 is less than the minimum of 1"),
        (lambda c: c["buffer"].update(capacity_samples=0), "0 is less than or equal to the minimum of 0"),
    ],
)
def test_the_schema_refuses_what_the_loader_refuses(change, culprit: str) -> None:
    config = json.loads((reference.ROOT / "examples" / "heat_pde" / "config_slurm.json").read_text())
    change(config)
    with pytest.raises(jsonschema.ValidationError, match=re.escape(culprit)):
        jsonschema.validate(config, reference.schema())
    with pytest.raises(ConfigError):
        parse_config(config, reference.ROOT)
