"""``benchmarks/request_path.py``: the pdserve files one HTTP infer and one gRPC ModelInfer
on an ONNX model run, and their re-entry cycles, stay at or under a ceiling."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "request_path.py"

# Today's figures. They only go down: lower a ceiling when the request path gets shorter.
# The goal is 10 files each and no re-entry cycle. Each ceiling counts
# backends/base.py (run_on_thread), which the path enters when the ONNX session runs on
# its instance's thread (``execution_thread: auto`` on a slow or loaded machine), not
# when it runs on the event loop.
HTTP_FILES_CEILING = 14
GRPC_FILES_CEILING = 15
HTTP_CYCLES_CEILING = 0
GRPC_CYCLES_CEILING = 0

ONNX_BACKEND = "backends/onnxruntime/"
SERVER_CORE = "server.py"


@pytest.fixture(scope="module")
def measured() -> dict[str, Any]:
    """The script's ``--json`` result on this checkout's pdserve."""
    if not (ROOT / "examples" / "model_repository" / "tiny").is_dir():
        pytest.skip("no example model repository: run `make examples`")
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--json"],
        capture_output=True,
        text=True,
        timeout=280,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@pytest.mark.parametrize(
    ("protocol", "files_ceiling", "cycles_ceiling"),
    [
        ("http", HTTP_FILES_CEILING, HTTP_CYCLES_CEILING),
        ("grpc", GRPC_FILES_CEILING, GRPC_CYCLES_CEILING),
    ],
)
def test_request_path_stays_short(
    measured: dict[str, Any], protocol: str, files_ceiling: int, cycles_ceiling: int
) -> None:
    result = measured[protocol]
    files = result["files"]
    assert files and result["count"] == len(files) == len(set(files)), result
    assert any(f.startswith(ONNX_BACKEND) for f in files), files
    assert SERVER_CORE in files, files
    assert result["count"] <= files_ceiling, "\n".join(files)
    assert len(result["cycles"]) <= cycles_ceiling, result["cycles"]
    for cycle in result["cycles"]:
        assert cycle[0] == cycle[-1] and set(cycle) <= set(files), cycle


def test_the_frontends_come_first(measured: dict[str, Any]) -> None:
    assert measured["http"]["files"][0].startswith("frontends/http/")
    assert measured["grpc"]["files"][0].startswith("frontends/grpc/")


@pytest.fixture(scope="module")
def script(request: pytest.FixtureRequest) -> ModuleType:
    """``benchmarks/request_path.py`` imported as a module (it imports ``common``)."""
    import importlib.util

    sys.path.insert(0, str(SCRIPT.parent))
    request.addfinalizer(lambda: sys.path.remove(str(SCRIPT.parent)))
    spec = importlib.util.spec_from_file_location("request_path", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cycles_are_elementary_and_each_found_once(script: ModuleType) -> None:
    nodes = ["a", "b", "c", "d"]
    edges = [("a", "b"), ("b", "a"), ("b", "c"), ("c", "a"), ("c", "d")]
    assert script.cycles(nodes, edges) == [["a", "b", "a"], ["a", "b", "c", "a"]]
    assert script.cycles(nodes, [("a", "b"), ("b", "c"), ("a", "c")]) == []
    assert script.cycles(["server.py", "rollout.py"], [("rollout.py", "server.py")]) == []


def test_path_keeps_what_every_request_ran_and_no_idle_window_did(script: ModuleType) -> None:
    def enter(file: str, name: str) -> list[Any]:
        return ["enter", file, name, 1]

    def call(caller: str, file: str, name: str) -> list[Any]:
        return ["call", caller, file, name, 1]

    first = [
        enter("front.py", "handle"),
        call("front.py", "server.py", "infer"),
        enter("server.py", "infer"),
        call("server.py", "rollout.py", "route"),
        enter("rollout.py", "route"),
        call("rollout.py", "server.py", "dispatch"),
        enter("server.py", "dispatch"),
        enter("timer.py", "tick"),
        call("loop.py", "server.py", "dispatch"),
    ]
    second = [e for e in first if e[1] != "timer.py"] + [enter("rollout.py", "_run")]
    idle = [enter("rollout.py", "_run"), enter("metrics.py", "scrape")]
    result = script.path_of([first, second], [idle])
    # loop.py only calls: it counts (its code ran) though none of its functions was entered
    assert result["files"] == ["front.py", "server.py", "rollout.py", "loop.py"]
    assert result["count"] == 4
    assert result["cycles"] == [["server.py", "rollout.py", "server.py"]]
    assert result["unsteady_files"] == ["timer.py"]
    assert result["idle_files"] == []
