"""What ``pdserve analyze`` shows and writes: the live progress on the terminal
(one line rewritten per window on a TTY, plain lines otherwise), the summary
table, the recommendation with its ``config.pbtxt`` diff, and the files of the
output folder:

- ``report.html``: the run, the recommendation, the plots (PNG embedded as
  base64) and every configuration measured;
- ``throughput_p99.png`` (throughput against p99 latency, one curve per
  configuration over its concurrency levels) and ``memory.png`` (resident memory
  per configuration), beside it;
- ``results.json`` (everything), ``results.csv`` (one row per configuration);
- ``recommendation.diff`` and ``recommended/<model>/config.pbtxt`` for each model
  whose configuration changes.
"""

from __future__ import annotations

import base64
import csv
import datetime
import html
import io
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import IO

from pdserve import __version__
from pdserve.app.analyze.options import AnalyzeInfo, Progress
from pdserve.app.analyze.recommend import (
    MIB,
    ConfigResult,
    Constraints,
    LevelResult,
    feasible,
    memory_fit,
    rank_key,
    violations,
)
from pdserve.app.analyze.runner import AnalyzeResult
from pdserve.app.analyze.space import Point, config_diff, render
from pdserve.app.perf.stats import Window


def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / MIB:,.0f}"


def _clock(t: float) -> str:
    return f"{int(t) // 60}:{int(t) % 60:02d}"


def format_bytes(n: float) -> str:
    """``2.0 GiB`` / ``512 MiB``."""
    if n >= 1024**3:
        return f"{n / 1024**3:.1f} GiB"
    return f"{n / MIB:.0f} MiB"


class TerminalProgress(Progress):
    """Progress on ``stream`` (stderr by default): per configuration a header, a
    line per concurrency level and a result line; on a terminal, each perf window
    also shows on one line rewritten in place."""

    def __init__(
        self, stream: IO[str] | None = None, tty: bool | None = None, p99_ms: float | None = None
    ) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.p99_ms = p99_ms
        self._live = False

    def _write(self, text: str) -> None:
        if self._live:
            self.stream.write("\r\x1b[K")
            self._live = False
        self.stream.write(text + "\n")
        self.stream.flush()

    def start(self, info: AnalyzeInfo) -> None:
        """What will be searched, and under which objective."""
        what = "pipeline " if info["pipeline"] else ""
        steps = f" (steps {', '.join(info['steps'])})" if info["pipeline"] else ""
        self._write(f"pdserve analyze: {what}{info['model']}{steps} on {info['server']}")
        self._write(
            f"  {info['search']} search over {len(info['dims'])} dimension(s), "
            f"{info['points']} points; at most {info['max_configs']} configurations in "
            f"{info['max_minutes']:g} min; concurrency {','.join(map(str, info['concurrency']))}"
        )
        self._write("  objective: " + objective_text(info.get("p99_ms"), info.get("memory_budget")))
        for line in info["dims"]:
            self._write(f"    {line}")

    def config_start(self, n: int, point: Point, shipped: bool, repeat: int, t: float) -> None:
        """The configuration's header line."""
        tag = " shipped" if shipped else ""
        again = f" (confirmation {repeat})" if repeat else ""
        from pdserve.app.analyze.space import describe_point

        self._write(f"[{n}{tag}] {_clock(t)} {describe_point(point)}{again}")

    def loaded(self, load_s: float, memory_bytes: float | None) -> None:
        """Load time and memory."""
        mem = f", +{_mib(memory_bytes)} MiB resident" if memory_bytes is not None else ""
        self._write(f"    loaded in {load_s:.1f} s{mem}")

    def window(self, level: int, trial: int, window: Window, batch_size: int) -> None:
        """On a terminal: the window's throughput, rewritten in place."""
        if not self.tty:
            return
        lat = window.latencies_ns
        p99 = lat[min(len(lat) - 1, int(0.99 * (len(lat) - 1) + 0.5))] / 1e6 if len(lat) else 0.0
        self.stream.write(
            f"\r\x1b[K    concurrency {level} window {trial}: "
            f"{window.requests_per_s() * batch_size:,.1f} infer/s, p99 {p99:.1f} ms"
        )
        self.stream.flush()
        self._live = True

    def level(self, level: LevelResult) -> None:
        """The level's line."""
        over = " (above the SLO)" if self.p99_ms is not None and level.p99_ms > self.p99_ms else ""
        batch = f", avg batch {level.avg_batch:.1f}" if level.avg_batch else ""
        errs = f", {level.errors} errors" if level.errors else ""
        if level.aborted:
            errs += f" (stopped: {level.aborted})"
        elif not level.usable and level.requests is not None:
            errs += f" (only {level.requests} requests: not counted)"
        self._write(
            f"    concurrency {level.concurrency}: {level.infer_per_sec:,.1f} infer/s, "
            f"p50 {level.p50_ms:.1f} ms, p99 {level.p99_ms:.1f} ms{over}{batch}{errs}"
        )

    def config_done(self, result: ConfigResult) -> None:
        """The configuration's result line."""
        self._write("    -> " + result_line(result, Constraints(self.p99_ms, None)))

    def note(self, text: str) -> None:
        """A remark."""
        self._write(f"note: {text}")


