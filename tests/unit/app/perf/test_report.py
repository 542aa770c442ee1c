"""Unit tests: what ``pdserve perf`` shows and writes (pdserve.app.perf.report): the CSV
columns (perf_analyzer's, then pdserve's), the summary table, the live display on a
terminal and off it, the JSON report."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np

from pdserve.app.perf.options import PerfOptions
from pdserve.app.perf.report import (
    TerminalProgress,
    csv_rows,
    report_dict,
    summary_table,
    write_csv,
    write_json,
)
from pdserve.app.perf.stats import PointResult, ServerCounters, Window, point_result

#: perf_analyzer's ``-f`` header with server statistics (report_writer.cc).
PA_HEADER = [
    "Concurrency",
    "Inferences/Second",
    "Client Send",
    "Network+Server Send/Recv",
    "Server Queue",
    "Server Compute Input",
    "Server Compute Infer",
    "Server Compute Output",
    "Client Recv",
    "p50 latency",
    "p90 latency",
    "p95 latency",
    "p99 latency",
    "Avg latency",
    "request/response",
    "response wait",
]


def _point(level: int = 4, errors: dict[str, int] | None = None) -> PointResult:
    stats = [
        {
            "name": "m",
            "inference_count": 100,
            "execution_count": 50,
            "inference_stats": {
                "success": {"count": 100, "ns": 80_000_000},
                "queue": {"count": 100, "ns": 30_000_000},
                "compute_infer": {"count": 100, "ns": 20_000_000},
            },
        }
    ]
    w = Window(
        start_ns=0,
        end_ns=1_000_000_000,
        latencies_ns=np.arange(1, 101, dtype=np.int64) * 10_000,  # 10 us .. 1 ms
        send_ns=100 * 5_000,
        recv_ns=100 * 5_000,
        errors=errors or {},
        server=ServerCounters.from_model_stats(stats, "m"),
    )
    return point_result("concurrency", level, 2, [w], True, None)


def test_csv_has_perf_analyzers_columns_then_ours(tmp_path: Path) -> None:
    rows = csv_rows([_point()], server_stats=True)
    header, row = rows
    assert header[: len(PA_HEADER)] == PA_HEADER
    assert header[len(PA_HEADER) :] == [
        "Requests/Second",
        "Errors",
        "Stable",
        "Delayed Requests",
        "Server Avg Batch Size",
        "Client CPU per Request",
    ]
    v = dict(zip(header, row, strict=True))
    assert v["Concurrency"] == "4" and v["Inferences/Second"] == "200.00"  # 100 req/s x batch 2
    assert v["Server Queue"] == "300" and v["Server Compute Infer"] == "200"
    assert v["p50 latency"] == "510" and v["p99 latency"] == "990"  # integer microseconds
    assert v["Avg latency"] == "505" and v["Client Send"] == "5" and v["Client Recv"] == "5"
    # avg - send - recv - queue - compute, at least 0 (perf_analyzer's definition).
    assert v["Network+Server Send/Recv"] == "0"
    assert v["response wait"] == "495" and v["Server Avg Batch Size"] == "2.00"
    # Without server statistics the five server columns are left out, as perf_analyzer does.
    header, _ = csv_rows([_point()], server_stats=False)
    assert "Server Queue" not in header and "Client Recv" in header
    path = tmp_path / "r.csv"
    write_csv(path, [_point(1), _point(8)])
    with open(path, newline="") as f:
        assert [r["Concurrency"] for r in csv.DictReader(f)] == ["1", "8"]


def test_summary_table_and_errors() -> None:
    text = summary_table([_point(1), _point(8, {"HTTP 503": 3})])
    lines = text.splitlines()
    assert lines[0].split() == [
        "concurrency", "infer/s", "p50", "ms", "p90", "ms", "p95", "ms", "p99", "ms", "avg",
        "ms", "errors", "queue", "us", "compute", "us", "stable",
    ]  # fmt: skip
    assert lines[2].split()[:3] == ["8", "200.0", "0.510"]
    assert lines[-1] == "errors: HTTP 503: 3"
    assert summary_table([]) == "no results"


def test_progress_plain_lines_and_terminal() -> None:
    plain = io.StringIO()
    p = TerminalProgress(plain, tty=False)
    p.max_trials = 10
    p.start(
        {
            "model": "m", "url": "h:1", "protocol": "http", "mode": "concurrency",
            "levels": [1.0, 4.0], "workers": 2, "server_stats": True, "batch_size": 2,
        }
    )  # fmt: skip
    w = Window(0, 1_000_000_000, np.full(50, 1_000_000, dtype=np.int64))
    p.window("concurrency", 4, 3, w, True, 2)
    p.level_done(_point())
    out = plain.getvalue().splitlines()
    assert out[0].startswith("pdserve perf: model m at h:1 (HTTP), batch 2, 2 load worker(s)")
    assert out[2] == (
        "  concurrency 4  window 3/10: 100.0 infer/s, p50 1.000 ms, p99 1.000 ms, errors 0  stable"
    )
    assert out[3].startswith("concurrency 4: 200.0 infer/s, p50 0.510 ms, p99 0.990 ms")
    assert "\r" not in plain.getvalue()
    # On a terminal each window rewrites the same line; a level's result stays.
    term = io.StringIO()
    t = TerminalProgress(term, tty=True)
    t.window("concurrency", 4, 1, w, False, 1)
    t.level_done(_point())
    assert term.getvalue().startswith("\r\x1b[K  concurrency 4  window 1:")
    assert term.getvalue().count("\n") == 1


def test_json_report(tmp_path: Path) -> None:
    opts = PerfOptions(model="m", concurrency=[4])
    doc = report_dict(opts, [_point()], {"model": "m"})
    assert doc["complete"] is True and doc["error"] is None
    assert doc["options"]["url"] == "localhost:8000" and doc["options"]["concurrency"] == [4]
    assert PointResult.from_dict(doc["results"][0]) == _point()
    path = tmp_path / "r.json"
    write_json(path, opts, [], None, "server down")
    saved = json.loads(path.read_text())
    assert saved["complete"] is False and saved["error"] == "server down"
