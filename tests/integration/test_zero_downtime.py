"""Zero-downtime model updates and graceful shutdown under continuous load (issue 5).

Client threads (HTTP and gRPC) send requests without pause while the model
repository changes: a new version appears, a broken version fails to load and is
fixed, the model is rolled back, other models come and go; then the server gets
SIGTERM. The checks:

- no request fails, except those answered after SIGTERM with 503 / UNAVAILABLE
  (or refused once the listeners closed);
- every response names a version that could have been serving while the request
  was in flight: a version is allowed from the moment the change that brings it in
  starts until the moment a client has seen it gone; and each response's data is
  what that version computes (``relu(x @ W) + offset``, the offset told by the
  version's model file), so a version number and the model behind it cannot
  disagree.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from pdserve.app.rollback import rollback
from tests.conftest import (
    EXAMPLE_REPO,
    GOLDENS,
    ServerProcess,
    copy_models,
    descendants,
    start_server,
)
from tests.http_wire import tiny_body

SOURCE = EXAMPLE_REPO / "tiny_all_versions"  # version N computes relu(x @ W) + N
X = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
ZD_CONFIG = """name: "zd"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]
"""


def base_output() -> np.ndarray:
    w = np.load(GOLDENS / "tiny.npz")["W"]
    return np.maximum(X @ w, 0)


@dataclass
class Result:
    """One request as a client saw it."""

    protocol: str
    model: str
    sent: float
    received: float
    version: str | None = None
    output: np.ndarray | None = None
    error: str | None = None
    rejected: bool = False  # 503 / UNAVAILABLE / CANCELLED / connection refused or reset


@dataclass
class Timeline:
    """When each version of ``zd`` may serve: intervals [start, end] (end: seen gone)."""

    intervals: dict[str, list[list[float]]] = field(default_factory=dict)
    offsets: dict[str, float] = field(default_factory=dict)

    def begin(self, version: str, offset: float) -> None:
        self.offsets[version] = offset
        self.intervals.setdefault(version, []).append([time.monotonic(), math.inf])

    def end(self, version: str) -> None:
        self.intervals[version][-1][1] = time.monotonic()

    def allows(self, r: Result) -> bool:
        return any(
            r.received >= start and r.sent <= end
            for start, end in self.intervals.get(r.version, [])
        )


class Load:
    """Client threads sending requests back to back until stopped."""

    def __init__(self, server: ServerProcess, plan: list[tuple[str, str]]) -> None:
        self.server = server
        self.results: list[Result] = []
        self.stop_event = threading.Event()
        self.threads = [
            threading.Thread(target=self._run, args=(proto, model), daemon=True)
            for proto, model in plan
        ]
        self._lock = threading.Lock()

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.stop_event.set()
        for t in self.threads:
            t.join(30)

    def count(self, model: str) -> int:
        with self._lock:
            return sum(1 for r in self.results if r.model == model and r.error is None)

    def _record(self, r: Result) -> None:
        with self._lock:
            self.results.append(r)

    def _run(self, protocol: str, model: str) -> None:
        send = self._http_sender(model) if protocol == "http" else self._grpc_sender(model)
        while not self.stop_event.is_set():
            r = send()
            self._record(r)
            if r.rejected and self.server.proc.poll() is not None:
                return
            if r.error is not None:
                time.sleep(0.01)

    def _http_sender(self, model: str) -> Callable[[], Result]:
        body = tiny_body(X)
        conn: list[http.client.HTTPConnection | None] = [None]

        def send() -> Result:
            sent = time.monotonic()
            try:
                if conn[0] is None:
                    conn[0] = http.client.HTTPConnection(
                        "127.0.0.1", self.server.http_port, timeout=30
                    )
                conn[0].request(
                    "POST", f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"}
                )
                resp = conn[0].getresponse()
                data = resp.read()
                status = resp.status
            except OSError as e:  # refused or reset: only acceptable once shutdown began
                conn[0] = None
                return Result("http", model, sent, time.monotonic(), error=repr(e), rejected=True)
            received = time.monotonic()
            doc = json.loads(data)
            if status != 200:
                return Result(
                    "http", model, sent, received, error=f"{status} {doc}", rejected=status == 503
                )
            out = np.array(doc["outputs"][0]["data"], dtype=np.float32).reshape(1, 64)
            return Result("http", model, sent, received, doc["model_version"], out)

        return send

    def _grpc_sender(self, model: str) -> Callable[[], Result]:
        client = grpcclient.InferenceServerClient(self.server.grpc_url)
        inp = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
        inp.set_data_from_numpy(X)

        def send() -> Result:
            sent = time.monotonic()
            try:
                r = client.infer(model, [inp], client_timeout=30)
            except InferenceServerException as e:
                return Result(
                    "grpc",
                    model,
                    sent,
                    time.monotonic(),
                    error=str(e),
                    # UNAVAILABLE: refused by pdserve or by a closed port; CANCELLED:
                    # the gRPC server stopping (both acceptable only after SIGTERM)
                    rejected=str(e.status()) in ("StatusCode.UNAVAILABLE", "StatusCode.CANCELLED"),
                )
            received = time.monotonic()
            return Result(
                "grpc", model, sent, received, r.get_response().model_version, r.as_numpy("OUTPUT0")
            )

        return send


def served(server: ServerProcess, model: str) -> list[str] | None:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("GET", f"/v2/models/{model}")
        resp = conn.getresponse()
        data = resp.read()
    finally:
        conn.close()
    return json.loads(data)["versions"] if resp.status == 200 else None


def index(server: ServerProcess) -> dict[tuple[str, str | None], dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    try:
        conn.request("POST", "/v2/repository/index", b"{}")
        rows = json.loads(conn.getresponse().read())
    finally:
        conn.close()
    return {(r["name"], r.get("version")): r for r in rows}


def wait_for(check: Callable[[], Any], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def publish(src: Path, dst: Path) -> None:
    stage = dst.parent / f".stage-{dst.name}"
    shutil.copytree(src, stage)
    os.replace(stage, dst)


def make_repo(root: Path, versions: dict[int, int]) -> Path:
    """A repository with ``tiny`` and ``zd`` (version -> tiny_all_versions source version)."""
    repo = copy_models(root / "repo", "tiny")
    (repo / "zd").mkdir()
    (repo / "zd" / "config.pbtxt").write_text(ZD_CONFIG)
    for v, src in versions.items():
        shutil.copytree(SOURCE / str(src), repo / "zd" / str(v))
    return repo


def progress(load: Load, model: str = "zd", n: int = 20, timeout: float = 30) -> None:
    """Wait until ``n`` more requests to ``model`` succeeded (traffic really flows)."""
    target = load.count(model) + n
    wait_for(lambda: load.count(model) >= target, f"{n} more responses from {model}", timeout)


def terminate(server: ServerProcess, timeout: float = 60) -> tuple[float, int]:
    t_term = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    return t_term, server.proc.wait(timeout)


def check(load: Load, timeline: Timeline, t_term: float) -> None:
    """Every failure is a rejection after SIGTERM; every response is from an allowed
    version and carries that version's output."""
    base = base_output()
    tiny = np.maximum(X @ (2 * np.load(GOLDENS / "tiny.npz")["W"]), 0)
    problems = []
    for r in load.results:
        if r.error is not None:
            if not (r.rejected and r.received >= t_term):
                problems.append(f"failed ({r.sent - t_term:+.3f}s after SIGTERM): {r}")
            continue
        if r.model == "tiny":
            if r.version != "2" or not np.allclose(r.output, tiny, atol=1e-4):
                problems.append(f"tiny answered wrongly: {r}")
            continue
        if not timeline.allows(r):
            problems.append(f"version {r.version} was not serving: {r} {timeline.intervals}")
        elif not np.allclose(r.output, base + timeline.offsets[r.version], atol=1e-4):
            problems.append(f"version {r.version} answered with another model's output: {r}")
    ok = [r for r in load.results if r.error is None]
    by_version: dict[str, int] = {}
    for r in ok:
        if r.model == "zd":
            by_version[r.version] = by_version.get(r.version, 0) + 1
    print(f"{len(ok)} responses ({by_version} from zd), {len(load.results) - len(ok)} rejected")
    assert not problems, "\n".join(problems[:20]) + f"\n({len(problems)} problems)"


