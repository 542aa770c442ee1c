"""Docs that run (first half of the pages; :mod:`tests.docs.snippets` says how), the
rules every page's markers follow, and the metrics reference against a real server."""

from __future__ import annotations

import re
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import ServerProcess
from tests.docs.snippets import (
    MARKER,
    ROOT,
    PageRun,
    group_members,
    needs_default,
    pages,
    run_page,
    shard,
    snippets,
)

RUNNER_PAGE = """# A page

<!-- serve -->
```sh
pdserve serve --model-repository examples/model_repository --model-control-mode explicit
```

```sh
GREETING=hello
echo "written in the page's tmp" > /tmp/note.txt
```

<!-- expect: 200 -->
<!-- expect: hello written in the page's tmp -->
```bash
echo "$(curl -s -o /dev/null -w '%{http_code}' 127.0.0.1:8000/v2/health/ready) $GREETING $(cat /tmp/note.txt)"
```

<!-- expect: loaded: [] -->
```python
import json, urllib.request

index = json.load(urllib.request.urlopen("http://localhost:8000/v2/repository/index", data=b"{}"))
print("loaded:", [m["name"] for m in index if m.get("state") == "READY"])
```
"""


def test_readme_is_short() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= 10 * 1024, f"README.md is {size} bytes: move detail to a page under docs/"


def test_markers_are_well_formed() -> None:
    """A skip says why, an expect says what, a serve says nothing; no other marker."""
    for page in pages():
        for s in snippets(page):
            if s.marker == "skip":
                assert s.text, f"{s.id}: a skip marker must say why"
            assert all(s.expects), f"{s.id}: an expect marker must say what"
            if s.marker == "serve":
                assert not s.text, f"{s.id}: <!-- serve --> takes no text"
        lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
        for n, line in enumerate(lines, 1):
            if re.match(r"^<!--\s*(skip|expect|serve)\b", line.strip()):
                below = n
                while below < len(lines) and MARKER.match(lines[below].strip()):
                    below += 1
                nxt = lines[below].strip() if below < len(lines) else ""
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


def test_the_runner_serves_shares_variables_and_stops_the_server(tmp_path: Path) -> None:
    """A page's serve fence, shell variables carried between fences, /tmp/ and ports
    rewritten, expect markers; the server is gone once the page is done."""
    page = tmp_path / "page.md"
    page.write_text(RUNNER_PAGE)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    run = PageRun(str(page), scratch, None)
    run.setup()
    try:
        for s in snippets(str(page)):
            run.serve(s) if s.marker == "serve" else run.run(s)
        (server,) = run.servers
        assert run.ports[8000] != 8000
        assert (scratch / "tmp" / "note.txt").read_text() == "written in the page's tmp\n"
    finally:
        run.close()
    assert server.proc.poll() is not None
    assert group_members(server.proc.pid) == []


@pytest.mark.parametrize(
    ("fence", "message"),
    [
        ("```sh\nfalse\necho not reached\n```\n", "exited 1"),
        ("<!-- expect: palace -->\n```sh\necho tower\n```\n", "no 'palace' in"),
        ("<!-- expect: a -->\n<!-- expect: b -->\n```sh\necho a\n```\n", "no 'b' in"),
        ("```python\nraise SystemExit(3)\n```\n", "exited 3"),
        ("<!-- serve -->\n```sh\npdserve serve --no-such-flag\n```\n", "the server exited with 2"),
    ],
    ids=["exit-status", "expect", "two-expects", "python", "serve"],
)
def test_a_wrong_snippet_fails(tmp_path: Path, fence: str, message: str) -> None:
    page = tmp_path / "page.md"
    page.write_text(f"# A page\n\n{fence}")
    (tmp_path / "scratch").mkdir()
    with pytest.raises(AssertionError, match=re.escape(message)):
        run_page(str(page), tmp_path / "scratch", None)


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