def objective_text(p99_ms: float | None, memory_budget: float | None) -> str:
    """``highest throughput with p99 <= 50 ms and memory <= 2.0 GiB``."""
    parts = []
    if p99_ms is not None:
        parts.append(f"p99 <= {p99_ms:g} ms")
    if memory_budget is not None:
        parts.append(f"memory <= {format_bytes(memory_budget)}")
    return "highest throughput" + (" with " + " and ".join(parts) if parts else "")


def result_line(r: ConfigResult, c: Constraints) -> str:
    """``85.3 infer/s at concurrency 4 (p99 60.1 ms); 190 MiB (95 MiB/instance); 16 s``."""
    if r.status == "failed":
        return f"failed: {r.error}"
    lv = r.best_level(c.p99_ms)
    if lv is None:
        text = "no level within the SLO" if c.p99_ms is not None else "no level without errors"
    else:
        text = (
            f"{lv.infer_per_sec:,.1f} infer/s at concurrency {lv.concurrency} "
            f"(p99 {lv.p99_ms:.1f} ms)"
        )
    if r.memory_bytes is not None:
        text += (
            f"; {_mib(r.memory_bytes)} MiB resident ({_mib(r.memory_per_instance())} MiB/instance)"
        )
    text += f"; {r.elapsed_s:.0f} s"
    if r.status == "partial":
        text += " (cut by the time budget)"
    return text


# --------------------------------------------------------------------------- summary


def summary_table(res: AnalyzeResult) -> str:
    """Every configuration of the search, best first (fixed width)."""
    c = res.options.constraints
    rows = sorted(
        (r for r in res.results if r.repeat == 0), key=lambda r: rank_key(r, c), reverse=True
    )
    head = ["config", "infer/s", "conc", "p99 ms", "MiB", "MiB/inst", "ok", "knobs"]
    table = [head]
    for r in rows:
        lv = r.best_level(c.p99_ms)
        table.append(
            [
                r.label + (" *" if r is res.recommended else ""),
                f"{lv.infer_per_sec:,.1f}" if lv else "-",
                str(lv.concurrency) if lv else "-",
                f"{lv.p99_ms:.1f}" if lv else "-",
                _mib(r.memory_bytes),
                _mib(r.memory_per_instance()),
                "yes" if feasible(r, c) else "no",
                r.description if r.status != "failed" else f"{r.description} (failed)",
            ]
        )
    widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
    lines = []
    for row in table:
        cells = [
            v.rjust(w) if i else v.ljust(w)
            for i, (v, w) in enumerate(zip(row, widths, strict=False))
        ]
        lines.append("  ".join(cells) + "  " + row[-1])
    return "\n".join(lines)


def recommendation_diff(res: AnalyzeResult) -> str:
    """The unified diff of every model whose configuration the recommendation
    changes ("" when none does, or there is no recommendation)."""
    if res.recommended_configs is None:
        return ""
    return "".join(
        config_diff(m, res.base_configs[m], res.recommended_configs[m]) for m in res.steps
    )


