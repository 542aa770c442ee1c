"""``pdserve perf`` against a real pdserve on free loopback ports (issue 13).

The CLI runs as a subprocess (``python -m pdserve perf``) for about a second per
level, over HTTP and gRPC, and its CSV / JSON / PNG are checked for sane values;
the Python API (:func:`pdserve.app.perf.run_sweep`) drives the request-rate mode.
Bad servers: nothing listening, a model answering errors, a model that stalls, a
server killed mid-run: each gives a clear message, a bounded run, a non-zero exit
and the results measured so far.
"""

from __future__ import annotations

import csv
import http.server
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.app.perf import PerfError, PerfOptions, run_sweep
from pdserve.app.perf.control import GrpcControl, HttpControl, connect
from pdserve.app.perf.runner import prepare
from tests.conftest import ROOT, ServerProcess, copy_models, free_port, start_server

DATA = Path(__file__).resolve().parents[1] / "data" / "python_models"

#: Short windows keep each level around a second; up to 3 windows per level.
FAST = ["-p", "400", "-r", "3", "-s", "50"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = copy_models(tmp_path_factory.mktemp("perf") / "models", "tiny")
    for name in ("error_codes", "sleepy", "ens_parallel"):
        shutil.copytree(DATA / name, repo / name)
    proc = start_server(repo, repo.parent / "pdserve.log")
    yield proc
    proc.stop()


def perf(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", "perf", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def check_results(csv_path: Path, json_path: Path, levels: list[int]) -> None:
    rows = read_csv(csv_path)
    assert [int(r["Concurrency"]) for r in rows] == levels
    for r in rows:
        assert float(r["Inferences/Second"]) > 0
        assert 0 < int(r["p50 latency"]) <= int(r["p90 latency"]) <= int(r["p99 latency"])
        assert r["Errors"] == "0"
        # The server-side breakdown of the same windows (statistics extension).
        assert int(r["Server Compute Infer"]) > 0
        assert int(r["Server Queue"]) >= 0
        assert float(r["Server Avg Batch Size"]) >= 1
    doc = json.loads(json_path.read_text())
    assert doc["tool"] == "pdserve perf" and doc["complete"] is True and doc["error"] is None
    assert doc["info"]["model"] == "tiny" and doc["info"]["server_stats"] is True
    for res, row in zip(doc["results"], rows, strict=True):
        assert res["infer_per_sec"] == pytest.approx(float(row["Inferences/Second"]), rel=1e-3)
        assert res["latency_us"]["p50"] <= res["latency_us"]["p99"]
        assert res["errors"] == {}
        srv = res["server"]
        # Every request the client completed in the windows, the server counted.
        assert srv["success_count"] >= res["request_count"] * 0.9
        assert srv["compute_infer_us"] > 0 and srv["request_us"] > 0
        assert res["trials"] >= 1 and len(res["history"]) == res["trials"]


def test_http_sweep_csv_json_plot(server: ServerProcess, tmp_path: Path) -> None:
    out = perf(
        "-m", "tiny", "-u", server.http_url, "--concurrency-range", "1:3:2", *FAST,
        "-f", str(tmp_path / "r.csv"), "--json", str(tmp_path / "r.json"),
        "--plot", str(tmp_path / "r.png"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    check_results(tmp_path / "r.csv", tmp_path / "r.json", [1, 3])
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Plain progress lines (not a terminal), the summary table on stdout.
    assert "concurrency 1  window 1/3:" in out.stderr
    assert out.stdout.splitlines()[0].split()[:3] == ["concurrency", "infer/s", "p50"]


@pytest.mark.parametrize("client", ["raw", "grpcio"])
def test_grpc_and_json_format(server: ServerProcess, tmp_path: Path, client: str) -> None:
    out = perf(
        "-m", "tiny", "-i", "grpc", "-u", server.grpc_url, "-b", "4", "--grpc-client", client,
        "--concurrency-range", "2", *FAST,
        "-f", str(tmp_path / "g.csv"), "--json", str(tmp_path / "g.json"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    check_results(tmp_path / "g.csv", tmp_path / "g.json", [2])
    res = json.loads((tmp_path / "g.json").read_text())["results"][0]
    assert res["infer_per_sec"] == pytest.approx(4 * res["requests_per_sec"])
    assert res["server"]["inference_count"] == pytest.approx(4 * res["server"]["success_count"])
    if client == "grpcio":
        return
    out = perf(
        "-m", "tiny", "-u", server.http_url, "--input-tensor-format", "json",
        "--output-tensor-format", "json", "--input-data", "zero", *FAST,
        "-f", str(tmp_path / "j.csv"), "--json", str(tmp_path / "j.json"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    check_results(tmp_path / "j.csv", tmp_path / "j.json", [1])


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_ensemble_breakdown_sums_its_steps(
    server: ServerProcess, tmp_path: Path, proto: str
) -> None:
    url = server.http_url if proto == "http" else server.grpc_url
    out = perf(
        "-m", "ens_parallel", "-i", proto, "-u", url, "--input-data", "zero", *FAST,
        "--json", str(tmp_path / "e.json"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = json.loads((tmp_path / "e.json").read_text())
    assert doc["info"]["composing_models"] == ["sleepy"]
    srv = doc["results"][0]["server"]
    # Both steps run the composing model: twice its requests, and the ensemble's
    # compute is the composing model's (perf_analyzer's sum over the steps).
    step = srv["composing"]["sleepy"]
    assert step["success_count"] == pytest.approx(2 * srv["success_count"], abs=2)
    assert srv["compute_infer_us"] == pytest.approx(step["compute_infer_us"])
    assert srv["compute_infer_us"] > 0


def test_request_rate_api(server: ServerProcess) -> None:
    for distribution in ("constant", "poisson"):
        results = run_sweep(
            PerfOptions(
                model="tiny",
                url=server.http_url,
                request_rates=[200.0],
                distribution=distribution,  # type: ignore[arg-type]
                measurement_interval_ms=600,
                max_trials=3,
                stability_percentage=50,
            )
        )
        (r,) = results
        assert r.mode == "request_rate" and r.level == 200.0 and r.error_count == 0
        # An open loop sends at the rate asked, whatever the server's speed.
        assert 150 <= r.requests_per_sec <= 250, r
        assert r.server is not None and r.server["queue_us"] >= 0


def test_server_down_fails_fast(tmp_path: Path) -> None:
    port = free_port()
    for proto in ("http", "grpc"):
        t0 = time.monotonic()
        out = perf(
            "-m", "tiny", "-i", proto, "-u", f"127.0.0.1:{port}", "--json", str(tmp_path / "d.json")
        )
        assert time.monotonic() - t0 < 20
        assert out.returncode == 1
        assert f"127.0.0.1:{port}" in out.stderr
        assert "connection refused" in out.stderr or "unavailable" in out.stderr, out.stderr
        doc = json.loads((tmp_path / "d.json").read_text())
        assert doc["results"] == [] and doc["complete"] is False and doc["error"]


def test_unknown_model_and_rejected_request(server: ServerProcess, tmp_path: Path) -> None:
    out = perf("-m", "nope", "-u", server.http_url)
    assert out.returncode == 1 and "model 'nope'" in out.stderr and "HTTP 4" in out.stderr
    data = tmp_path / "d.json"
    data.write_text(json.dumps({"data": [{"MODE": ["respond:INVALID_ARG"]}]}))
    out = perf("-m", "error_codes", "-u", server.http_url, "--input-data", str(data))
    assert out.returncode == 1
    assert (
        "the server rejected the request: HTTP 400: error_codes responds INVALID_ARG" in out.stderr
    )
    with pytest.raises(PerfError, match="does not batch"):
        run_sweep(PerfOptions(model="error_codes", url=server.http_url, batch_size=2))


@pytest.mark.parametrize(
    ("proto", "client", "key"),
    [
        ("http", "raw", "HTTP 503"),
        ("grpc", "raw", "UNAVAILABLE"),
        ("grpc", "grpcio", "UNAVAILABLE"),
    ],
)
def test_errors_counted_by_status(
    server: ServerProcess, tmp_path: Path, proto: str, client: str, key: str
) -> None:
    data = tmp_path / "d.json"
    data.write_text(json.dumps({"data": [{"MODE": ["ok"]}, {"MODE": ["respond:UNAVAILABLE"]}]}))
    url = server.http_url if proto == "http" else server.grpc_url
    out = perf(
        "-m", "error_codes", "-i", proto, "-u", url, "--grpc-client", client,
        "--input-data", str(data), "--concurrency-range", "2", *FAST,
        "--json", str(tmp_path / "e.json"),
    )  # fmt: skip
    assert out.returncode == 1  # requests failed
    (res,) = json.loads((tmp_path / "e.json").read_text())["results"]
    assert res["request_count"] > 0 and set(res["errors"]) == {key}
    assert res["errors"][key] > 0
    assert "error_codes responds UNAVAILABLE" in res["error_examples"][key]
    assert key in out.stdout  # the summary's error line


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_stalled_model_is_bounded(server: ServerProcess, tmp_path: Path, proto: str) -> None:
    data = tmp_path / "d.json"
    # The first request (the trial one) answers at once; the second sleeps 3 s.
    data.write_text(json.dumps({"data": [{"X": [0.0]}, {"X": [3.0]}]}))
    url = server.http_url if proto == "http" else server.grpc_url
    t0 = time.monotonic()
    out = perf(
        "-m", "sleepy", "-i", proto, "-u", url, "--input-data", str(data),
        "--concurrency-range", "1:4", "-p", "300", "-r", "5", "--request-timeout", "0.5",
        "--json", str(tmp_path / "s.json"),
    )  # fmt: skip
    assert time.monotonic() - t0 < 30
    assert out.returncode == 1
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["complete"] is False
    last = doc["results"][-1]
    assert last["aborted"] and ("stalled" in last["aborted"] or "timeout" in last["aborted"])
    assert "stopped:" in out.stderr


def _read_available(proc: subprocess.Popen[str], wait: float = 1.0) -> str:
    """What the process wrote to stderr within ``wait`` s, read from the descriptor
    itself: ``select`` on a buffered ``readline`` would leave already-read lines in the
    text buffer unseen, one line per wait, while the run went on to its end."""
    assert proc.stderr is not None
    fd = proc.stderr.fileno()
    ready, _, _ = select.select([fd], [], [], wait)
    return os.read(fd, 65536).decode(errors="replace") if ready else ""


def test_server_killed_mid_run(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "tiny")
    victim = start_server(repo, tmp_path / "pdserve.log")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "pdserve", "perf", "-m", "tiny", "-u", victim.http_url,
            "--concurrency-range", "2", "-p", "500", "-r", "20", "--connect-timeout", "1",
            "--json", str(tmp_path / "k.json"),
        ],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    # Kill the server once the second window has been measured.
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    seen = ""
    while "window 2" not in seen and time.monotonic() < deadline:
        seen += _read_available(proc)
    assert "window 2" in seen, seen
    # SIGKILL: a SIGTERM would drain first (503 answers while in-flight work finishes)
    victim.stop(signal.SIGKILL)
    t0 = time.monotonic()
    proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 10
    assert proc.returncode == 1
    (res,) = json.loads((tmp_path / "k.json").read_text())["results"]
    assert res["aborted"] and res["request_count"] > 0  # what was measured is kept
    assert set(res["errors"]) & {"connection refused", "connection lost"}, res["errors"]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_keeps_the_results(server: ServerProcess, tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "pdserve", "perf", "-m", "tiny", "-u", server.http_url,
            "--concurrency-range", "1:3", "-p", "300", "-r", "20", "-s", "0.001",
            "-f", str(tmp_path / "i.csv"), "--json", str(tmp_path / "i.json"),
        ],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # Ctrl-C as from a terminal: a shell's background job (`make test &`) starts with
        # SIGINT ignored, which the child would inherit (and Python then never raises
        # KeyboardInterrupt); a terminal's foreground process has the default
        preexec_fn=_default_sigint,
    )  # fmt: skip
    assert proc.stderr is not None
    deadline = time.monotonic() + 30
    seen = ""
    while "window 2" not in seen and time.monotonic() < deadline:
        seen += _read_available(proc)
    proc.send_signal(signal.SIGINT)
    t0 = time.monotonic()
    stdout, stderr = proc.communicate(timeout=60)
    # bounded: the run ends promptly (a few seconds alone; up to ~18 s seen at load 15+)
    assert time.monotonic() - t0 < 30
    assert proc.returncode == 1
    assert "interrupted" in stderr
    (res,) = json.loads((tmp_path / "i.json").read_text())["results"]
    assert res["aborted"] == "interrupted" and res["request_count"] > 0
    assert len(read_csv(tmp_path / "i.csv")) == 1 and "concurrency" in stdout


class _MinimalV2(http.server.BaseHTTPRequestHandler):
    """A bare V2 server as small Python peers are: model metadata and infer only (no
    configuration, no statistics extension), HTTP/1.0 (a connection per request)."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, doc: object) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/v2/models/m":
            shape = [-1, 4]
            meta = {"name": "m", "inputs": [{"name": "X", "datatype": "FP32", "shape": shape}]}
            self._send(200, meta)
        else:
            self._send(404, {"error": "not found"})

    def do_POST(self) -> None:  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        x = req["inputs"][0]
        out = {"name": "Y", "datatype": "FP32", "shape": x["shape"], "data": x["data"]}
        self._send(200, {"model_name": "m", "outputs": [out]})


def test_minimal_v2_server_without_keepalive_or_statistics(tmp_path: Path) -> None:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MinimalV2)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        out = perf(
            "-m", "m", "-u", f"127.0.0.1:{httpd.server_port}", "-b", "2",
            "--input-tensor-format", "json", "--output-tensor-format", "json",
            "--concurrency-range", "2", *FAST, "--json", str(tmp_path / "m.json"),
        )  # fmt: skip
    finally:
        httpd.shutdown()
    assert out.returncode == 0, out.stderr
    assert "no server-side breakdown" in out.stderr
    doc = json.loads((tmp_path / "m.json").read_text())
    # No /config: a leading -1 is taken as the batch dimension.
    assert doc["info"]["max_batch_size"] == -1 and doc["info"]["server_stats"] is False
    (res,) = doc["results"]
    assert res["server"] is None and res["errors"] == {}
    # A new connection per request still gives a steady closed loop.
    assert res["requests_per_sec"] > 50


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_control_reads_the_model_and_sends_the_trial_request(
    server: ServerProcess, proto: str
) -> None:
    url = server.http_url if proto == "http" else server.grpc_url
    opts = PerfOptions(model="tiny", url=url, protocol=proto)  # type: ignore[arg-type]  # a Literal
    control, spec, requests = prepare(opts)
    try:
        assert isinstance(control, HttpControl if proto == "http" else GrpcControl)
        meta = control.metadata()
        assert meta["name"] == "tiny"
        assert [(t["name"], t["datatype"]) for t in meta["inputs"]] == [("INPUT0", "FP32")]
        config = control.config()
        assert config is not None and int(config["max_batch_size"]) == 128
        assert [t.name for t in spec.inputs] == ["INPUT0"]
        (stats,) = [s for s in control.stats() or [] if s["name"] == "tiny"]
        before = int(stats["inference_count"])
        assert before >= 1  # the trial request prepare sent
        control.infer(requests[0])  # type: ignore[arg-type]  # the protocol's request form
        (stats,) = [s for s in control.stats() or [] if s["name"] == "tiny"]
        assert int(stats["inference_count"]) == before + 1
        assert "tiny" in {s["name"] for s in control.stats(all_models=True) or []}
    finally:
        control.close()
    unknown = connect(proto, url, "nope", "", 5.0)
    try:
        with pytest.raises(PerfError, match="model 'nope'"):
            unknown.metadata()
        assert unknown.config() is None
    finally:
        unknown.close()


def test_control_without_a_server_says_so() -> None:
    port = free_port()
    http = HttpControl(f"127.0.0.1:{port}", "tiny", "", 5.0)
    with pytest.raises(PerfError, match=f"GET http://127.0.0.1:{port}/v2/models/tiny: connection"):
        http.metadata()
    assert http.stats() is None and http.config() is None
    grpc = GrpcControl(f"127.0.0.1:{port}", "tiny", "", 5.0)
    try:
        with pytest.raises(PerfError, match=f"grpc://127.0.0.1:{port}: unavailable"):
            grpc.metadata()
        assert grpc.stats() is None and grpc.config() is None
    finally:
        grpc.close()