PLAN = [("http", "zd"), ("grpc", "zd"), ("http", "zd"), ("grpc", "zd"), ("grpc", "tiny")]


def test_poll_mode_updates_under_load(tmp_path: Path) -> None:
    repo = make_repo(tmp_path, {1: 1, 2: 2})
    server = start_server(
        repo, tmp_path / "pdserve.log", "--model-control-mode=poll", "--repository-poll-secs=0.2"
    )
    timeline = Timeline()
    timeline.begin("2", 2)
    zd = repo / "zd"
    try:
        with Load(server, PLAN) as load:
            progress(load)
            # a new version folder appears: v3 takes over
            timeline.begin("3", 3)
            publish(SOURCE / "3", zd / "3")
            wait_for(lambda: served(server, "zd") == ["3"], "v3 to serve")
            timeline.end("2")
            progress(load)
            # a broken v4: fails, v3 keeps serving, the failure is in the index
            broken = tmp_path / "broken"
            broken.mkdir()
            (broken / "model.onnx").write_bytes(b"not a model")
            publish(broken, zd / "4")
            wait_for(
                lambda: index(server).get(("zd", "4"), {}).get("state") == "UNAVAILABLE",
                "v4 to fail",
            )
            assert served(server, "zd") == ["3"]
            progress(load)
            # the fix (the v1 graph: offset 1) is picked up
            timeline.begin("4", 1)
            shutil.rmtree(zd / "4")
            publish(SOURCE / "1", zd / "4")
            wait_for(lambda: served(server, "zd") == ["4"], "fixed v4 to serve")
            timeline.end("3")
            progress(load)
            # rollback: pin v3 in config.pbtxt
            timeline.begin("3", 3)
            (zd / "config.pbtxt").write_text(
                ZD_CONFIG + "version_policy: { specific: { versions: [ 3 ] } }\n"
            )
            wait_for(lambda: served(server, "zd") == ["3"], "rollback to v3")
            timeline.end("4")
            progress(load)
            # another model comes and goes
            publish(EXAMPLE_REPO / "tiny_specific", repo / "tiny_specific")
            wait_for(lambda: served(server, "tiny_specific") == ["1", "3"], "tiny_specific")
            shutil.rmtree(repo / "tiny_specific")
            wait_for(lambda: served(server, "tiny_specific") is None, "tiny_specific gone")
            progress(load)
            t_term, code = terminate(server)
            load.stop()
        assert code == 0, server.log()[-3000:]
    finally:
        server.stop(signal.SIGKILL)
    check(load, timeline, t_term)


