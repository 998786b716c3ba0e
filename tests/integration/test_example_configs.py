"""Every example's config passes ``melissa-server --check`` where the docs tell users to run it: from the
example's folder, as shipped. The C and Fortran heat configs name ``build/native``'s programs, which ``make
native`` builds; here they are pointed at the ones the ``native`` fixture built. The Slurm config is checked
against the test cluster in test_slurm.py."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from support import ROOT, clean_environment

CONFIGS = sorted(path for path in (ROOT / "examples").glob("*/config*.json") if path.name != "config_slurm.json")
NATIVE_PROGRAMS = "../../build/native/bin/"


def check(config: Path, tmp_path: Path, native: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``melissa-server --check`` in the example's folder; its output_dir moved under ``tmp_path`` (--check
    creates it to prove it can be written) and, with ``native``, the native programs taken from there."""
    settings = json.loads(config.read_text())
    settings["output_dir"] = str(tmp_path / "output")
    command = settings["launcher"]["command"]
    if native is not None and command[0].startswith(NATIVE_PROGRAMS):
        command[0] = str(native / command[0].removeprefix(NATIVE_PROGRAMS))
    with tempfile.NamedTemporaryFile("w", dir=config.parent, prefix=".check-", suffix=".json", delete=False) as file:
        json.dump(settings, file)  # beside the example: its paths are relative to it
    written = Path(file.name)
    try:
        return subprocess.run(
            [sys.executable, "-m", "melissa_dl", "--check", written.name],
            cwd=config.parent,
            env=clean_environment(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        written.unlink()


@pytest.mark.parametrize("config", CONFIGS, ids=lambda path: f"{path.parent.name}/{path.name}")
def test_every_example_config_passes_the_check(config: Path, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if config.parent.name == "openmm":  # its training module imports OpenMM, as test_examples_openmm.py
        pytest.importorskip("openmm")
    native = None
    if NATIVE_PROGRAMS in config.read_text():
        native = request.getfixturevalue("native")
    done = check(config, tmp_path, native)
    assert done.returncode == 0, done.stderr
    checked, shipped = json.loads(done.stdout), json.loads(config.read_text())  # checked: with its defaults
    assert checked["study"]["simulations"] == shipped["study"]["simulations"]
    assert checked["launcher"]["command"][1:] == shipped["launcher"]["command"][1:]


def test_the_examples_are_all_checked() -> None:
    """A new example folder is picked up by the glob: at least the ones the docs walk through."""
    names = {f"{path.parent.name}/{path.name}" for path in CONFIGS}
    assert {"heat_pde/config.json", "heat_pde/config_c.json", "burgers/config.json"} <= names
    assert {"node_features/config.json", "openmm/config.json"} <= names