def recommendation_text(res: AnalyzeResult) -> str:
    """What the terminal shows at the end: the recommendation, its gain and diff."""
    c = res.options.constraints
    rec, ship = res.recommended, res.shipped
    if rec is None:
        reasons = "; ".join(
            f"{r.label}: {', '.join(violations(r, c))}" for r in res.results if r.repeat == 0
        )
        return (
            f"no configuration meets the objective ({objective_text(c.p99_ms, c.memory_bytes)})"
            f": {reasons}"
        )
    lines = [f"recommended: {rec.label}: {rec.description}", "  " + result_line(rec, c)]
    if res.unconfirmed is not None:
        lines.append("  " + unconfirmed_text(res))
    elif rec is ship:
        lines.append("  the shipped configuration is the best one measured: no change")
    elif ship is not None:
        lines.append("  " + gain_text(res))
    fit = memory_fit_text(res)
    if fit:
        lines.append("  " + fit)
    diff = recommendation_diff(res)
    if diff:
        lines += ["", diff.rstrip("\n")]
    return "\n".join(lines)


def memory_fit_text(res: AnalyzeResult) -> str:
    """``memory: about 40 MiB once + 12 MiB per instance (fit over 9 configurations)``
    ("" without a fit)."""
    search = [r for r in res.results if r.repeat == 0 and r.status != "failed"]
    fit = memory_fit(search)
    if fit is None:
        return ""
    n = sum(1 for r in search if r.memory_bytes is not None)
    return (
        f"memory: about {_mib(max(0.0, fit[0]))} MiB once + {_mib(fit[1])} MiB per instance "
        f"(fitted on configurations that differ only in instances; {n} with memory)"
    )


def unconfirmed_text(res: AnalyzeResult) -> str:
    """Why the search's best is not recommended (its gain was not confirmed)."""
    u = res.unconfirmed
    assert u is not None
    search = f"{res.gain_search:.2f}x" if res.gain_search is not None else "better"
    confirmed = f"{res.gain_confirmed:.2f}x" if res.gain_confirmed is not None else "no gain"
    return (
        f"the search's best, {u.label} ({u.description}; {search} in the search), measured "
        f"{confirmed} the shipped configuration when both ran again: not confirmed, the "
        "shipped configuration is kept"
    )


def gain_text(res: AnalyzeResult) -> str:
    """``throughput 1.62x the shipped configuration's (search); 1.55x confirmed (...)``."""
    c = res.options.constraints
    n = sum(1 for r in res.results if r.repeat > 0) // 2
    confirmed = (
        f"{res.gain_confirmed:.2f}x when both were measured again ({n}x each)"
        if res.gain_confirmed is not None
        else ""
    )
    if res.gain_search is None:
        text = "the shipped configuration meets the SLO at no level in the search"
        return text + (f"; {confirmed}" if confirmed else "")
    ship = res.shipped.score(c.p99_ms) if res.shipped else 0.0
    rec = res.recommended.score(c.p99_ms) if res.recommended else 0.0
    text = (
        f"throughput {res.gain_search:.2f}x the shipped configuration's "
        f"({rec:,.1f} vs {ship:,.1f} infer/s in the search)"
    )
    return f"{text}; {confirmed}" if confirmed else text


# --------------------------------------------------------------------------- files


def result_dict(res: AnalyzeResult) -> dict[str, object]:
    """The JSON report."""
    c = res.options.constraints
    return {
        "tool": "pdserve analyze",
        "version": __version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "options": res.options.as_dict(),
        "info": res.info,
        "elapsed_s": res.elapsed_s,
        "stop_reason": res.stop_reason,
        "error": res.error,
        "recommended": res.recommended.index if res.recommended else None,
        "unconfirmed": res.unconfirmed.index if res.unconfirmed else None,
        "shipped": res.shipped.index if res.shipped else None,
        "gain_search": res.gain_search,
        "gain_confirmed": res.gain_confirmed,
        "memory_fit_bytes": (
            dict(zip(("fixed", "per_instance"), fit, strict=True))
            if (fit := memory_fit([r for r in res.results if r.repeat == 0]))
            else None
        ),
        "diff": recommendation_diff(res),
        "results": [
            {
                **r.as_dict(),
                "feasible": feasible(r, c),
                "violations": violations(r, c),
                "score_infer_per_sec": r.score(c.p99_ms),
            }
            for r in res.results
        ],
    }


