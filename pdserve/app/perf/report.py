"""What ``pdserve perf`` shows and writes: the live progress display, the summary
table, CSV (perf_analyzer's ``-f`` columns), JSON and a PNG plot.

CSV columns are perf_analyzer's (``report_writer.cc``), integers in microseconds:
``Concurrency`` (or ``Request Rate``), ``Inferences/Second``, ``Client Send``,
``Network+Server Send/Recv``, ``Server Queue``, ``Server Compute Input``,
``Server Compute Infer``, ``Server Compute Output`` (these five only when the
server has the statistics extension), ``Client Recv``, ``p50/p90/p95/p99 latency``
(plus the ``--percentile`` one), then its verbose columns ``Avg latency``,
``request/response``, ``response wait``, then pdserve's own: ``Requests/Second``,
``Errors``, ``Stable``, ``Delayed Requests``, ``Server Avg Batch Size``, ``Client CPU
per Request`` (the load workers' CPU time, microseconds). Rows are
in sweep order. gRPC's ``Client Send``/``Client Recv`` are 0 (not measured).
"""

from __future__ import annotations

import csv
import datetime
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from pdserve import __version__
from pdserve.app.perf.options import PERCENTILES, PerfError, PerfOptions
from pdserve.app.perf.stats import PointResult, RunInfo, Window


def _fmt_level(mode: str, level: float) -> str:
    return str(int(level)) if mode == "concurrency" else f"{level:g}"


def _ms(us: float | None) -> str:
    return "-" if us is None else f"{us / 1000:.3f}"