def test_explicit_mode_updates_under_load(tmp_path: Path) -> None:
    repo = make_repo(tmp_path, {1: 1, 2: 2})
    copy_models(repo, "tiny_specific")
    server = start_server(
        repo,
        tmp_path / "pdserve.log",
        "--model-control-mode=explicit",
        "--load-model=zd",
        "--load-model=tiny",
    )
    timeline = Timeline()
    timeline.begin("2", 2)
    control = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        with Load(server, PLAN) as load:
            progress(load)
            # upload v3 through the repository API (config + file:) over gRPC
            cfg = control.get_model_config("zd", as_json=True)["config"]
            onnx3 = (SOURCE / "3" / "model.onnx").read_bytes()
            timeline.begin("3", 3)
            control.load_model("zd", config=json.dumps(cfg), files={"file:3/model.onnx": onnx3})
            assert served(server, "zd") == ["3"]  # switched when the call returned
            timeline.end("2")
            progress(load)
            # an upload that cannot load: refused, v3 untouched, nothing left on disk
            with pytest.raises(InferenceServerException, match="version 4"):
                control.load_model(
                    "zd", config=json.dumps(cfg), files={"file:4/model.onnx": b"not a model"}
                )
            assert served(server, "zd") == ["3"]
            assert sorted(os.listdir(repo / "zd")) == ["1", "2", "config.pbtxt"]
            progress(load)
            # rollback to v2 (pdserve rollback's API call)
            timeline.begin("2", 2)
            assert rollback(server.http_url, "zd", 2) == ["2"]
            timeline.end("3")
            progress(load)
            # the repository's owner publishes a broken v4; unpin: config.pbtxt selects
            # it, so v2 keeps serving
            (tmp_path / "v4").mkdir()
            (tmp_path / "v4" / "model.onnx").write_bytes(b"not a model")
            publish(tmp_path / "v4", repo / "zd" / "4")
            with pytest.raises(RuntimeError, match="version 4"):
                rollback(server.http_url, "zd", None)
            assert served(server, "zd") == ["2"]
            row = index(server)[("zd", "4")]
            assert row["state"] == "UNAVAILABLE" and row["reason"]
            progress(load)
            # another model loads and unloads
            control.load_model("tiny_specific")
            assert served(server, "tiny_specific") == ["1", "3"]
            control.unload_model("tiny_specific")
            assert served(server, "tiny_specific") is None
            progress(load)
            t_term, code = terminate(server)
            load.stop()
        assert code == 0, server.log()[-3000:]
    finally:
        control.close()
        server.stop(signal.SIGKILL)
    check(load, timeline, t_term)


