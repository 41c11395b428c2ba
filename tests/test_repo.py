"""Repository metadata: one version source, the license, and one ruff version for `make lint` and pre-commit."""

import importlib.metadata
import re
from pathlib import Path

import pytest

import fusedmoe

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_version_has_one_source():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "fusedmoe.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", fusedmoe.__version__)
    # the installed distribution reports the package's version (`make setup` reinstalls on a pyproject change)
    assert importlib.metadata.version("fusedmoe") == fusedmoe.__version__


def test_license_file_and_metadata_agree():
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License") and "Version 2.0, January 2004" in text
    assert "Copyright 2026 The fusedmoe authors" in text


def test_pre_commit_runs_the_ruff_that_the_dev_extra_pins():
    pins = [d for d in PYPROJECT["project"]["optional-dependencies"]["dev"] if d.startswith("ruff")]
    assert len(pins) == 1 and re.fullmatch(r"ruff==[\d.]+", pins[0]), pins
    config = (ROOT / ".pre-commit-config.yaml").read_text()
    hooks = re.findall(r"entry: ruff (\w+)", config)
    assert sorted(hooks) == ["check", "format"]
    assert set(re.findall(r'"(ruff==[\d.]+)"', config)) == {pins[0]}
