"""``pdserve analyze``: the subcommand's flags and its run.

Exit codes: 0 a configuration is recommended; 1 none meets the objective, the
run could not start (model unknown, the shipped configuration does not load,
server not in explicit model control mode...) or was interrupted; 2 bad flags.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdserve.app.analyze.options import DEFAULT_CONCURRENCY, AnalyzeOptions
from pdserve.app.analyze.report import (
    TerminalProgress,
    format_bytes,
    recommendation_text,
    summary_table,
    write_reports,
)
from pdserve.app.analyze.runner import run_analyze
from pdserve.app.analyze.server import AnalyzeError, parse_cpus
from pdserve.app.analyze.space import OFF, check_preferred_token
from pdserve.app.perf.cli import add_request_flags, add_window_flags, load_fields
from pdserve.app.subcommands import (
    Subparsers,
    add_subcommand,
    parsed,
    parsed_or_none,
    progress_stream,
)
from pdserve.core.procmem import parse_size

EPILOG = """\
examples:
  pdserve analyze -m efficientnet_lite0 --p99-ms 200 --memory-budget 2GiB --max-minutes 8
  pdserve analyze -m image_classifier --input-data examples/perf/images.json --p99-ms 500
  pdserve analyze -m tiny --search grid --instance-counts 1,2 --max-batch-sizes 8,32 \\
      --preferred-batch-sizes none --queue-delays-us off,0 --max-minutes 2
  pdserve analyze -m tiny -u localhost:8000      # a running server (explicit mode)

Search (--search quick, the default): hill climbing from the shipped configuration,
as model_analyzer's quick search: every configuration one step away along one
dimension is measured, the search moves to the best one if it gains at least
--min-gain throughput; when none does, those two steps away are measured too, and
it stops when they do not gain either. --search grid measures every point
(shipped first) until --max-configs or --max-minutes.

A configuration's score is its best concurrency level without errors whose p99
is within --p99-ms; levels double until the SLO is crossed, then --bisect-steps
concurrencies in between are tried.

Dimensions of one model: instance count, max_batch_size, preferred batch sizes and
max queue delay ('off' = no dynamic batching). Of an ensemble: each step's instance
count and (steps that batch) queue delay; the others when given.

Each configuration is loaded with the repository API's config override; by default
on pdserve's own server, started afresh for each one on a copy of the repository,
so that its resident memory (server + worker processes, from /proc) is measured
from an empty server. Output (-o): report.html with plots, results.json/.csv,
recommendation.diff and recommended/<model>/config.pbtxt.
"""


def parse_int_list(text: str, minimum: int = 1) -> list[int]:
    """``1,2,4`` or ranges ``1:4`` / ``1:16:4`` (mixed) -> sorted distinct ints.

    Raises:
        ValueError: not integers, or below ``minimum``.
    """
    out: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        nums = part.split(":")
        try:
            vals = [int(n) for n in nums]
        except ValueError:
            raise ValueError(f"'{part}' is not an integer or START:END[:STEP]") from None
        if len(vals) == 1:
            out.add(vals[0])
        elif len(vals) in (2, 3):
            step = vals[2] if len(vals) == 3 else 1
            if step < 1 or vals[1] < vals[0]:
                raise ValueError(f"'{part}': END below START or STEP below 1")
            out.update(range(vals[0], vals[1] + 1, step))
        else:
            raise ValueError(f"'{part}' is not an integer or START:END[:STEP]")
    if any(v < minimum for v in out):
        raise ValueError(f"values must be at least {minimum}")
    if len(out) > 64:
        raise ValueError("at most 64 values")
    return sorted(out)


def parse_delays(text: str) -> list[int | None]:
    """``off,0,500`` -> [None, 0, 500] (microseconds; ``off``: no dynamic batching).

    Raises:
        ValueError: not ``off`` or an integer >= 0.
    """
    out: list[int | None] = []
    for part in text.split(","):
        p = part.strip().lower()
        if p == OFF:
            value: int | None = None
        else:
            try:
                value = int(p)
            except ValueError:
                raise ValueError(f"'{part}' is not 'off' or microseconds") from None
            if value < 0:
                raise ValueError(f"'{part}': a delay is 0 or more microseconds")
        if value not in out:
            out.append(value)
    return out


def parse_memory(text: str) -> int:
    """``2GiB``, ``512MiB``, ``2G`` (binary), ``1.5GB`` (decimal), ``1048576`` (bytes)
    -> bytes (:func:`pdserve.core.procmem.parse_size`).

    Raises:
        ValueError: not a size, or 0.
    """
    return parse_size(text)


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """Add ``pdserve analyze`` to the CLI's subcommands; its defaults set ``run``."""
    return add_subcommand(
        sub,
        "analyze",
        help="find the best instance count and batching of a model (model_analyzer's role)",
        description="Search instance counts, max_batch_size, preferred batch sizes and queue\n"
        "delays of MODEL (or the per-step instance counts of an ensemble), measure each\n"
        "configuration with pdserve perf and its resident memory, and recommend the one\n"
        "with the highest throughput under a p99 latency SLO and a memory budget.",
        epilog=EPILOG,
        flags=(
            _add_target_flags,
            _add_objective_flags,
            _add_search_flags,
            _add_load_flags,
            _add_output_flags,
        ),
        run=run,
    )


