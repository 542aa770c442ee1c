"""A real Prometheus scrapes a real pdserve serving the image pipeline (issue 17).

Debian's ``prometheus`` (``make sysdeps``) starts on 127.0.0.1 with a 1 s scrape and
rule-evaluation interval, the project's rules (``deploy/prometheus/pdserve-rules.yml``)
and one target: the test pdserve's metrics port. Load goes through ``image_classifier``
(preprocess -> efficientnet_lite0 -> postprocess), some of it bad images (failures).
Then every PromQL expression of ``dashboards/grafana-pdserve.json`` and of the rules
is evaluated through Prometheus' HTTP API: each must return data, with the labels its
aggregation keeps (``model`` for ``by (model)``...). Prometheus is stopped by PID.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import GOLDENS, ROOT, ServerProcess, copy_models, free_port, start_server

RULES = ROOT / "deploy" / "prometheus" / "pdserve-rules.yml"
DASHBOARD = ROOT / "dashboards" / "grafana-pdserve.json"
PIPELINE = ("image_classifier", "preprocess", "efficientnet_lite0", "postprocess")
PYTHON_MODELS = ("preprocess", "postprocess")
#: What Grafana's variables stand for when an expression is evaluated here.
GRAFANA_VARS = {"$__rate_interval": "20s", "$__interval": "5s", "$model": ".*"}
#: The predictor's monitoring parameters (docs/user-guide/monitoring.md): the dashboard's
#: distributions-and-drift row and the drift / payload-log alerts need their series.
MONITORING = """
parameters { key: "prediction_metrics" value { string_value: "outputs=logits,classification=logits,bins=-20:20:40,range=-10:10" } }
parameters { key: "drift" value { string_value: "reference=first:2000,window=4000" } }
parameters { key: "payload_log" value { string_value: "sink=jsonl:LOGS,record=metadata" } }
"""
#: Expressions that need two monitored versions of one model, one of them a shadow
#: (checked against such a server in tests/integration/test_monitoring.py).
TWO_VERSIONS = re.compile(r"\bpdserve_(version_divergence_psi|shadow_divergence_rate)\b")
#: Metrics present only on a machine where NVML finds a GPU.
GPU_ONLY = re.compile(r"\bnv_(gpu|energy)_")

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None, reason="Debian's prometheus is not installed (make sysdeps)"
)


@dataclass
class Prometheus:
    """A running Prometheus and its address."""

    proc: subprocess.Popen[bytes]
    port: int
    log_path: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        """Instant query at now; the ``result`` vector (raises on an API error)."""
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode(
            {"query": expr}
        )
        with urllib.request.urlopen(url, timeout=10) as r:
            doc = json.loads(r.read())
        assert doc["status"] == "success", doc
        assert doc["data"]["resultType"] == "vector", doc
        return list(doc["data"]["result"])

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
            return json.loads(r.read())


def start_prometheus(tmp: Path, target_port: int) -> Prometheus:
    """Start ``prometheus`` on a free loopback port scraping ``127.0.0.1:target_port``
    every second, with the project's rules; wait until it is ready."""
    port = free_port()
    config = tmp / "prometheus.yml"
    config.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - {RULES}\n"
        "scrape_configs:\n  - job_name: pdserve\n    static_configs:\n"
        f"      - targets: ['127.0.0.1:{target_port}']\n"
    )
    log_path = tmp / "prometheus.log"
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={tmp / 'data'}",
            "--log.level=warn",
        ],
        stdout=open(log_path, "wb"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
    )
    prom = Prometheus(proc, port, log_path)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited {proc.returncode}:\n{log_path.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1) as r:
                if r.status == 200:
                    return prom
        except OSError:
            pass
        time.sleep(0.1)
    stop_prometheus(prom)
    raise RuntimeError(f"prometheus not ready:\n{log_path.read_text()}")


def stop_prometheus(prom: Prometheus) -> None:
    """SIGTERM by PID, then SIGKILL after 10 s."""
    if prom.proc.poll() is None:
        prom.proc.send_signal(signal.SIGTERM)
        try:
            prom.proc.wait(10)
        except subprocess.TimeoutExpired:
            prom.proc.kill()
            prom.proc.wait(10)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Prometheus]]:
    tmp = tmp_path_factory.mktemp("prometheus")
    repo = copy_models(tmp / "repo", *PIPELINE)
    config = repo / "efficientnet_lite0" / "config.pbtxt"  # cache panels need a cached model
    config.write_text(
        config.read_text()
        + "\nresponse_cache { enable: true }\n"
        # the distributions-and-drift row: monitoring on the predictor
        + MONITORING.replace("LOGS", str(tmp / "payloads"))
    )
    server = start_server(repo, tmp / "pdserve.log", "--response-cache-byte-size", "1048576")
    try:
        prom = start_prometheus(tmp, server.metrics_port)
    except Exception:
        server.stop()
        raise
    try:
        drive_load(server)
        wait_for_scrapes(prom)
        yield server, prom
    finally:
        stop_prometheus(prom)
        server.stop()


def drive_load(server: ServerProcess, seconds: float = 8.0) -> None:
    """Requests through the image pipeline from 4 threads for ``seconds``: the
    goldens' photos, and every 7th request a body that is not an image (a failure)."""
    data = np.load(GOLDENS / "image_classifier.npz")
    photos = [data[f"image_bytes_{n}"].tobytes() for n in data["names"]]

    def worker(k: int) -> tuple[int, int]:
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
        ok = bad = 0
        i = k
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            raw = b"this is not an image" if i % 7 == 0 else photos[i % len(photos)]
            tensor = httpclient.InferInput("input_image_bytes", [1, 1], "BYTES")
            tensor.set_data_from_numpy(np.array([[raw]], dtype=object))
            try:
                client.infer("image_classifier", [tensor])
                ok += 1
            except InferenceServerException:
                bad += 1
            i += 1
        return ok, bad

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(worker, range(4)))
    ok = sum(r[0] for r in results)
    bad = sum(r[1] for r in results)
    assert ok > 0 and bad > 0, (ok, bad)


