"""``pdserve top``: a live per-model view of a running server, from its ``/metrics``.

For the engineer who has only a shell on the box. Every ``--interval`` seconds
(default 1) it scrapes the Prometheus endpoint (``--metrics-port``, default 8002;
works against Triton too, less the pdserve-only columns) and prints one row per
model, all versions together (the columns: :class:`Row`).

On a terminal the screen is redrawn in place (ANSI home + clear, no curses); piped,
each refresh is a block of plain lines headed by a timestamp. ``--once`` scrapes
twice, one interval apart, prints one table and exits (for scripts and tests);
``--count N`` stops after N refreshes. Only the previous scrape is kept. A server
that cannot be reached is a clear one-line message: ``--once`` exits 1, the live
view keeps trying each interval. Ctrl-C exits 0.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

from pdserve.app.subcommands import Subparsers

#: Where ``--url`` points by default: pdserve's (and Triton's) metrics port on loopback.
DEFAULT_URL = "127.0.0.1:8002"

#: Seconds to wait for one scrape.
SCRAPE_TIMEOUT_SECS = 3.0

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

_CLEAR = "\x1b[H\x1b[2J"


class ScrapeError(RuntimeError):
    """The metrics endpoint could not be read (message says why and what to check)."""


@dataclass
class ModelSample:
    """One model's counters in one scrape (summed over its versions)."""

    success: float = 0.0
    failure: float = 0.0
    pending: float = 0.0
    #: histogram name -> {le upper bound: cumulative count}
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)


def metrics_url(url: str) -> str:
    """``host:port`` or a URL -> the full ``http://host:port/metrics`` URL."""
    if "://" not in url:
        url = "http://" + url
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    return url


def scrape(url: str, timeout: float = SCRAPE_TIMEOUT_SECS) -> str:
    """The exposition text at ``url``.

    Raises:
        ScrapeError: no connection, a timeout, or a non-200 answer.
    """
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return str(r.read().decode("utf-8", errors="replace"))
    except urllib.error.HTTPError as e:
        raise ScrapeError(f"{url}: HTTP {e.code} (is this pdserve's --metrics-port?)") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise ScrapeError(
            f"cannot reach {url}: {reason} -- is pdserve running, with metrics on this "
            "port (--metrics-port, not --no-allow-metrics)?"
        ) from None


_HISTOGRAMS = ("pdserve_request_duration_seconds", "pdserve_queue_duration_seconds")


def parse(text: str) -> dict[str, ModelSample]:
    """Per-model samples of the metrics ``top`` shows, from Prometheus text format."""
    models: dict[str, ModelSample] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        name, raw_labels, raw_value = m.groups()
        if not (name.startswith("nv_inference_") or name.startswith("pdserve_")):
            continue
        labels = dict(_LABEL.findall(raw_labels or ""))
        model = labels.get("model")
        if model is None:
            continue
        try:
            value = float(raw_value)
        except ValueError:
            continue
        s = models.setdefault(model, ModelSample())
        if name == "nv_inference_request_success":
            s.success += value
        elif name == "nv_inference_request_failure":
            s.failure += value
        elif name == "nv_inference_pending_request_count":
            s.pending += value
        elif name.endswith("_bucket") and name[:-7] in _HISTOGRAMS and "le" in labels:
            le = math.inf if labels["le"] == "+Inf" else float(labels["le"])
            h = s.buckets.setdefault(name[:-7], {})
            h[le] = h.get(le, 0.0) + value
    return models


