"""Helpers shared by the traffic-control integration tests (split, shadow, rollout, marker)."""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from http.client import HTTPConnection, HTTPException
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import GOLDENS, ServerProcess

#: The input the tiny models get; version N of ``tiny_all_versions`` answers
#: ``relu(X @ W) + N``.
X = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)


def base_output() -> np.ndarray:
    """``relu(X @ W)``: what version N of tiny_all_versions returns, minus N."""
    w = np.load(GOLDENS / "tiny.npz")["W"]
    return np.maximum(X @ w, 0)


def http(
    server: ServerProcess,
    method: str,
    path: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60,
) -> tuple[int, Any, dict[str, str]]:
    """One HTTP call; returns (status, parsed JSON body or None, response headers)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=data, method=method)
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw, hdrs = r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as e:
        status, raw, hdrs = e.code, e.read(), dict(e.headers)
    return status, (json.loads(raw) if raw.strip() else None), hdrs


def infer_tiny(
    server: ServerProcess, model: str, headers: dict[str, str] | None = None, version: str = ""
) -> tuple[int, Any]:
    """A JSON inference of X on a tiny model; (status, body)."""
    path = f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"
    body = {
        "inputs": [
            {"name": "INPUT0", "datatype": "FP32", "shape": [1, 64], "data": X.ravel().tolist()}
        ]
    }
    status, doc, _ = http(server, "POST", path, body, headers)
    return status, doc


def offset_of(doc: dict[str, Any]) -> float:
    """The N a tiny_all_versions answer was computed with (its output minus relu(X W))."""
    out = np.asarray(doc["outputs"][0]["data"], dtype=np.float32).reshape(1, 64)
    return float(np.round(np.mean(out - base_output()), 3))


def wait_for(check: Callable[[], Any], timeout: float = 30, what: str = "") -> Any:
    """Poll ``check`` until it returns a truthy value; fail after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what or check}")
        time.sleep(0.05)


def metric_value(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample in a Prometheus exposition (None when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def scrape(server: ServerProcess) -> str:
    """The server's ``/metrics`` text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30) as r:
        return r.read().decode()


#: ``tests/data/python_models/faulty``: Y = X, faults switched by ``fault.<version>``.
FAULTY = Path(__file__).resolve().parent / "data" / "python_models" / "faulty"
XF = np.array([[1.0, 2.0, 3.0, 4.0]], dtype=np.float32)


def faulty_model(repo: Path, name: str, versions: int, traffic: str, instances: int = 1) -> Path:
    """Copy the faulty model into ``repo`` as ``name`` with versions 1..``versions``
    and ``traffic`` as its traffic.yaml; the model folder."""
    dst = repo / name
    shutil.copytree(FAULTY, dst)
    cfg = (dst / "config.pbtxt").read_text().replace('name: "faulty"', f'name: "{name}"')
    cfg = cfg.replace("count: 1,", f"count: {instances},")
    (dst / "config.pbtxt").write_text(cfg)
    for v in range(2, versions + 1):
        shutil.copytree(dst / "1", dst / str(v))
    (dst / "traffic.yaml").write_text(traffic)
    return dst


def infer_faulty(server: ServerProcess, model: str, timeout: float = 60) -> tuple[int, Any]:
    """A JSON inference of XF on a faulty model; (status, body)."""
    body = {
        "inputs": [{"name": "X", "datatype": "FP32", "shape": [1, 4], "data": XF.ravel().tolist()}]
    }
    status, doc, _ = http(server, "POST", f"/v2/models/{model}/infer", body, timeout=timeout)
    return status, doc


class Load:
    """Client threads sending requests to one model without pause over keep-alive
    HTTP connections; every answer is recorded as ``(monotonic s, status, version)``."""

    def __init__(self, server: ServerProcess, model: str, threads: int = 2) -> None:
        self.server = server
        self.model = model
        self.results: list[tuple[float, int, str]] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        self._body = json.dumps(
            {
                "inputs": [
                    {"name": "X", "datatype": "FP32", "shape": [1, 4], "data": XF.ravel().tolist()}
                ]
            }
        ).encode()

    def __enter__(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _run(self) -> None:
        conn = HTTPConnection("127.0.0.1", self.server.http_port, timeout=60)
        path = f"/v2/models/{self.model}/infer"
        while not self._stop.is_set():
            try:
                conn.request("POST", path, self._body, {"Content-Type": "application/json"})
                r = conn.getresponse()
                raw = r.read()
                version = json.loads(raw).get("model_version", "") if r.status == 200 else ""
                self.results.append((time.monotonic(), r.status, version))
            except (OSError, HTTPException):
                self.results.append((time.monotonic(), 0, ""))
                conn.close()
                conn = HTTPConnection("127.0.0.1", self.server.http_port, timeout=60)
        conn.close()

    def failures(self, since: float = 0.0) -> int:
        """Answers other than 200 since ``since``."""
        return sum(1 for t, s, _ in list(self.results) if t >= since and s != 200)
