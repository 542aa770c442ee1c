"""Docs that run (first half of the pages; :mod:`tests.docs.snippets` says how), the
rules every page's markers follow, and the metrics reference against a real server."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ServerProcess
from tests.docs.snippets import ROOT, needs_default, pages, run_page, shard, snippets


def test_readme_is_short() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= 10 * 1024, f"README.md is {size} bytes: move detail to a page under docs/"


def test_markers_are_well_formed() -> None:
    """A skip says why, an expect says what, a serve says nothing; no other marker."""
    for page in pages():
        for s in snippets(page):
            if s.marker == "skip":
                assert s.text, f"{s.id}: a skip marker must say why"
            if s.marker == "expect":
                assert s.text, f"{s.id}: an expect marker must say what"
            if s.marker == "serve":
                assert not s.text, f"{s.id}: <!-- serve --> takes no text"
        lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines, 1):
            if re.match(r"^<!--\s*(skip|expect|serve)\b", line.strip()):
                nxt = lines[n].strip() if n < len(lines) else ""
                assert re.match(r"^```(sh|bash|python)\s*$", nxt), (
                    f"{page}:{n}: a marker must be on the line before a sh/bash/python fence"
                )


def test_the_getting_started_pages_run_snippets() -> None:
    for page in ("README.md", "docs/getting-started.md"):
        runs = [s for s in snippets(page) if s.runs]
        assert len(runs) >= 3, f"{page}: only {len(runs)} snippets run"


def test_every_page_is_in_a_shard() -> None:
    runnable = {p for p in pages() if any(s.runs for s in snippets(p))}
    assert set(shard(0)) | set(shard(1)) == runnable
    assert not set(shard(0)) & set(shard(1))


@pytest.mark.parametrize("page", shard(0))
def test_page_runs(page: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    default = request.getfixturevalue("example_server") if needs_default(page) else None
    run_page(page, tmp_path, default)


def test_metrics_reference_lists_every_exported_family(example_server: ServerProcess) -> None:
    """Every nv_* / pdserve_* family a real server exports is on the generated page."""
    page = (ROOT / "docs/reference/metrics.md").read_text(encoding="utf-8")
    url = f"http://127.0.0.1:{example_server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    names = set(re.findall(r"^# TYPE ((?:nv|pdserve)_\w+) ", text, re.MULTILINE))
    assert "nv_inference_request_success" in names
    missing = sorted(n for n in names if f"| `{n}` |" not in page)
    assert not missing, f"exported but not in docs/reference/metrics.md: {missing}"