def pending(server: ServerProcess, model: str) -> float:
    """``nv_inference_pending_request_count`` of ``model`` from the metrics port."""
    conn = http.client.HTTPConnection("127.0.0.1", server.metrics_port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    match = re.search(
        rf'^nv_inference_pending_request_count{{[^}}]*model="{model}"[^}}]*}} (\S+)$', text, re.M
    )
    return float(match.group(1)) if match else 0.0


def test_graceful_shutdown_finishes_in_flight(tmp_path: Path) -> None:
    """SIGTERM: readiness goes false at once and new requests get 503 while the requests
    already accepted run to completion; then the process exits 0."""
    repo = copy_models(tmp_path / "repo", "efficientnet_lite0", "tiny")
    server = start_server(repo, tmp_path / "pdserve.log", "--exit-timeout-secs=60")
    x = np.random.default_rng(0).random((16, 3, 224, 224)).astype(np.float32)
    outcomes: list[Any] = []

    def slow() -> None:
        c = grpcclient.InferenceServerClient(server.grpc_url)
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        try:
            outcomes.append(c.infer("efficientnet_lite0", [inp]).as_numpy("logits").shape)
        except InferenceServerException as e:
            outcomes.append(e)

    try:
        threads = [threading.Thread(target=slow) for _ in range(6)]
        for t in threads:
            t.start()

        # 2 instances run two; wait until some of the others are queued in the server
        # (on a loaded machine the six clients may not all be in at once)
        # ... and until all six are in: 2 running + the queued + those already answered
        # (a client that connects only after SIGTERM would rightly get a 503)
        def all_in() -> bool:
            queued = pending(server, "efficientnet_lite0")
            return queued >= 2 and len(outcomes) + 2 + queued >= 6

        wait_for(all_in, "2 queued requests and all 6 accepted", 60)
        accepted_before = len(outcomes)
        t_term = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)

        def not_ready() -> bool:
            conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
            try:
                conn.request("GET", "/v2/health/ready")
                return conn.getresponse().status == 400
            finally:
                conn.close()

        wait_for(not_ready, "readiness to go false", 10)  # the signal is handled async
        finished_when_unready = len(outcomes)
        late = grpcclient.InferenceServerClient(server.grpc_url)
        inp = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
        inp.set_data_from_numpy(X)
        with pytest.raises(InferenceServerException) as rejected:
            late.infer("tiny", [inp])
        for t in threads:
            t.join(60)
        code = server.proc.wait(60)
        exit_secs = time.monotonic() - t_term
    finally:
        server.stop(signal.SIGKILL)
    assert accepted_before < 6, "the slow requests finished before SIGTERM: nothing to check"
    assert finished_when_unready < 6, "readiness went false only after the work was done"
    assert "StatusCode.UNAVAILABLE" in str(rejected.value.status())
    assert outcomes == [(16, 1000)] * 6, [str(o) for o in outcomes]
    assert code == 0
    assert exit_secs < 60
    assert "pdserve stopped" in server.log()


