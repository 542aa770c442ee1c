"""deploy/prometheus/pdserve-rules.yml: ``promtool check rules`` and ``promtool test rules``
(the unit tests beside it, pdserve-rules.test.yml) pass (issue 17)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

RULES_DIR = Path(__file__).resolve().parents[2] / "deploy" / "prometheus"

pytestmark = pytest.mark.skipif(
    shutil.which("promtool") is None, reason="Debian's promtool is not installed (make sysdeps)"
)


def _promtool(*args: str) -> str:
    r = subprocess.run(
        ["promtool", *args], cwd=RULES_DIR, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_rules_check() -> None:
    assert "SUCCESS: 13 rules found" in _promtool("check", "rules", "pdserve-rules.yml")


def test_rules_unit_tests() -> None:
    assert "SUCCESS" in _promtool("test", "rules", "pdserve-rules.test.yml")