class TerminalProgress:
    """The live display: on a terminal one line rewritten after each window and
    kept per level; otherwise plain lines (one per window and per level). Writes to
    ``stream`` (stderr by default). Remembers the run's ``info`` for the reports."""

    def __init__(self, stream: IO[str] | None = None, tty: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.info: RunInfo = {}
        self.max_trials = 0
        self.percentile: int | None = None

    def _write(self, text: str, final: bool = True) -> None:
        if self.tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def start(self, info: RunInfo) -> None:
        """Print what is measured."""
        self.info = info
        proto = info["protocol"].upper()
        stats = "server statistics on" if info["server_stats"] else "no server statistics"
        levels = ", ".join(_fmt_level(info["mode"], v) for v in info["levels"][:12])
        if len(info["levels"]) > 12:
            levels += ", ..."
        self._write(
            f"pdserve perf: model {info['model']} at {info['url']} ({proto}), batch "
            f"{info['batch_size']}, {info['workers']} load worker(s), {stats}"
        )
        self._write(f"  {info['mode'].replace('_', ' ')}: {levels}")

    def window(
        self, mode: str, level: float, trial: int, window: Window, stable: bool, batch_size: int
    ) -> None:
        """One window's figures."""
        lat = window.latencies_ns
        p50 = lat[len(lat) // 2] / 1000 if len(lat) else None
        p99 = lat[min(len(lat) - 1, int(0.99 * (len(lat) - 1) + 0.5))] / 1000 if len(lat) else None
        errs = window.error_count
        text = (
            f"  {mode.replace('_', ' ')} {_fmt_level(mode, level)}  window {trial}"
            f"{'/' + str(self.max_trials) if self.max_trials else ''}:"
            f" {window.requests_per_s() * batch_size:,.1f} infer/s, p50 {_ms(p50)} ms,"
            f" p99 {_ms(p99)} ms, errors {errs}{'  stable' if stable else ''}"
        )
        self._write(text, final=not self.tty)

    def level_done(self, point: PointResult) -> None:
        """The level's result line."""
        lat = point.latency_us
        flag = "" if point.stable else ("  (aborted)" if point.aborted else "  (not stable)")
        text = (
            f"{point.label}: {point.infer_per_sec:,.1f} infer/s, p50 {_ms(lat.get('p50'))} ms, "
            f"p99 {_ms(lat.get('p99'))} ms, errors {point.error_count}{flag}"
        )
        if point.server:
            s = point.server
            text += (
                f"  [server: queue {s['queue_us']:.0f} us, compute "
                f"{s['compute_input_us'] + s['compute_infer_us'] + s['compute_output_us']:.0f} us]"
            )
        if point.request_count:
            text += f"  [client: {point.client_cpu_us_per_request:.0f} us CPU/request]"
        self._write(text)
        if point.aborted:
            self._write(f"  stopped: {point.aborted}")

    def note(self, text: str) -> None:
        """A warning line."""
        self._write(f"note: {text}")


def summary_table(results: Sequence[PointResult]) -> str:
    """The results as a fixed-width table (milliseconds; server columns in us)."""
    if not results:
        return "no results"
    head = "concurrency" if results[0].mode == "concurrency" else "req/s"
    cols = [head, "infer/s", "p50 ms", "p90 ms", "p95 ms", "p99 ms", "avg ms", "errors"]
    cols += ["queue us", "compute us", "stable"]
    rows = []
    for p in results:
        lat = p.latency_us
        s = p.server
        compute = (
            f"{s['compute_input_us'] + s['compute_infer_us'] + s['compute_output_us']:.0f}"
            if s
            else "-"
        )
        rows.append(
            [
                _fmt_level(p.mode, p.level),
                f"{p.infer_per_sec:,.1f}",
                _ms(lat.get("p50")),
                _ms(lat.get("p90")),
                _ms(lat.get("p95")),
                _ms(lat.get("p99")),
                _ms(lat.get("avg")),
                str(p.error_count),
                f"{s['queue_us']:.0f}" if s else "-",
                compute,
                "yes" if p.stable else ("aborted" if p.aborted else "no"),
            ]
        )
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    errors: dict[str, int] = {}
    for p in results:
        for k, n in p.errors.items():
            errors[k] = errors.get(k, 0) + n
    if errors:
        lines.append("errors: " + ", ".join(f"{k}: {n}" for k, n in sorted(errors.items())))
    return "\n".join(lines)


def csv_rows(results: Sequence[PointResult], server_stats: bool) -> list[list[str]]:
    """Header and rows of the CSV report (see the module docstring)."""
    if not results:
        return [["Concurrency", "Inferences/Second"]]
    mode = results[0].mode
    pcts = list(PERCENTILES)
    extra = results[0].stabilizing_percentile
    if extra is not None and extra not in pcts:
        pcts = sorted([*pcts, extra])
    header = ["Concurrency" if mode == "concurrency" else "Request Rate", "Inferences/Second"]
    header.append("Client Send")
    if server_stats:
        header += [
            "Network+Server Send/Recv",
            "Server Queue",
            "Server Compute Input",
            "Server Compute Infer",
            "Server Compute Output",
        ]
    header.append("Client Recv")
    header += [f"p{p} latency" for p in pcts]
    header += ["Avg latency", "request/response", "response wait"]
    header += ["Requests/Second", "Errors", "Stable", "Delayed Requests", "Server Avg Batch Size"]
    header += ["Client CPU per Request"]
    out = [header]
    for p in results:
        lat = p.latency_us
        avg = lat.get("avg", 0.0)
        send, recv = p.client_send_us, p.client_recv_us
        row = [_fmt_level(p.mode, p.level), f"{p.infer_per_sec:.2f}", str(int(send))]
        s = p.server
        if server_stats:
            if s:
                compute = s["compute_input_us"] + s["compute_infer_us"] + s["compute_output_us"]
                network = max(0.0, avg - send - recv - s["queue_us"] - compute)
                row += [
                    str(int(network)),
                    str(int(s["queue_us"])),
                    str(int(s["compute_input_us"])),
                    str(int(s["compute_infer_us"])),
                    str(int(s["compute_output_us"])),
                ]
            else:
                row += [""] * 5
        row.append(str(int(recv)))
        row += [str(int(lat[f"p{q}"])) if f"p{q}" in lat else "" for q in pcts]
        row += [str(int(avg)), str(int(send + recv)), str(int(max(0.0, avg - send - recv)))]
        row += [
            f"{p.requests_per_sec:.2f}",
            str(p.error_count),
            "1" if p.stable else "0",
            str(p.delayed_requests),
            f"{s['avg_batch_size']:.2f}" if s else "",
            str(int(p.client_cpu_us_per_request)),
        ]
        out.append(row)
    return out


def write_csv(path: str | Path, results: Sequence[PointResult], server_stats: bool = True) -> None:
    """Write the CSV report (``server_stats``: include the server columns).

    Raises:
        PerfError: the file cannot be written.
    """
    try:
        with open(path, "w", newline="") as f:
            csv.writer(f).writerows(csv_rows(results, server_stats))
    except OSError as e:
        raise PerfError(f"cannot write {path}: {e.strerror or e}") from None


def report_dict(
    opts: PerfOptions,
    results: Sequence[PointResult],
    info: RunInfo | None = None,
    error: str | None = None,
) -> dict[str, object]:
    """The JSON report: tool, version, time, options, run info, results, and the
    error that ended the run early (None when it ran to the end)."""
    return {
        "tool": "pdserve perf",
        "version": __version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "options": opts.as_dict(),
        "info": info or {},
        "complete": error is None and all(p.aborted is None for p in results),
        "error": error,
        "results": [p.as_dict() for p in results],
    }


def write_json(
    path: str | Path,
    opts: PerfOptions,
    results: Sequence[PointResult],
    info: RunInfo | None = None,
    error: str | None = None,
) -> None:
    """Write the JSON report (:func:`report_dict`).

    Raises:
        PerfError: the file cannot be written.
    """
    try:
        Path(path).write_text(json.dumps(report_dict(opts, results, info, error), indent=2) + "\n")
    except OSError as e:
        raise PerfError(f"cannot write {path}: {e.strerror or e}") from None


def write_plot(path: str | Path, results: Sequence[PointResult], title: str = "") -> None:
    """A PNG of latency (p50, p90, p99, ms) against throughput (infer/s), each point
    labelled with its concurrency or rate; levels that completed no request are
    left out.

    Raises:
        PerfError: matplotlib is missing (``pip install 'pdserve[perf]'``) or the
            file cannot be written.
    """
    try:
        import logging

        import matplotlib

        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PerfError(
            "--plot needs matplotlib: pip install 'pdserve[perf]' (or matplotlib)"
        ) from None
    points = [p for p in results if p.request_count > 0]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    xs = [p.infer_per_sec for p in points]
    for key, style in (("p50", "o-"), ("p90", "s--"), ("p99", "^-")):
        ys = [p.latency_us.get(key, 0.0) / 1000 for p in points]
        ax.plot(xs, ys, style, label=key, markersize=4)
    for p in points:
        ax.annotate(
            _fmt_level(p.mode, p.level),
            (p.infer_per_sec, p.latency_us.get("p99", 0.0) / 1000),
            textcoords="offset points",
            xytext=(3, 4),
            fontsize=7,
        )
    mode = points[0].mode if points else "concurrency"
    ax.set_xlabel("throughput (infer/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title or "pdserve perf", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(title="labels: " + ("concurrency" if mode == "concurrency" else "req/s"), fontsize=8)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    try:
        fig.savefig(path)
    except OSError as e:
        raise PerfError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
