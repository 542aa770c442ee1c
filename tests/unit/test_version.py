"""One home for the version: pdserve/__init__.py's ``__version__``, which pyproject.toml
reads (setuptools' dynamic version), ``pdserve --version`` prints, server metadata
reports, and CHANGELOG.md has a release entry for."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import read_configuration

import pdserve
from pdserve.server import InferenceServer

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_reads_the_package_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # setuptools resolves the attr: path from here
    config = read_configuration("pyproject.toml", expand=True)
    assert "version" in config["project"]["dynamic"]
    assert config["project"]["version"] == pdserve.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+", pdserve.__version__)


def test_cli_version_is_the_package_version() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.strip() == f"pdserve {pdserve.__version__}"


def test_server_metadata_reports_the_package_version() -> None:
    server = InferenceServer.__new__(InferenceServer)
    assert server.metadata()["version"] == pdserve.__version__


def test_changelog_has_the_version() -> None:
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert "## [Unreleased]" in text
    assert re.search(
        rf"^## \[{re.escape(pdserve.__version__)}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M
    )
