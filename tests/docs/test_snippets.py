"""Docs that run: the shell and Python snippets of README.md and docs/getting-started.md,
executed against a real pdserve serving examples/model_repository.

Each ```sh / ```bash / ```python fence is a snippet. A marker on the line before the fence
changes what is done with it: ``<!-- skip: why -->`` (not run; the reason is required) or
``<!-- expect: TEXT -->`` (run; its output must contain TEXT). Every other snippet runs
and must exit 0. The documented ports (8000 HTTP, 8001 gRPC, 8002 metrics) are replaced
with the test server's; the virtual environment's bin/ comes first on PATH, as the docs
tell readers to activate it; the working directory is the repository root.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/getting-started.md")
FENCE = re.compile(r"^```(sh|bash|python)\s*$")
MARKER = re.compile(r"^<!--\s*(skip|expect):\s*(.*?)\s*-->$")


@dataclass
class Snippet:
    page: str
    line: int
    lang: str
    code: str
    skip: str | None
    expect: str | None

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def snippets(page: str) -> list[Snippet]:
    """The runnable-language fences of ``page``, with their markers."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    out = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].startswith("```"):  # another language: skip to its end
                i += 1
                while i < len(lines) and not lines[i].startswith("```"):
                    i += 1
            i += 1
            continue
        start = i
        i += 1
        body = []
        while not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        prev = lines[start - 1].strip() if start else ""
        marker = MARKER.match(prev)
        kind, text = (marker.group(1), marker.group(2)) if marker else (None, None)
        out.append(
            Snippet(
                page,
                start + 1,
                m.group(1),
                "\n".join(body) + "\n",
                text if kind == "skip" else None,
                text if kind == "expect" else None,
            )
        )
        i += 1
    return out


ALL = [s for page in PAGES for s in snippets(page)]


def test_readme_is_short() -> None:
    size = (ROOT / "README.md").stat().st_size
    assert size <= 10 * 1024, f"README.md is {size} bytes: move detail to a page under docs/"


def test_every_page_has_snippets_that_run() -> None:
    for page in PAGES:
        runs = [s for s in ALL if s.page == page and s.skip is None]
        assert len(runs) >= 3, f"{page}: only {len(runs)} snippets run"
    for s in ALL:
        assert s.skip is None or s.skip, f"{s.id}: a skip marker must say why"


def _with_ports(code: str, server: ServerProcess) -> str:
    for port, real in (
        ("8000", server.http_port),
        ("8001", server.grpc_port),
        ("8002", server.metrics_port),
    ):
        code = re.sub(rf"\b(127\.0\.0\.1|localhost):{port}\b", rf"\g<1>:{real}", code)
    return code


@pytest.mark.parametrize("snippet", [s for s in ALL if s.skip is None], ids=lambda s: s.id)
def test_snippet_runs(snippet: Snippet, example_server: ServerProcess) -> None:
    code = _with_ports(snippet.code, example_server)
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    if snippet.lang == "python":
        cmd = [sys.executable, "-c", code]
    else:
        cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{snippet.id} exited {proc.returncode}:\n{code}\n{output}"
    if snippet.expect is not None:
        assert snippet.expect in proc.stdout, f"{snippet.id}: no {snippet.expect!r} in:\n{output}"


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