def wait_for_scrapes(prom: Prometheus) -> None:
    """Until Prometheus has scraped the load (the p99 recording rule has a value)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        got = prom.query('pdserve:request_duration_seconds:p99_5m{model="image_classifier"}')
        if got and not math.isnan(float(got[0]["value"][1])):
            return
        time.sleep(0.5)
    raise AssertionError("Prometheus did not record the load")


def dashboard_exprs() -> list[str]:
    """Every ``expr`` of the dashboard's panels (rows included) and of its variables'
    queries, with Grafana's variables replaced (:data:`GRAFANA_VARS`)."""
    doc = json.loads(DASHBOARD.read_text())
    panels = list(doc["panels"])
    for p in doc["panels"]:
        panels += p.get("panels", [])
    exprs = [t["expr"] for p in panels for t in p.get("targets", []) if t.get("expr")]
    return [substitute(e) for e in exprs]


def substitute(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unhandled Grafana variable in {expr!r}"
    return expr


def rule_exprs() -> list[tuple[str, str]]:
    """``(name, expr)`` of every recording and alerting rule (read with promtool's
    view of YAML: the file is also checked by promtool in the unit tests)."""
    import yaml

    doc = yaml.safe_load(RULES.read_text())
    out = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            out.append((rule.get("record") or rule["alert"], rule["expr"]))
    return out


_COMPARISON = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*[0-9.eE+-]+\s*$")


def expected_labels(expr: str) -> set[str]:
    """Labels the outermost aggregations keep (``by (le, model)`` -> ``model`` once
    ``histogram_quantile`` drops ``le``); the union over the expression's ``by``
    clauses minus ``le`` unless the expression keeps buckets (a heatmap)."""
    labels: set[str] = set()
    for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
        labels |= {x.strip() for x in group.split(",") if x.strip()}
    if "histogram_quantile" in expr:
        labels.discard("le")
    return labels


def check(prom: Prometheus, expr: str, where: str) -> None:
    result = prom.query(expr)
    assert result, f"{where}: no data for {expr!r}"
    values = [float(r["value"][1]) for r in result]
    assert any(not math.isnan(v) for v in values), f"{where}: only NaN for {expr!r}: {result}"
    want = expected_labels(expr)
    for series in result:
        missing = want - set(series["metric"])
        assert not missing, f"{where}: {expr!r} gave {series['metric']} without {missing}"


def test_prometheus_scrapes_pdserve(stack: tuple[ServerProcess, Prometheus]) -> None:
    _, prom = stack
    targets = prom.get("/api/v1/targets")["data"]["activeTargets"]
    assert [t["health"] for t in targets] == ["up"], targets
    models = {r["metric"]["model"] for r in prom.query("nv_inference_request_success")}
    assert set(PIPELINE) <= models


def test_every_dashboard_expression_returns_data(stack: tuple[ServerProcess, Prometheus]) -> None:
    _, prom = stack
    exprs = dashboard_exprs()
    assert len(exprs) >= 25
    checked = 0
    for expr in exprs:
        if GPU_ONLY.search(expr) and not prom.query("nv_gpu_utilization"):
            continue  # no GPU here: no GPU series, by design
        if TWO_VERSIONS.search(expr):
            continue  # one version here
        check(prom, expr, "dashboard")
        checked += 1
    assert checked >= len(exprs) - 6  # at most the 4 GPU and the 2 divergence expressions


def test_every_rule_expression_returns_data(stack: tuple[ServerProcess, Prometheus]) -> None:
    """Recording rules as written and as the recorded series; alert expressions
    without their threshold (the condition's left side must have data)."""
    _, prom = stack
    rules = rule_exprs()
    assert {name for name, _ in rules} >= {
        "pdserve:request_duration_seconds:p99_5m",
        "pdserve:queue_duration_seconds:p99_5m",
        "pdserve:compute_duration_seconds:p99_5m",
        "PdserveHighErrorRate",
        "PdserveHighP99Latency",
        "PdserveHighQueueTime",
        "PdserveModelNotReady",
    }
    for name, expr in rules:
        expr = " ".join(expr.split())
        if name[0].isupper():  # an alert
            left = _COMPARISON.sub("", expr)
            assert left != expr, f"{name}: no threshold to strip in {expr!r}"
            check(prom, left, name)
        else:
            check(prom, expr, name)
            check(prom, name, name)


def test_rule_values_match_the_load(stack: tuple[ServerProcess, Prometheus]) -> None:
    """The error ratio of the pipeline is about 1/7 (every 7th request is not an
    image); python workers' RSS and CPU series exist for the python steps; every
    pipeline model is ready."""
    _, prom = stack
    ratio = prom.query('pdserve:request_error_ratio:rate5m{model="image_classifier"}')
    assert 0.08 < float(ratio[0]["value"][1]) < 0.22, ratio
    rss = {r["metric"]["model"]: float(r["value"][1]) for r in prom.query(
        "sum by (model) (pdserve_worker_resident_memory_bytes)"
    )}  # fmt: skip
    assert set(rss) == set(PYTHON_MODELS)
    assert all(v > 10e6 for v in rss.values()), rss
    ready = prom.query("pdserve_model_ready")
    assert {r["metric"]["model"] for r in ready} == set(PIPELINE)
    assert all(r["value"][1] == "1" for r in ready)
    rules = prom.get("/api/v1/rules")["data"]["groups"]
    assert all(r["health"] == "ok" for g in rules for r in g["rules"]), rules
