"""``pdserve analyze``'s reports (:mod:`pdserve.app.analyze.report`) from synthetic
results: the files of the output folder, the HTML page, the summary, the
recommendation text and diff."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from google.protobuf import text_format

from pdserve.app.analyze.options import AnalyzeOptions
from pdserve.app.analyze.recommend import MIB, ConfigResult, LevelResult
from pdserve.app.analyze.report import (
    TerminalProgress,
    recommendation_text,
    summary_table,
    write_reports,
)
from pdserve.app.analyze.runner import AnalyzeResult
from pdserve.app.analyze.space import Knobs, apply_knobs, build_space
from pdserve.config import ModelConfig

RAW = """
name: "m"
platform: "onnxruntime_onnx"
max_batch_size: 32
input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
SHIPPED = Knobs(2, 32, (), None)
BETTER = Knobs(2, 8, (), 0)


def make(results: list[ConfigResult], rec: ConfigResult | None, tmp: Path) -> AnalyzeResult:
    base = text_format.Parse(RAW, ModelConfig())
    opts = AnalyzeOptions(model="m", p99_ms=20, memory_budget=512 * MIB, output_dir=tmp)
    space = build_space("m", {"m": SHIPPED}, cpus=2)
    return AnalyzeResult(
        options=opts,
        target="m",
        steps=["m"],
        space=space,
        results=results,
        recommended=rec,
        shipped=results[0],
        base_configs={"m": base},
        recommended_configs=(
            {"m": apply_knobs(base, rec.point["m"], SHIPPED)} if rec is not None else None
        ),
        info={
            "model": "m",
            "steps": ["m"],
            "pipeline": False,
            "server": "own pdserve",
            "cpus": 2,
            "dims": space.describe_dims(),
            "points": space.size(),
        },
        elapsed_s=95.0,
        gain_search=2.0,
        gain_confirmed=1.8,
        stop_reason="no neighbour of the best configuration is better",
    )


def runs() -> list[ConfigResult]:
    def lv(c: int, t: float, p99: float) -> LevelResult:
        return LevelResult(c, t, p99 / 2, p99, avg_batch=1.5)

    return [
        ConfigResult(
            0, {"m": SHIPPED}, True, [lv(1, 100, 5), lv(2, 150, 30)], 200 * MIB, elapsed_s=10
        ),
        ConfigResult(1, {"m": BETTER}, False, [lv(1, 120, 5), lv(4, 300, 15)], 220 * MIB),
        ConfigResult(2, {"m": Knobs(1, 32, (), None)}, False, [lv(1, 80, 6)], 150 * MIB),
        ConfigResult(3, {"m": Knobs(1, 8, (), 500)}, status="failed", error="boom"),
        ConfigResult(4, {"m": SHIPPED}, True, [lv(1, 100, 5)], 200 * MIB, repeat=1),
        ConfigResult(5, {"m": BETTER}, False, [lv(4, 180, 15)], 220 * MIB, repeat=1),
    ]


def test_every_file_is_written(tmp_path: Path) -> None:
    results = runs()
    res = make(results, results[1], tmp_path)
    files = write_reports(res, tmp_path)
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == [
        "config.pbtxt",
        "memory.png",
        "recommendation.diff",
        "report.html",
        "results.csv",
        "results.json",
        "throughput_p99.png",
    ]
    assert files["config:m"] == tmp_path / "recommended" / "m" / "config.pbtxt"
    assert "max_batch_size: 8" in files["config:m"].read_text()
    assert (tmp_path / "throughput_p99.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    doc = json.loads(files["json"].read_text())
    assert doc["tool"] == "pdserve analyze" and doc["recommended"] == 1 and doc["shipped"] == 0
    assert [r["feasible"] for r in doc["results"]] == [True, True, True, False, True, True]
    assert doc["results"][1]["score_infer_per_sec"] == 300
    assert doc["results"][3]["violations"] == ["failed: boom"]
    assert doc["memory_fit_bytes"]["per_instance"] > 0
    assert "-max_batch_size: 32" in doc["diff"]

    rows = list(csv.DictReader(io.StringIO(files["csv"].read_text())))
    assert [r["Recommended"] for r in rows] == ["0", "1", "0", "0", "0", "0"]
    assert rows[1]["Inferences/Second"] == "300.00" and rows[1]["Concurrency"] == "4"
    assert rows[0]["Memory MiB"] == "200.0" and rows[0]["Memory per instance MiB"] == "100.0"

    page = files["html"].read_text()
    assert page.count("data:image/png;base64,") == 2
    assert "<span class='del'>-max_batch_size: 32</span>" in page
    assert "2.00x the shipped configuration" in page and "1.80x when both" in page
    assert "<tr class='rec'><td class='l'>#1</td>" in page


def test_summary_and_recommendation_text(tmp_path: Path) -> None:
    results = runs()
    res = make(results, results[1], tmp_path)
    table = summary_table(res).splitlines()
    assert table[0].split()[:3] == ["config", "infer/s", "conc"]
    assert [line.split()[0] for line in table[1:]] == ["#1", "#0", "#2", "#3"]
    assert table[1].startswith("#1 *")
    text = recommendation_text(res)
    assert text.startswith("recommended: #1: 2 inst, batch 8, delay 0us")
    assert "300.0 infer/s at concurrency 4 (p99 15.0 ms)" in text
    assert "2.00x the shipped configuration's (300.0 vs 100.0 infer/s" in text
    assert "+max_batch_size: 8" in text

    none = make(results[:1], None, tmp_path)
    assert recommendation_text(none).startswith("no configuration meets the objective")

    kept = make(results, results[0], tmp_path)
    kept.unconfirmed, kept.gain_confirmed = results[1], 0.9
    text = recommendation_text(kept)
    assert text.startswith("recommended: #0 shipped: 2 inst, no batching")
    assert (
        "the search's best, #1 (2 inst, batch 8, delay 0us; 2.00x in the search), measured " in text
    )
    assert "0.90x the shipped configuration when both ran again: not confirmed" in text
    assert "+++" not in text  # no diff: nothing changes


def test_terminal_progress_plain_lines(tmp_path: Path) -> None:
    out = io.StringIO()
    p = TerminalProgress(out, tty=False, p99_ms=20)
    p.config_start(1, {"m": BETTER}, False, 0, 75.0)
    p.level(LevelResult(4, 300, 7.5, 25.0, avg_batch=3.0))
    p.config_done(runs()[1])
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1] 1:15 2 inst, batch 8, delay 0us"
    assert lines[1] == (
        "    concurrency 4: 300.0 infer/s, p50 7.5 ms, p99 25.0 ms (above the SLO), avg batch 3.0"
    )
    assert lines[2].startswith("    -> 300.0 infer/s at concurrency 4 (p99 15.0 ms); 220 MiB")
    assert "\r" not in out.getvalue()
