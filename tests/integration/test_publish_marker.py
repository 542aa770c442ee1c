"""Publish-by-marker (issue 12, item 7): with ``--version-ready-marker READY`` a version
folder is only a version once ``READY`` is in it, so a half-copied folder is never
loaded; removing the marker from the serving version rolls back to the previous one.
Under continuous requests, in poll mode; and ``pdserve check`` honours the flag."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import EXAMPLE_REPO, ROOT, require_examples, start_server
from tests.traffic_helpers import http, infer_tiny, offset_of, wait_for

MODEL = "published"


def _repo(tmp: Path, name: str = MODEL) -> Path:
    require_examples()
    repo = tmp / "repo"
    src = EXAMPLE_REPO / "tiny_all_versions"
    dst = repo / name
    dst.mkdir(parents=True)
    cfg = (src / "config.pbtxt").read_text().replace("tiny_all_versions", name)
    cfg = cfg.replace(
        "version_policy: { all: {} }", "version_policy: { latest: { num_versions: 1 } }"
    )
    (dst / "config.pbtxt").write_text(cfg)
    for v in (1, 2):
        shutil.copytree(src / str(v), dst / str(v))
        (dst / str(v) / "READY").touch()
    return repo


def test_marker_gates_publishing_and_rollback(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    server = start_server(
        repo,
        tmp_path / "pdserve.log",
        "--model-control-mode=poll",
        "--repository-poll-secs=0.2",
        "--version-ready-marker=READY",
    )
    results: list[tuple[int, str]] = []
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            status, doc = infer_tiny(server, MODEL)
            results.append((status, doc.get("model_version", "") if status == 200 else str(doc)))
            if status == 200:
                assert offset_of(doc) == float(doc["model_version"])

    def serving() -> list[str]:
        return http(server, "GET", f"/v2/models/{MODEL}")[1]["versions"]

    t = threading.Thread(target=load, daemon=True)
    try:
        assert serving() == ["2"]
        t.start()
        # a version folder copied in without the marker (here: half of it) is not loaded
        v3 = repo / MODEL / "3"
        v3.mkdir()
        shutil.copy(EXAMPLE_REPO / "tiny_all_versions" / "3" / "MODEL_IDENTITY.json", v3)
        time.sleep(1.5)
        assert serving() == ["2"]
        shutil.copy(EXAMPLE_REPO / "tiny_all_versions" / "3" / "model.onnx", v3)
        time.sleep(1.0)
        assert serving() == ["2"]
        # publishing: the marker appears
        (v3 / "READY").touch()
        wait_for(lambda: serving() == ["3"], 30, "version 3 to serve")
        wait_for(lambda: results and results[-1][1] == "3", 30, "a response from version 3")
        # rollback: the marker is removed from the serving version
        (v3 / "READY").unlink()
        wait_for(lambda: serving() == ["2"], 30, "the rollback to version 2")
        n = len(results)
        wait_for(lambda: len(results) > n + 20, 30, "more responses")
    finally:
        stop.set()
        t.join(30)
        server.stop()
    assert results and all(status == 200 for status, _ in results), [
        r for r in results if r[0] != 200
    ][:5]
    assert {v for _, v in results} == {"2", "3"}
    assert results[-1][1] == "2"
    assert "publish-by-marker" in server.log()


def test_check_honours_the_marker(tmp_path: Path) -> None:
    repo = _repo(tmp_path, "tiny_all_versions")  # its MODEL_IDENTITY.json names it
    (
        repo / "tiny_all_versions" / "3"
    ).mkdir()  # an unpublished, empty folder: an error without the marker
    cmd = [sys.executable, "-m", "pdserve", "check", str(repo), "--format", "json", "--no-goldens"]
    plain = subprocess.run(cmd, capture_output=True, cwd=ROOT, timeout=300)
    marked = subprocess.run(
        [*cmd, "--version-ready-marker", "READY"], capture_output=True, cwd=ROOT, timeout=300
    )
    assert plain.returncode == 1, plain.stdout[-2000:]
    assert marked.returncode == 0, marked.stdout[-2000:]
    report = json.loads(marked.stdout)
    assert report["models"][0]["versions"] == [1, 2]


@pytest.mark.parametrize("bad", ["a/b", ".."])
def test_bad_marker_flag(tmp_path: Path, bad: str) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pdserve", "serve", "--model-repository", str(tmp_path),
         f"--version-ready-marker={bad}"],
        capture_output=True,
        cwd=ROOT,
        timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and b"--version-ready-marker" in r.stderr
