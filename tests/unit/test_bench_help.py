"""``--help`` of issue 11's benchmark scripts: the description is the docstring's whole
first paragraph (it used to stop at the first line, mid-sentence)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("script", "ending"),
    [
        ("bench_frontend.py", "measured with ``wrk``."),
        ("profile_hotpath.py", "without any HTTP transport."),
    ],
)
def test_help_description_is_the_first_paragraph(script: str, ending: str) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    description = " ".join(out.split("\n\n")[1].split())
    assert description.endswith(ending), description
