"""Health that tells the truth, end to end on one server (``--instance-hang-timeout 1
--strict-readiness --server-timing``) with the test model ``wedgeable`` in four copies:

- a python worker stopped with SIGSTOP, and an ``execute`` that deadlocks, under
  closed-loop load: within the bound the model goes not ready (and the server with it),
  the request in flight fails with 503 naming model and instance, the worker is
  restarted and answers correctly; no request hangs;
- ``is_ready()`` returning False / True takes the model out of readiness and back;
- a canary probe failing twice in a row does too, and is not counted as traffic;
- Server-Timing (curl's header, HTTP and gRPC trailing metadata read with tritonclient)
  agrees with the statistics extension under load;
- bad health parameters fail the load with a reason naming them.
"""

from __future__ import annotations

import contextlib
import json
import queue
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from pdserve.core.timing import parse_server_timing
from tests.conftest import ServerProcess, start_server

MODEL_SRC = Path(__file__).resolve().parents[1] / "data" / "python_models" / "wedgeable"
MODELS = ("wedgeable", "hooked", "probed", "timed", "pipeline", "decoupled_repeat")
#: an ensemble of two ``timed`` steps (x -> 2x -> 4x)
PIPELINE = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 0
input [{ name: "X", data_type: TYPE_FP32, dims: [1] }]
output [{ name: "Y", data_type: TYPE_FP32, dims: [1] }]
ensemble_scheduling { step [
  { model_name: "timed", model_version: -1, input_map { key: "IN" value: "X" },
    output_map { key: "OUT" value: "MID" } },
  { model_name: "timed", model_version: -1, input_map { key: "IN" value: "MID" },
    output_map { key: "OUT" value: "Y" } }
] }
"""
HOOK_PARAMS = {"is_ready_interval": "0.1", "is_ready_timeout": "1"}
PROBE_PARAMS = {
    "probe_interval": "0.15",
    "probe_failures": "2",
    "probe_timeout": "1",
    "probe_input": '{"IN": [1.5]}',
}


def _copy(repo: Path, name: str, params: dict[str, str]) -> None:
    shutil.copytree(MODEL_SRC, repo / name)
    cfg = repo / name / "config.pbtxt"
    text = cfg.read_text().replace('name: "wedgeable"', f'name: "{name}"')
    for key, value in params.items():
        text += f"parameters {{ key: {json.dumps(key)} value {{ string_value: {json.dumps(value)} }} }}\n"
    cfg.write_text(text)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("health_repo")
    _copy(repo, "wedgeable", {})
    _copy(repo, "hooked", HOOK_PARAMS)
    _copy(repo, "probed", PROBE_PARAMS)
    _copy(repo, "timed", {})
    _copy(repo, "badcfg", {})
    shutil.copytree(MODEL_SRC.parent / "decoupled_repeat", repo / "decoupled_repeat")
    (repo / "pipeline" / "1").mkdir(parents=True)
    (repo / "pipeline" / "config.pbtxt").write_text(PIPELINE)
    args = ["--instance-hang-timeout", "1", "--strict-readiness", "--server-timing"]
    args += ["--model-control-mode", "explicit"]
    for name in MODELS:
        args += ["--load-model", name]
    srv = start_server(repo, tmp_path_factory.mktemp("health_log") / "pdserve.log", *args)
    srv.repo = repo  # type: ignore[attr-defined]  # the tests switch the models' flag files
    yield srv
    srv.stop()


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except urllib.error.HTTPError:
        return False


def _infer(client: httpclient.InferenceServerClient, model: str, value: float) -> Any:
    x = httpclient.InferInput("IN", [1], "FP32")
    x.set_data_from_numpy(np.array([value], np.float32))
    return client.infer(model, [x])


def _wait(cond: Any, timeout: float) -> float:
    """Seconds until ``cond()`` held (polled every 10 ms); fails after ``timeout``."""
    start = time.monotonic()
    while not cond():
        assert time.monotonic() - start < timeout, "condition not met in time"
        time.sleep(0.01)
    return time.monotonic() - start


class Load:
    """Closed-loop clients on ``model`` until stopped; every answer is checked."""

    def __init__(self, url: str, model: str, clients: int = 3) -> None:
        self.url, self.model = url, model
        self.ok = 0
        self.errors: list[str] = []
        self.pids: set[int] = set()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        client = httpclient.InferenceServerClient(self.url, network_timeout=15)
        n = 0
        while not self.stopping.is_set():
            n += 1
            value = float(i * 1000 + n % 1000)
            try:
                result = _infer(client, self.model, value)
            except InferenceServerException as e:
                self.errors.append(f"{e.status()} {e.message()}")
                continue
            except Exception as e:  # noqa: BLE001 - reported by the test (a timeout: a hang)
                self.errors.append(f"{type(e).__name__}: {e}")
                continue
            if result.as_numpy("OUT")[0] != value * 2:
                self.errors.append(f"wrong answer {result.as_numpy('OUT')} for {value}")
            self.pids.add(int(result.as_numpy("PID")[0]))
            self.ok += 1
        client.close()

    def stop(self) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(20)
            assert not t.is_alive(), "a request hung"


def _pid(server: ServerProcess, model: str) -> int:
    client = httpclient.InferenceServerClient(server.http_url)
    return int(_infer(client, model, 1.0).as_numpy("PID")[0])


def _check_wedge(server: ServerProcess, load: Load, old_pid: int, started: float) -> None:
    """After a wedge began at ``started``: not ready within the bound (+ a sweep and
    slack), ready again, the worker replaced, and correct answers from the new one."""
    base = f"http://{server.http_url}"
    seen: set[str] = set()

    def down() -> bool:  # the model, and the server (strict readiness) with it
        for what in ("models/wedgeable", "health"):
            if not _ready(f"{base}/v2/{what}/ready"):
                seen.add(what)
        return len(seen) == 2

    _wait(down, 5)
    assert time.monotonic() - started < 3.5  # the bound (1 s), a sweep and slack
    _wait(lambda: _ready(f"{base}/v2/models/wedgeable/ready"), 15)
    _wait(lambda: _ready(f"{base}/v2/health/ready"), 5)
    ok_before = load.ok
    _wait(lambda: load.ok >= ok_before + 20, 15)
    load.stop()
    assert any("503" in e and "wedgeable_0_0" in e and "'wedgeable'" in e for e in load.errors)
    assert all(e.startswith("503") for e in load.errors), load.errors
    assert _pid(server, "wedgeable") != old_pid


def test_sigstopped_worker_is_wedged_and_restarted(server: ServerProcess) -> None:
    import os
    import signal

    old_pid = _pid(server, "wedgeable")
    load = Load(server.http_url, "wedgeable")
    _wait(lambda: load.ok >= 20, 15)
    os.kill(old_pid, signal.SIGSTOP)
    _check_wedge(server, load, old_pid, time.monotonic())
    assert "held" in server.log() and "without progress" in server.log()


def test_deadlocked_execute_is_wedged_and_restarted(server: ServerProcess) -> None:
    old_pid = _pid(server, "wedgeable")
    load = Load(server.http_url, "wedgeable")
    _wait(lambda: load.ok >= 20, 15)
    started = time.monotonic()
    with pytest.raises(InferenceServerException) as e:
        _infer(
            httpclient.InferenceServerClient(server.http_url, network_timeout=15), "wedgeable", -1
        )
    assert e.value.status() == "503" and "wedged" in e.value.message()
    assert time.monotonic() - started < 4.0
    _check_wedge(server, load, old_pid, started)
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
        metrics = r.read().decode()
    line = next(
        m
        for m in metrics.splitlines()
        if m.startswith('pdserve_instance_wedges_total{model="wedgeable"')
    )
    assert float(line.split()[-1]) >= 2


def test_decoupled_model_that_keeps_sending_is_not_wedged(server: ServerProcess) -> None:
    """Responses 0.4 s apart for 2.4 s, past the 1 s bound: progress, not a wedge."""
    got: queue.Queue[tuple[Any, Any]] = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    x = grpcclient.InferInput("IN", [6], "INT32")
    x.set_data_from_numpy(np.arange(6, dtype=np.int32))
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        client.async_stream_infer(
            "decoupled_repeat", [x], parameters={"delay_ms": 400}, enable_empty_final_response=True
        )
        values = []
        while True:
            result, error = got.get(timeout=10)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            values.append(int(result.as_numpy("OUT")[0]))
    finally:
        client.stop_stream()
    assert values == [0, 1, 2, 3, 4, 5]
    assert (
        "decoupled_repeat_0_0' of model 'decoupled_repeat' version 1 is wedged" not in server.log()
    )


def test_is_ready_hook_toggles_readiness(server: ServerProcess) -> None:
    base = f"http://{server.http_url}"
    flag = server.repo / "hooked" / "NOT_READY"  # type: ignore[attr-defined]
    flag.touch()
    try:
        _wait(lambda: not _ready(f"{base}/v2/models/hooked/ready"), 5)
        assert not _ready(f"{base}/v2/health/ready")  # strict readiness follows
    finally:
        flag.unlink()
    _wait(lambda: _ready(f"{base}/v2/models/hooked/ready"), 5)
    _wait(lambda: _ready(f"{base}/v2/health/ready"), 5)
    assert "is_ready() returned False" in server.log()


def test_failing_probe_takes_the_model_out_and_is_not_traffic(server: ServerProcess) -> None:
    base = f"http://{server.http_url}"
    client = httpclient.InferenceServerClient(server.http_url)
    before = client.get_inference_statistics("probed")["model_stats"][0]["inference_stats"]
    flag = server.repo / "probed" / "BROKEN"  # type: ignore[attr-defined]
    flag.touch()
    try:
        _wait(lambda: not _ready(f"{base}/v2/models/probed/ready"), 5)
        assert not _ready(f"{base}/v2/health/ready")
        with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
            assert 'pdserve_model_ready{model="probed",version="1"} 0' in r.read().decode()
    finally:
        flag.unlink()
    _wait(lambda: _ready(f"{base}/v2/models/probed/ready"), 5)
    entry = client.get_inference_statistics("probed")["model_stats"][0]
    after = entry["inference_stats"]
    assert after["success"]["count"] == before["success"]["count"]  # probes are no traffic
    assert after["fail"]["count"] == before["fail"]["count"]
    probe = entry["pdserve_probe"]  # labelled apart
    assert probe["failure"] >= 2 and probe["success"] >= 1 and probe["failing_in_row"] == 0
    assert probe["last_error"] == "the model is broken"
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
        metrics = r.read().decode()
    failures = [
        m
        for m in metrics.splitlines()
        if m.startswith("pdserve_probe_total") and 'result="failure"' in m
    ]
    assert failures and float(failures[0].split()[-1]) >= 2
    assert "canary probe failed 2 times in a row" in server.log()


def _curl_timing(server: ServerProcess, value: float) -> dict[str, float]:
    body = json.dumps(
        {"inputs": [{"name": "IN", "shape": [1], "datatype": "FP32", "data": [value]}]}
    )
    out = subprocess.run(
        [
            "curl",
            "-s",
            "-i",
            "-H",
            "x-pdserve-server-timing: 1",
            "-d",
            body,
            f"http://{server.http_url}/v2/models/timed/infer",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    header = next(line for line in out.splitlines() if line.lower().startswith("server-timing:"))
    return parse_server_timing(header.split(":", 1)[1])


def test_server_timing_agrees_with_statistics(server: ServerProcess) -> None:
    http = httpclient.InferenceServerClient(server.http_url)
    before = http.get_inference_statistics("timed")["model_stats"][0]["inference_stats"]
    timings: list[dict[str, float]] = []
    lock = threading.Lock()

    def grpc_client(i: int) -> None:
        c = grpcclient.InferenceServerClient(server.grpc_url)
        for n in range(40):
            x = grpcclient.InferInput("IN", [1], "FP32")
            x.set_data_from_numpy(np.array([n], np.float32))
            done = threading.Event()
            answers: list[Any] = []
            ctx = c.async_infer(
                "timed",
                [x],
                callback=lambda result, error, a=answers, d=done: (
                    a.append((result, error)),
                    d.set(),
                ),
                headers={"x-pdserve-server-timing": "1"},
            )
            assert done.wait(15)
            assert answers[0][1] is None
            future = ctx._CallContext__grpc_future  # the grpc call: its trailing metadata
            trailers = dict(future.trailing_metadata())
            with lock:
                timings.append(parse_server_timing(trailers["server-timing"]))
        c.close()

    threads = [threading.Thread(target=grpc_client, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    curl = [_curl_timing(server, float(i)) for i in range(5)]
    for t in threads:
        t.join(60)
    timings += curl
    after = http.get_inference_statistics("timed")["model_stats"][0]["inference_stats"]
    count = after["success"]["count"] - before["success"]["count"]
    assert count == len(timings) == 125
    for name in ("queue", "compute_infer"):
        stats_ms = (after[name]["ns"] - before[name]["ns"]) / 1e6
        timing_ms = sum(t[name] for t in timings)
        assert abs(timing_ms - stats_ms) <= 0.1 * stats_ms + 0.001 * count, (
            name,
            timing_ms,
            stats_ms,
        )
    stats_total = (after["success"]["ns"] - before["success"]["ns"]) / 1e6
    timing_total = sum(t["total"] for t in timings)
    assert abs(timing_total - stats_total) <= 0.1 * stats_total
    assert all(
        set(t) == {"queue", "compute_input", "compute_infer", "compute_output", "total"}
        for t in timings
    )
    # without asking: no header (the flag alone does not add one)
    out = subprocess.run(
        [
            "curl",
            "-s",
            "-i",
            "-d",
            '{"inputs":[{"name":"IN","shape":[1],"datatype":"FP32","data":[1]}]}',
            f"http://{server.http_url}/v2/models/timed/infer",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "server-timing" not in out.lower()


def test_worker_log_lines_name_model_and_request(server: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    x = httpclient.InferInput("IN", [1], "FP32")
    x.set_data_from_numpy(np.array([7777], np.float32))
    client.infer("timed", [x], request_id="req-seven")
    _wait(lambda: "seven requested" in server.log(), 5)
    line = next(x for x in server.log().splitlines() if "seven requested" in x)
    assert line.endswith("seven requested [model=timed request_id=req-seven]"), line


def test_server_timing_of_an_ensemble_has_one_entry_per_step(server: ServerProcess) -> None:
    body = json.dumps({"inputs": [{"name": "X", "shape": [1], "datatype": "FP32", "data": [3]}]})
    out = subprocess.run(
        ["curl", "-s", "-i", "-H", "x-pdserve-server-timing: 1", "-d", body,
         f"http://{server.http_url}/v2/models/pipeline/infer"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    assert '"data":[12.0]' in out
    header = next(x for x in out.splitlines() if x.lower().startswith("server-timing:"))
    names = [e.strip().split(";")[0] for e in header.split(":", 1)[1].split(",")]
    step = ["queue", "compute_input", "compute_infer", "compute_output", "total"]
    assert names == [f"timed.{n}" for n in step] * 2 + step
    durs = [float(e.split("dur=")[1]) for e in header.split(":", 1)[1].split(",")]
    assert durs[-1] >= durs[4] + durs[9]  # the ensemble's total covers both steps


@pytest.mark.parametrize(
    ("params", "flag", "reason"),
    [
        ({"instance_hang_timeout": "soon"}, None, "parameters.instance_hang_timeout"),
        ({"probe_interval": "1", "probe_input": '{"NOPE": [1]}'}, None, "input 'NOPE'"),
        ({"probe_interval": "1", "probe_input": "[1"}, None, "probe_input"),
        ({"probe_failures": "0"}, None, "parameters.probe_failures"),
        ({}, "IS_READY_RAISES", "is_ready() raised RuntimeError: the model's device is gone"),
    ],
)
def test_bad_health_settings_fail_the_load(
    server: ServerProcess, params: dict[str, str], flag: str | None, reason: str
) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    folder = server.repo / "badcfg"  # type: ignore[attr-defined]
    cfg = json.loads(json.dumps(client.get_model_config("timed")))
    cfg["name"] = "badcfg"
    cfg["parameters"] = {k: {"string_value": v} for k, v in params.items()}
    if flag:
        (folder / flag).touch()
    try:
        with pytest.raises(InferenceServerException) as e:
            client.load_model("badcfg", config=json.dumps(cfg))
        assert reason in e.value.message()
    finally:
        if flag:
            (folder / flag).unlink()
        with contextlib.suppress(InferenceServerException):  # a failed load: not loaded
            client.unload_model("badcfg")
    # the server carries on (a failed load stays wanted: strict readiness is off now, so
    # these run last)
    assert _ready(f"http://{server.http_url}/v2/models/timed/ready")