def _add_target_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("-m", dest="model", required=True, metavar="MODEL", help="model or ensemble")
    g.add_argument(
        "--model-repository",
        type=Path,
        default=None,
        metavar="DIR",
        help="repository of the own server (default: the example repository); the "
        "models MODEL needs are copied, the folder is not changed",
    )
    g.add_argument(
        "-u",
        dest="url",
        default=None,
        metavar="HOST:PORT",
        help="use this running server (HTTP address; explicit model control mode) "
        "instead of starting one; its models are loaded from its repository at the end",
    )
    g.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="with -u: the server's process, for memory (default: found from the port "
        "on this machine)",
    )
    g.add_argument(
        "-i", dest="protocol", choices=("http", "grpc"), default="http", help="perf protocol"
    )
    g.add_argument("--grpc-url", default=None, metavar="HOST:PORT", help="with -u and -i grpc")
    g.add_argument(
        "--server-mode",
        choices=("restart", "reload"),
        default="restart",
        help="own server: a fresh server per configuration (default; memory measured "
        "from an empty server) or one server reloading models (faster; memory approximate)",
    )
    g.add_argument(
        "--server-cpus",
        default=None,
        metavar="LIST",
        help="pin the own server and its worker processes to these CPUs (as taskset -c)",
    )
    g.add_argument(
        "--client-cpus",
        default=None,
        metavar="LIST",
        help="pin this process and its perf load workers to these CPUs",
    )
    g.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra flag for the own 'pdserve serve' (repeatable, e.g. --server-arg=--log-verbose=1)",
    )


def _add_objective_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("objective")
    g.add_argument("--p99-ms", type=float, default=None, help="latency SLO: p99 at most this (ms)")
    g.add_argument(
        "--memory-budget",
        default=None,
        metavar="SIZE",
        help="resident memory the configuration may add, e.g. 2GiB, 512MiB",
    )


def _add_search_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("search")
    g.add_argument("--search", choices=("quick", "grid"), default="quick", help="(default quick)")
    g.add_argument(
        "--instance-counts",
        default=None,
        metavar="LIST",
        help="e.g. 1,2,4 or 1:4 (default 1 to the server's CPUs, 2 to 5)",
    )
    g.add_argument(
        "--max-batch-sizes",
        default=None,
        metavar="LIST",
        help="e.g. 1,8,32 (default powers of 2 up to the shipped max_batch_size)",
    )
    g.add_argument(
        "--preferred-batch-sizes",
        default=None,
        metavar="LIST",
        help="tokens: none, pow2 (1,2,4.. and max_batch_size), half, N, A+B (default none,pow2)",
    )
    g.add_argument(
        "--queue-delays-us",
        default=None,
        metavar="LIST",
        help="max queue delays, 'off' = no dynamic batching (default off,0,500,2000; "
        "ensemble steps off,0,1000)",
    )
    g.add_argument(
        "--max-configs", type=int, default=40, help="most configurations searched (default 40)"
    )
    g.add_argument(
        "--max-minutes", type=float, default=10.0, help="time budget in minutes (default 10)"
    )
    g.add_argument(
        "--min-gain",
        type=float,
        default=2.0,
        metavar="PCT",
        help="quick search: a move needs this much more throughput (%%, default 2)",
    )
    g.add_argument(
        "--confirm",
        type=int,
        default=1,
        help="measure the shipped and the recommended configuration again this many "
        "times each at the end, for the gain (default 1; 0: no)",
    )


