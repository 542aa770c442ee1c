"""``pdserve analyze`` end to end on the ``tiny`` model (issue 13).

The CLI runs as a subprocess on its own pdserve (restarted per configuration) over
a tiny grid with short perf windows, well under a minute; its report files are
checked, and the recommendation is one of the configurations it measured, with
a ``config.pbtxt`` that loads. The Python API then drives a running server
(``-u``, reload mode, memory found from the listening port), which serves its
shipped configuration again afterwards. Bad input: an unknown model, a server
not in explicit mode.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from google.protobuf import text_format

from pdserve.app.analyze import AnalyzeOptions, run_analyze
from pdserve.app.analyze.server import AnalyzeError, OwnServer, RepositoryClient
from pdserve.app.analyze.space import Knobs, shipped_knobs
from pdserve.config import ModelConfig
from tests.conftest import ROOT, copy_models, require_examples, start_server

#: Short perf windows: a level is 3 windows of 200 ms.
FAST = ["-p", "200", "-r", "3", "-s", "100", "--concurrency", "1,4"]
SHIPPED = Knobs(instances=2, max_batch_size=128, preferred=(), delay_us=None)


def analyze(*args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve", "analyze", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_analyze_tiny_grid_writes_reports_and_recommends_a_measured_point(
    tmp_path: Path,
) -> None:
    require_examples()
    out = tmp_path / "out"
    t0 = time.monotonic()
    run = analyze(
        "-m",
        "tiny",
        "--search",
        "grid",
        "--instance-counts",
        "1,2",
        "--queue-delays-us",
        "off,0",
        "--max-batch-sizes",
        "128",
        "--preferred-batch-sizes",
        "none",
        "--p99-ms",
        "200",
        "--memory-budget",
        "1GiB",
        "--max-minutes",
        "0.3",
        "--confirm",
        "0",
        "-o",
        str(out),
        *FAST,
    )
    elapsed = time.monotonic() - t0
    assert run.returncode == 0, run.stderr
    assert elapsed < 60
    for name in (
        "report.html",
        "results.json",
        "results.csv",
        "throughput_p99.png",
        "memory.png",
        "server.log",
    ):
        assert (out / name).is_file(), name
    # progress: plain lines (not a TTY), one per configuration and per level
    assert "[0 shipped] 0:" in run.stderr and "    concurrency 1: " in run.stderr
    assert "\r" not in run.stderr

    doc = json.loads((out / "results.json").read_text())
    search = [r for r in doc["results"] if r["repeat"] == 0]
    assert search[0]["shipped"] and Knobs.from_dict(search[0]["point"]["tiny"]) == SHIPPED
    # 2 instance counts x (no batching, batching with delay 0), the shipped one first
    points = {(r["point"]["tiny"]["instances"], r["point"]["tiny"]["delay_us"]) for r in search}
    assert len(search) >= 2 and len(points) == len(search)
    assert points <= {(1, None), (2, None), (1, 0), (2, 0)}
    for r in doc["results"]:
        assert r["status"] in ("ok", "partial")
        assert r["levels"] and all(lv["infer_per_sec"] > 0 for lv in r["levels"])
        assert r["levels"][0]["p50_ms"] <= r["levels"][0]["p99_ms"]
        # own server: resident memory of the server and its processes, > 1 MiB
        assert r["memory_bytes"] > 1 << 20 and r["memory_loaded_bytes"] > 0

    rec = doc["recommended"]
    assert rec in {r["index"] for r in search}
    chosen = next(r for r in search if r["index"] == rec)
    assert chosen["feasible"]
    best = max(r["score_infer_per_sec"] for r in search if r["feasible"])
    assert chosen["score_infer_per_sec"] == best
    assert f"recommended: #{rec}" in run.stdout

    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 2
    if chosen["shipped"]:
        assert doc["diff"] == "" and not (out / "recommendation.diff").exists()
    else:
        # the recommended config.pbtxt parses and sets the recommended knobs
        cfg = text_format.Parse(
            (out / "recommended" / "tiny" / "config.pbtxt").read_text(), ModelConfig()
        )
        want = Knobs.from_dict(chosen["point"]["tiny"])
        got = shipped_knobs(cfg)
        assert got.delay_us == want.delay_us
        if want.instances != SHIPPED.instances:
            assert got.instances == want.instances
        assert (out / "recommendation.diff").read_text() == doc["diff"]
        assert "+++ b/tiny/config.pbtxt" in run.stdout


def test_analyze_a_running_server_and_serve_the_shipped_config_again(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "tiny")
    server = start_server(
        repo, tmp_path / "pdserve.log", "--model-control-mode", "explicit", "--load-model", "tiny"
    )
    try:
        res = run_analyze(
            AnalyzeOptions(
                model="tiny",
                url=server.http_url,
                instance_counts=[1, 2],
                queue_delays_us=[None],
                concurrency=[1],
                measurement_interval_ms=200,
                max_trials=3,
                stability_percentage=100,
                confirm=0,
                max_minutes=0.5,
                output_dir=tmp_path / "out",
            )
        )
        assert [r.point["tiny"].instances for r in res.results] == [2, 1]
        assert res.recommended in res.results
        assert all(r.memory_bytes is not None for r in res.results)  # pid from the port
        assert res.info["memory_measured"] is True
        # the shipped configuration serves again
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/tiny/config") as f:
            cfg = json.loads(f.read())
        assert cfg["instance_group"][0]["count"] == 2 and "dynamic_batching" not in cfg
    finally:
        server.stop()


def test_unknown_model_and_server_not_in_explicit_mode(tmp_path: Path) -> None:
    require_examples()
    run = analyze("-m", "no_such_model", "-o", str(tmp_path / "a"), timeout=60)
    assert run.returncode == 1
    assert "pdserve analyze: no model 'no_such_model' in " in run.stderr

    repo = copy_models(tmp_path / "models", "tiny")
    server = start_server(repo, tmp_path / "pdserve.log")  # model control mode none
    try:
        try:
            run_analyze(
                AnalyzeOptions(model="tiny", url=server.http_url, output_dir=tmp_path / "b")
            )
        except AnalyzeError as e:
            assert "explicit" in str(e)
        else:
            raise AssertionError("analyze must refuse a server not in explicit mode")
    finally:
        server.stop()


def test_own_server_is_pinned_as_taskset_would(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "tiny")
    server = OwnServer(repo, tmp_path / "server.log", cpus=[0])
    server.start()
    try:
        status = Path(f"/proc/{server.pid}/status").read_text()
        assert "Cpus_allowed_list:\t0\n" in status
        client = RepositoryClient(server.http_url)
        client.load("tiny")  # explicit mode: the repository API loads
        assert client.is_ready("tiny")
        assert "--model-control-mode explicit" in server.log_path.read_text()
    finally:
        server.stop()
    assert server.proc is None
