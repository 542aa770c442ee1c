"""``--help`` of every benchmark script (``benchmarks/common.py`` ``cli_parser``): it exits
0, its description is the docstring's whole first paragraph (it used to stop at the first
line, mid-sentence), and its examples use only the script's own options."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "common.py")


@cache
def all_helps() -> dict[str, tuple[int, str, str]]:
    """``(exit code, stdout, stderr)`` of ``--help`` for every script, two at a time."""

    def run(script: str) -> tuple[int, str, str]:
        out = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / script), "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env={**os.environ, "COLUMNS": "100"},
        )
        return out.returncode, out.stdout, out.stderr

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(SCRIPTS, pool.map(run, SCRIPTS), strict=True))


def sections(help_text: str) -> tuple[str, str, str]:
    """(description, options, epilog) of an argparse ``--help`` text."""
    blocks = help_text.split("\n\n")
    description = " ".join(blocks[1].split())
    rest = "\n\n".join(blocks[2:])
    options, _, epilog = rest.partition("\nexamples:\n")
    if not epilog:
        options, _, epilog = rest.partition("\ndetails:")
    return description, options, epilog


def test_every_script_is_covered() -> None:
    assert len(SCRIPTS) >= 25, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_is_whole_and_true(script: str) -> None:
    rc, out, err = all_helps()[script]
    assert rc == 0, err
    assert out.startswith(f"usage: {script}"), out
    description, options, epilog = sections(out)
    assert description.endswith((".", ":")), description
    assert "``" not in description and "**" not in description, description
    assert f"details: the docstring at the top of benchmarks/{script}" in out
    assert f"benchmarks/{script}" in epilog, f"{script}: no usage example in --help"
    for flag in set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", epilog)):
        assert re.search(rf"(?<![\w-]){flag}\b", options), f"{script}: example uses {flag}"


@pytest.mark.parametrize(
    ("script", "ending"),
    [
        ("bench_frontend.py", "measured with wrk."),
        ("profile_hotpath.py", "without any HTTP transport."),
        ("bench_bucketing.py", "(minilm's padding policy)."),
    ],
)
def test_description_is_the_first_paragraph(script: str, ending: str) -> None:
    description = sections(all_helps()[script][1])[0]
    assert description.endswith(ending), description