def _add_load_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load (pdserve perf)")
    g.add_argument(
        "--concurrency",
        default=",".join(map(str, DEFAULT_CONCURRENCY)),
        metavar="LIST",
        help="levels, in order (default %(default)s)",
    )
    add_request_flags(g, "as pdserve perf (an image model needs real images: a JSON file)")
    add_window_flags(
        g,
        (1000, 15.0, 6),
        ("perf window (default 1000 ms)", "(default 15)", "windows per level (6)"),
    )
    g.add_argument("--perf-workers", type=int, default=0, help="perf load processes (0: auto)")
    g.add_argument(
        "--bisect-steps",
        type=int,
        default=2,
        help="with --p99-ms: concurrencies tried between the last level within the SLO "
        "and the first above it (binary search; default 2)",
    )


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument(
        "-o",
        "--output-dir",
        type=Path,
        default=None,
        help="folder of the reports (default analyze-MODEL)",
    )
    g.add_argument("-q", "--quiet", action="store_true", help="no progress")


def options_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> AnalyzeOptions:
    """Turn parsed flags into :class:`AnalyzeOptions` (exits 2 via ``parser.error``)."""
    if args.url and args.model_repository:
        parser.error("give --model-repository (own server) or -u (running server), not both")
    if args.url is None and (args.server_pid is not None or args.grpc_url):
        parser.error("--server-pid and --grpc-url go with -u")
    if args.url and args.protocol == "grpc" and not args.grpc_url:
        parser.error("-u with -i grpc needs --grpc-url")
    if args.max_minutes <= 0 or args.max_configs < 1 or args.confirm < 0:
        parser.error("--max-minutes must be above 0, --max-configs at least 1, --confirm >= 0")
    if args.p99_ms is not None and args.p99_ms <= 0:
        parser.error("--p99-ms must be above 0")
    if args.min_gain < 0 or args.bisect_steps < 0:
        parser.error("--min-gain and --bisect-steps must be 0 or more")
    if args.batch_size < 1 or args.measurement_interval < 10 or args.max_trials < 1:
        parser.error("-b and -r must be at least 1, -p at least 10 ms")
    load = load_fields(args, parser)
    preferred = None
    if args.preferred_batch_sizes:
        preferred = [
            parsed(parser, check_preferred_token, t, "--preferred-batch-sizes")
            for t in args.preferred_batch_sizes.split(",")
        ]
    return AnalyzeOptions(
        **load,
        model=args.model,
        repository=args.model_repository,
        url=args.url,
        protocol=args.protocol,
        grpc_url=args.grpc_url,
        server_pid=args.server_pid,
        server_cpus=parsed_or_none(parser, parse_cpus, args.server_cpus, "--server-cpus"),
        client_cpus=parsed_or_none(parser, parse_cpus, args.client_cpus, "--client-cpus"),
        server_mode=args.server_mode,
        server_args=list(args.server_arg),
        p99_ms=args.p99_ms,
        memory_budget=parsed_or_none(parser, parse_memory, args.memory_budget, "--memory-budget"),
        search=args.search,
        instance_counts=parsed_or_none(
            parser, parse_int_list, args.instance_counts, "--instance-counts"
        ),
        max_batch_sizes=parsed_or_none(
            parser, parse_int_list, args.max_batch_sizes, "--max-batch-sizes"
        ),
        preferred=preferred,
        queue_delays_us=parsed_or_none(
            parser, parse_delays, args.queue_delays_us, "--queue-delays-us"
        ),
        max_configs=args.max_configs,
        max_minutes=args.max_minutes,
        min_gain=args.min_gain / 100.0,
        concurrency=parsed(parser, parse_int_list, args.concurrency, "--concurrency"),
        perf_workers=args.perf_workers,
        bisect_steps=args.bisect_steps,
        confirm=args.confirm,
        output_dir=args.output_dir or Path(f"analyze-{args.model}"),
    )


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``pdserve analyze``; the exit code (see the module docstring)."""
    opts = options_from_args(args, parser)
    progress = TerminalProgress(progress_stream(args.quiet), p99_ms=opts.p99_ms)
    try:
        res = run_analyze(opts, progress)
    except AnalyzeError as e:
        print(f"pdserve analyze: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("pdserve analyze: interrupted", file=sys.stderr)
        return 1
    files = write_reports(res, opts.output_dir)
    print(summary_table(res))
    print()
    print(recommendation_text(res))
    print()
    budget = f", memory budget {format_bytes(opts.memory_budget)}" if opts.memory_budget else ""
    print(
        f"{len(res.results)} measurements in {res.elapsed_s / 60:.1f} min "
        f"(search stopped: {res.stop_reason}{budget}); report: {files['html']}"
    )
    if res.error is not None:
        return 1
    return 0 if res.recommended is not None else 1