def test_exit_timeout_bounds_shutdown(tmp_path: Path) -> None:
    """With more queued work than --exit-timeout-secs allows, the server still exits 0
    soon after the timeout; requests it could not finish fail, none hang."""
    repo = copy_models(tmp_path / "repo", "efficientnet_lite0")
    server = start_server(repo, tmp_path / "pdserve.log", "--exit-timeout-secs=1")
    # batches of 8: one ONNX Runtime run (which nothing can interrupt) stays well under
    # the 5 s grace after the exit timeout even on a loaded machine; 12 clients still
    # queue far more work than the 1 s timeout allows.
    x = np.zeros((8, 3, 224, 224), np.float32)
    done = threading.Event()
    errors: list[Any] = []

    def slow() -> None:
        c = grpcclient.InferenceServerClient(server.grpc_url)
        inp = grpcclient.InferInput("input", list(x.shape), "FP32")
        inp.set_data_from_numpy(x)
        try:
            c.infer("efficientnet_lite0", [inp], client_timeout=60)
        except InferenceServerException as e:
            errors.append(e)
        done.set()

    try:
        threads = [threading.Thread(target=slow) for _ in range(12)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        t_term = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(30)
        exit_secs = time.monotonic() - t_term
        for t in threads:
            t.join(30)
    finally:
        server.stop(signal.SIGKILL)
    assert code == 0
    assert exit_secs < 15, exit_secs
    assert not any(t.is_alive() for t in threads)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_exit_timeout_bounds_shutdown_with_a_hung_python_model(tmp_path: Path) -> None:
    """A python model whose execute never returns (here: sleeps for an hour) must not
    keep SIGTERM from finishing: after --exit-timeout-secs the request in flight gets
    a 503, the stuck worker is killed, and the process exits 0 with no worker left."""
    data = Path(__file__).resolve().parents[1] / "data" / "python_models"
    repo = tmp_path / "repo"
    shutil.copytree(data / "sleepy", repo / "sleepy")
    with open(repo / "sleepy" / "config.pbtxt", "a") as f:
        f.write("dynamic_batching { }\n")  # the batcher used to wait for its batch forever
    server = start_server(repo, tmp_path / "pdserve.log", "--exit-timeout-secs=2")
    outcome: list[Any] = []

    def hang() -> None:
        c = grpcclient.InferenceServerClient(server.grpc_url)
        inp = grpcclient.InferInput("X", [1], "FP32")
        inp.set_data_from_numpy(np.array([3600.0], np.float32))
        try:
            c.infer("sleepy", [inp], client_timeout=60)
            outcome.append("ok")
        except InferenceServerException as e:
            outcome.append(e)

    try:
        workers = descendants(server.proc.pid)
        assert workers, "no worker processes found"
        thread = threading.Thread(target=hang)
        thread.start()
        wait_for(lambda: pending(server, "sleepy") == 0, "the request to start", 10)
        time.sleep(0.5)
        t_term = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(30)
        exit_secs = time.monotonic() - t_term
        thread.join(30)
    finally:
        server.stop(signal.SIGKILL)
    assert code == 0, server.log()[-3000:]
    assert exit_secs < 10, exit_secs  # 2 s + the kill grace, not the 10 s finalize wait
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in workers if _alive(p)], "worker processes left behind"
    assert len(outcome) == 1 and isinstance(outcome[0], InferenceServerException), outcome
    assert "UNAVAILABLE" in str(outcome[0].status()), outcome[0]