def quantile(q: float, before: dict[float, float], after: dict[float, float]) -> float | None:
    """The ``q`` quantile (same unit as ``le``) of the observations between two scrapes
    of a cumulative histogram, as Prometheus' ``histogram_quantile``; None without any."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    total = counts[-1]
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return prev_bound
            inside = count - prev_count
            if inside <= 0:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / inside
        prev_bound, prev_count = bound, count
    return prev_bound


@dataclass
class Row:
    """One model's line of the table:

    ==========  ==========================================================================
    QPS         requests finished per second (successes + failures) since the last scrape
    ERR/S       failures per second (``nv_inference_request_failure``, every reason)
    ERR%        failures / requests over the interval
    P50 / P99   request latency of the interval's successes, ms, from the
                ``pdserve_request_duration_seconds`` histogram (as ``histogram_quantile``:
                interpolated within the bucket); ``-`` when no request finished
    QUEUE       requests waiting now (``nv_inference_pending_request_count``)
    QP99        p99 queue time of the interval, ms (``pdserve_queue_duration_seconds``)
    ==========  ==========================================================================
    """

    model: str
    qps: float
    err_per_s: float
    err_ratio: float | None
    p50_ms: float | None
    p99_ms: float | None
    queue: float
    queue_p99_ms: float | None


def rows(
    before: dict[str, ModelSample], after: dict[str, ModelSample], seconds: float
) -> list[Row]:
    """The table between two scrapes ``seconds`` apart, by model name."""
    out = []
    for model in sorted(after):
        a = after[model]
        b = before.get(model, ModelSample())
        ok = max(0.0, a.success - b.success)
        bad = max(0.0, a.failure - b.failure)
        total = ok + bad
        req_a = a.buckets.get("pdserve_request_duration_seconds", {})
        req_b = b.buckets.get("pdserve_request_duration_seconds", {})
        q_a = a.buckets.get("pdserve_queue_duration_seconds", {})
        q_b = b.buckets.get("pdserve_queue_duration_seconds", {})
        p50 = quantile(0.5, req_b, req_a)
        p99 = quantile(0.99, req_b, req_a)
        qp99 = quantile(0.99, q_b, q_a)
        out.append(
            Row(
                model=model,
                qps=total / seconds if seconds > 0 else 0.0,
                err_per_s=bad / seconds if seconds > 0 else 0.0,
                err_ratio=bad / total if total else None,
                p50_ms=None if p50 is None else p50 * 1000,
                p99_ms=None if p99 is None else p99 * 1000,
                queue=a.pending,
                queue_p99_ms=None if qp99 is None else qp99 * 1000,
            )
        )
    return out


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


HEADER = f"{'MODEL':<28} {'QPS':>9} {'ERR/S':>8} {'ERR%':>6} {'P50ms':>9} {'P99ms':>9} {'QUEUE':>6} {'QP99ms':>9}"


def render(table: list[Row], url: str, seconds: float, now: float | None = None) -> str:
    """The table as text: a title line, the header, one line per model."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    lines = [f"pdserve top -- {url} -- {stamp} -- last {seconds:.1f} s", HEADER]
    for r in table:
        err_pct = None if r.err_ratio is None else r.err_ratio * 100
        lines.append(
            f"{r.model[:28]:<28} {r.qps:>9.1f} {r.err_per_s:>8.1f} {_num(err_pct, '.1f'):>6} "
            f"{_num(r.p50_ms, '.2f'):>9} {_num(r.p99_ms, '.2f'):>9} {r.queue:>6.0f} "
            f"{_num(r.queue_p99_ms, '.2f'):>9}"
        )
    if not table:
        lines.append("(no models served)")
    return "\n".join(lines) + "\n"


def top(
    url: str,
    interval: float,
    count: int,
    out: TextIO,
    tty: bool,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Scrape ``url`` every ``interval`` s and print the table ``count`` times (0: until
    Ctrl-C); returns the exit code (0, or 1 when ``count`` is 1 and the server could
    not be read)."""
    previous: tuple[float, dict[str, ModelSample]] | None = None
    shown = 0
    while count == 0 or shown < count:
        started = time.monotonic()
        try:
            current = parse(scrape(url))
        except ScrapeError as e:
            if count == 1:
                print(f"pdserve top: {e}", file=sys.stderr)
                return 1
            out.write((_CLEAR if tty else "") + f"pdserve top: {e} (retrying)\n")
            out.flush()
            previous = None
            shown += 1
            sleep(interval)
            continue
        if previous is not None:
            seconds = started - previous[0]
            text = render(rows(previous[1], current, seconds), url, seconds)
            out.write(_CLEAR + text if tty else text + "\n")
            out.flush()
            shown += 1
        previous = (started, current)
        if count == 0 or shown < count:
            sleep(max(0.0, interval - (time.monotonic() - started)))
    return 0


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """Add ``pdserve top`` to the CLI's subcommands; its defaults set ``run``."""
    p = sub.add_parser(
        "top",
        help="live per-model QPS, p99, queue and errors of a running server",
        description="Show each model's QPS, errors, p50/p99 latency and queue, refreshed "
        "every --interval seconds from the server's Prometheus metrics endpoint.",
    )
    p.add_argument(
        "--url",
        default=DEFAULT_URL,
        help="metrics address, host:port or URL (default %(default)s: --metrics-port)",
    )
    p.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refreshes (default 1)"
    )
    p.add_argument("--once", action="store_true", help="print one table and exit")
    p.add_argument(
        "--count", type=int, default=0, help="stop after this many refreshes (default: never)"
    )
    p.set_defaults(run=run)
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``pdserve top``; the process exit code (0; 1 server unreachable with
    ``--once``; 2 bad arguments)."""
    if not (math.isfinite(args.interval) and 0.1 <= args.interval <= 3600):
        print("pdserve top: --interval must be 0.1-3600 seconds", file=sys.stderr)
        return 2
    if args.count < 0:
        print("pdserve top: --count must be >= 0", file=sys.stderr)
        return 2
    count = 1 if args.once else args.count
    try:
        return top(metrics_url(args.url), args.interval, count, sys.stdout, sys.stdout.isatty())
    except KeyboardInterrupt:
        return 0
    except BrokenPipeError:  # the reader went away (`pdserve top | head`): stop quietly
        # stdout's buffer cannot be flushed any more; point it at /dev/null so the
        # interpreter's final flush does not raise again (Python's documented idiom)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