def csv_rows(res: AnalyzeResult) -> list[list[str]]:
    """Header and one row per configuration measured (in order)."""
    c = res.options.constraints
    out = [
        [
            "Config",
            "Shipped",
            "Repeat",
            "Knobs",
            "Status",
            "Inferences/Second",
            "Concurrency",
            "p99 latency ms",
            "Memory MiB",
            "Memory per instance MiB",
            "Feasible",
            "Recommended",
        ]
    ]
    for r in res.results:
        lv = r.best_level(c.p99_ms)
        out.append(
            [
                str(r.index),
                "1" if r.shipped else "0",
                str(r.repeat),
                r.description,
                r.status,
                f"{lv.infer_per_sec:.2f}" if lv else "",
                str(lv.concurrency) if lv else "",
                f"{lv.p99_ms:.3f}" if lv else "",
                f"{r.memory_bytes / MIB:.1f}" if r.memory_bytes is not None else "",
                (f"{m / MIB:.1f}" if (m := r.memory_per_instance()) is not None else ""),
                "1" if feasible(r, c) else "0",
                "1" if r is res.recommended else "0",
            ]
        )
    return out


def _plt() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(res: AnalyzeResult, path: Path) -> None:
    """Throughput (infer/s) against p99 latency (ms): one curve per configuration
    through its concurrency levels; the shipped and recommended ones drawn bold,
    the SLO as a vertical line."""
    plt = _plt()
    c = res.options.constraints
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    search = [r for r in res.results if r.repeat == 0 and r.levels]
    top = sorted(search, key=lambda r: rank_key(r, c), reverse=True)[:6]
    palette = iter(["tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:cyan"])
    for r in search:
        good = [lv for lv in r.levels if lv.errors == 0]
        xs = [lv.p99_ms for lv in good]
        ys = [lv.infer_per_sec for lv in good]
        if r is res.recommended:
            ax.plot(xs, ys, "o-", color="tab:green", lw=2.5, label=f"{r.label} (recommended)")
        elif r.shipped:
            ax.plot(xs, ys, "s--", color="black", lw=2, label=f"{r.label}")
        elif r in top:
            ax.plot(xs, ys, ".-", color=next(palette), lw=1.2, label=r.label)
        else:
            ax.plot(xs, ys, ".-", color="0.75", lw=0.8)
        if r is res.recommended or r.shipped or r in top:
            for lv in good:
                ax.annotate(
                    str(lv.concurrency),
                    (lv.p99_ms, lv.infer_per_sec),
                    textcoords="offset points",
                    xytext=(3, 3),
                    fontsize=6,
                )
    if c.p99_ms is not None:
        ax.axvline(c.p99_ms, color="tab:red", ls=":", label=f"SLO p99 {c.p99_ms:g} ms")
        # Far beyond the SLO only squeezes the part that matters.
        widest = max((lv.p99_ms for r in search for lv in r.levels), default=0.0)
        ax.set_xlim(right=min(widest * 1.05, 3 * c.p99_ms) or None)
    ax.set_xlabel("p99 latency (ms)")
    ax.set_ylabel("throughput (infer/s)")
    ax.set_title(
        f"{res.target}: throughput vs p99 per configuration (labels: concurrency)", fontsize=10
    )
    ax.grid(True, alpha=0.3)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, loc="lower right")
    if c.p99_ms is not None:
        ax.set_xlabel("p99 latency (ms; levels beyond 3x the SLO are off the chart)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def plot_memory(res: AnalyzeResult, path: Path) -> None:
    """Resident memory per configuration (bars, MiB), the budget as a line."""
    plt = _plt()
    c = res.options.constraints
    search = [r for r in res.results if r.repeat == 0]
    fig, ax = plt.subplots(figsize=(8, 4), dpi=110)
    labels = [f"#{r.index}" for r in search]
    values = [(r.memory_bytes or 0.0) / MIB for r in search]
    colors = [
        "tab:green" if r is res.recommended else ("black" if r.shipped else "tab:blue")
        for r in search
    ]
    ax.bar(labels, values, color=colors)
    if c.memory_bytes is not None:
        ax.axhline(c.memory_bytes / MIB, color="tab:red", ls=":", label="budget")
        ax.legend(fontsize=8)
    ax.set_ylabel("resident memory added (MiB)")
    ax.set_title(
        f"{res.target}: memory per configuration (black: shipped, green: recommended)",
        fontsize=10,
    )
    ax.tick_params(axis="x", labelsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _img(path: Path, alt: str) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


_HTML_STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
    "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;"
    "padding:3px 6px;text-align:right}td.l,th.l{text-align:left}tr.rec{background:#dfd}"
    "tr.ship{background:#eee}pre{background:#f6f6f6;padding:8px;overflow:auto}"
    "img{max-width:100%}.add{color:#070}.del{color:#a00}"
)

_HTML_COLUMNS = (
    "config",
    "knobs",
    "status",
    "best infer/s",
    "conc",
    "p99 ms",
    "MiB",
    "MiB/inst",
    "feasible",
    "levels (concurrency: infer/s @ p99 ms)",
)


def html_report(res: AnalyzeResult, plots: Sequence[tuple[Path, str]]) -> str:
    """The HTML report (one self-contained page)."""
    e = html.escape
    out = io.StringIO()
    w = out.write
    w("<!doctype html><html><head><meta charset='utf-8'>")
    w(f"<title>pdserve analyze: {e(res.target)}</title><style>{_HTML_STYLE}</style></head><body>")
    w(f"<h1>pdserve analyze: {e(res.target)}</h1>")
    w(_html_overview(res))
    w(_html_recommendation(res))
    w("<h2>Plots</h2>")
    for path, alt in plots:
        w(f"<p>{_img(path, alt)}</p>")
    w(_html_table(res))
    w(
        "<h2>Method</h2><p>Each configuration is loaded through the repository API with a "
        "<code>config</code> override (explicit model control mode); with pdserve's own "
        "server, a fresh server per configuration (restart mode). Memory: resident set of "
        "the server and its worker processes (from /proc, sampled while serving), highest "
        "reading minus the reading before the load; it includes what loading the backend "
        "costs once (libraries), divided by the instances for the per-instance figure. "
        "Throughput: the best concurrency level without errors whose p99 meets the SLO. "
        "Quick search: hill climbing from the shipped configuration, one step along one "
        f"dimension at a time, moving when throughput gains at least {res.options.min_gain:.0%}."
        "</p>"
    )
    w(f"<p><small>pdserve {e(__version__)}</small></p></body></html>\n")
    return out.getvalue()


def _html_overview(res: AnalyzeResult) -> str:
    """The run at a glance: server, objective, search, load, and the dimensions."""
    e = html.escape
    c = res.options.constraints
    info = res.info
    o = res.options
    out = ["<ul>"]
    if info.get("pipeline"):
        out.append(f"<li>pipeline steps tuned: {e(', '.join(res.steps))}</li>")
    out.append(
        f"<li>server: {e(str(info.get('server', '')))}; machine CPUs: {info.get('cpus')}</li>"
    )
    out.append(f"<li>objective: {e(objective_text(c.p99_ms, c.memory_bytes))}</li>")
    out.append(
        f"<li>search: {e(o.search)}, {len(info.get('dims', []))} dimensions "
        f"({info.get('points')} points); {sum(1 for r in res.results if r.repeat == 0)} "
        f"configurations measured in {res.elapsed_s / 60:.1f} min (budget "
        f"{o.max_minutes:g} min); stopped: {e(res.stop_reason)}</li>"
    )
    out.append(
        f"<li>load: pdserve perf, {o.protocol.upper()}, batch {o.batch_size}, concurrency "
        f"{e(','.join(map(str, o.concurrency)))} (a sweep stops at the SLO or when throughput "
        f"stops growing), windows of {o.measurement_interval_ms} ms, stability "
        f"{o.stability_percentage:g}%, input data {e(o.input_data)}</li>"
    )
    out.append("</ul><h3>Dimensions (shipped value in brackets)</h3><ul>")
    out.extend(f"<li><code>{e(line)}</code></li>" for line in info.get("dims", []))
    out.append("</ul>")
    return "".join(out)


def _html_recommendation(res: AnalyzeResult) -> str:
    """The recommendation, its gain, its config.pbtxt diff and the memory fit."""
    e = html.escape
    c = res.options.constraints
    rec = res.recommended
    out = ["<h2>Recommendation</h2>"]
    if rec is None:
        out.append(f"<p>{e(recommendation_text(res))}</p>")
    else:
        out.append(f"<p><b>{e(rec.label)}</b>: {e(rec.description)}<br>")
        out.append(f"{e(result_line(rec, c))}<br>")
        if res.unconfirmed is not None:
            out.append(f"{e(unconfirmed_text(res))}</p>")
        elif rec is res.shipped:
            out.append("The shipped configuration is the best one measured.</p>")
        else:
            out.append(f"{e(gain_text(res))}</p>")
        diff = recommendation_diff(res)
        if diff:
            out.append("<h3>config.pbtxt diff</h3><pre>")
            out.extend(_html_diff_line(line) for line in diff.splitlines())
            out.append("</pre>")
    if memory_fit_text(res):
        out.append(f"<p>{e(memory_fit_text(res))}</p>")
    return "".join(out)


def _html_diff_line(line: str) -> str:
    """One line of a unified diff, added lines green and removed ones red."""
    if line.startswith("+") and not line.startswith("+++"):
        return f"<span class='add'>{html.escape(line)}</span>\n"
    if line.startswith("-") and not line.startswith("---"):
        return f"<span class='del'>{html.escape(line)}</span>\n"
    return f"{html.escape(line)}\n"


def _html_table(res: AnalyzeResult) -> str:
    """Every measurement, one row each (recommended and shipped rows shaded)."""
    e = html.escape
    c = res.options.constraints
    out = ["<h2>Configurations</h2><table><tr>"]
    out.extend(f"<th class='l'>{h}</th>" for h in _HTML_COLUMNS)
    out.append("</tr>")
    for r in res.results:
        lv = r.best_level(c.p99_ms)
        cls = "rec" if r is res.recommended else ("ship" if r.shipped else "")
        levels = "; ".join(
            f"{x.concurrency}: {x.infer_per_sec:,.1f} @ {x.p99_ms:.1f}" for x in r.levels
        )
        why = ", ".join(violations(r, c))
        label = r.label + (f" (again {r.repeat})" if r.repeat else "")
        out.append(
            f"<tr class='{cls}'><td class='l'>{e(label)}</td><td class='l'>{e(r.description)}</td>"
        )
        out.append(f"<td class='l'>{e(r.status)}</td>")
        out.append(
            f"<td>{lv.infer_per_sec:,.1f}</td><td>{lv.concurrency}</td>" if lv else "<td>-</td>" * 2
        )
        out.append(f"<td>{lv.p99_ms:.1f}</td>" if lv else "<td>-</td>")
        out.append(f"<td>{_mib(r.memory_bytes)}</td><td>{_mib(r.memory_per_instance())}</td>")
        out.append(
            f"<td class='l'>{'yes' if not why else e(why)}</td><td class='l'>{e(levels)}</td></tr>"
        )
    out.append("</table>")
    return "".join(out)


def write_reports(res: AnalyzeResult, out_dir: Path) -> dict[str, Path]:
    """Write every file of the output folder; returns name -> path. Plots are left
    out (with a note in the HTML) when matplotlib is missing."""
    out_dir.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    files["json"] = out_dir / "results.json"
    files["json"].write_text(json.dumps(result_dict(res), indent=2) + "\n")
    files["csv"] = out_dir / "results.csv"
    with open(files["csv"], "w", newline="") as f:
        csv.writer(f).writerows(csv_rows(res))
    plots: list[tuple[Path, str]] = []
    try:
        files["plot_throughput"] = out_dir / "throughput_p99.png"
        plot_throughput(res, files["plot_throughput"])
        plots = [(files["plot_throughput"], "throughput vs p99 per configuration")]
        if any(r.memory_bytes is not None for r in res.results):
            files["plot_memory"] = out_dir / "memory.png"
            plot_memory(res, files["plot_memory"])
            plots.append((files["plot_memory"], "memory per configuration"))
    except ImportError:
        files.pop("plot_throughput", None)
        files.pop("plot_memory", None)
    diff = recommendation_diff(res)
    if diff:
        files["diff"] = out_dir / "recommendation.diff"
        files["diff"].write_text(diff)
    if res.recommended_configs is not None:
        for m, cfg in res.recommended_configs.items():
            if config_diff(m, res.base_configs[m], cfg):
                path = out_dir / "recommended" / m / "config.pbtxt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(render(cfg))
                files[f"config:{m}"] = path
    files["html"] = out_dir / "report.html"
    files["html"].write_text(html_report(res, plots))
    return files
