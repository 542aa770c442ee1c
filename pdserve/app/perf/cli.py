"""``pdserve perf``: the subcommand's flags (perf_analyzer's names where it has
one) and its run: live progress on stderr, the summary table on stdout, CSV /
JSON / PNG files written even when the run stops early.

Exit codes: 0 every level measured without a failed request (a level that did not
stabilize within ``--max-trials`` is reported and flagged, as a warning); 1 the
run could not start (server down, model unknown, request rejected...) or
requests failed, a level was aborted, or the run was interrupted; 2 bad flags.
"""

from __future__ import annotations

import argparse
import sys
from typing import TypedDict

from pdserve.app.perf.options import (
    PerfError,
    PerfOptions,
    parse_concurrency_range,
    parse_rate_range,
    parse_shape,
)
from pdserve.app.perf.report import (
    TerminalProgress,
    summary_table,
    write_csv,
    write_json,
    write_plot,
)
from pdserve.app.perf.runner import run_sweep
from pdserve.app.perf.stats import PointResult
from pdserve.app.subcommands import (
    Subparsers,
    add_subcommand,
    parsed,
    parsed_or_none,
    progress_stream,
)

EPILOG = """\
examples:
  pdserve perf -m tiny --concurrency-range 1:16:4
  pdserve perf -m tiny -i grpc -u localhost:8001 -b 8 --concurrency-range 4
  pdserve perf -m tiny --request-rate-range 100:1000:300 --request-distribution poisson
  pdserve perf -m text_embedding --input-data sentences.json \\
      -f out.csv --json out.json --plot out.png

A level is measured in windows of --measurement-interval ms until the last 3 agree
within --stability-percentage on throughput and latency (the mean, or
--percentile), at most --max-trials windows. Latencies are client-side, from
writing a request to the end of its answer; the server-side breakdown (queue,
compute input/infer/output) is the statistics extension's delta over the same
windows.
"""


class LoadFields(TypedDict):
    """What the flags of :func:`add_request_flags` and :func:`add_window_flags` set:
    fields of :class:`PerfOptions` and of ``pdserve analyze``'s options alike."""

    batch_size: int
    input_data: str
    shapes: dict[str, list[int]]
    measurement_interval_ms: int
    stability_percentage: float
    max_trials: int


def load_fields(args: argparse.Namespace, parser: argparse.ArgumentParser) -> LoadFields:
    """The values of the :func:`add_request_flags` and :func:`add_window_flags` flags
    (``--shape NAME:D1,D2``: input name -> dims; a bad one exits 2 via ``parser.error``)."""
    shapes = {}
    for text in args.shape:
        name, dims = parsed(parser, parse_shape, text, "--shape")
        shapes[name] = dims
    return LoadFields(
        batch_size=args.batch_size,
        input_data=args.input_data,
        shapes=shapes,
        measurement_interval_ms=args.measurement_interval,
        stability_percentage=args.stability_percentage,
        max_trials=args.max_trials,
    )


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """Add ``pdserve perf`` to the CLI's subcommands; its defaults set ``run``."""
    return add_subcommand(
        sub,
        "perf",
        help="load-test a model on any KServe V2 server (perf_analyzer's role)",
        description="Measure throughput and latency of MODEL on a running KServe V2 server\n"
        "(pdserve, Triton, KServe, MLServer) over HTTP or gRPC, level by level, with the\n"
        "server-side breakdown from the statistics extension. Flags follow Triton's\n"
        "perf_analyzer.",
        epilog=EPILOG,
        flags=(
            _add_target_flags,
            _add_load_flags,
            _add_input_flags,
            _add_measurement_flags,
            _add_output_flags,
        ),
        run=run,
    )


def _add_target_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("-m", dest="model", required=True, metavar="MODEL", help="model name")
    g.add_argument("-x", dest="model_version", default="", metavar="VERSION", help="model version")
    g.add_argument(
        "-u",
        dest="url",
        default=None,
        metavar="URL",
        help="server address host:port (default localhost:8000 for HTTP, localhost:8001 for gRPC)",
    )
    g.add_argument(
        "-i",
        dest="protocol",
        choices=("http", "grpc"),
        default="http",
        help="protocol (default http)",
    )


def _add_load_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("load")
    g.add_argument(
        "--concurrency-range",
        metavar="START[:END[:STEP]]",
        help="requests in flight, closed loop (default 1); STEP is added: 1:64:2 is 1,3,...,63",
    )
    g.add_argument(
        "--request-rate-range",
        metavar="START[:END[:STEP]]",
        help="requests per second, open loop (instead of --concurrency-range)",
    )
    g.add_argument(
        "--request-distribution",
        choices=("constant", "poisson"),
        default="constant",
        help="arrivals in request-rate mode (default constant)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=256,
        help="request-rate mode: most requests in flight; one finding none free waits and "
        "counts as delayed (default 256)",
    )
    g.add_argument(
        "--workers",
        type=int,
        default=0,
        help="load-generating processes (default 0: one per request in flight, at most 4 "
        "per CPU this process may use and 8 in all)",
    )


def _add_input_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("input data")
    add_request_flags(g, "random (default), zero, or a perf_analyzer input-data JSON file")
    g.add_argument(
        "--string-length", type=int, default=128, help="length of random BYTES elements (128)"
    )
    for side, what in (
        ("input", "inputs as the binary tensor extension (default) or JSON"),
        ("output", "ask for outputs as binary (default) or JSON"),
    ):
        g.add_argument(
            f"--{side}-tensor-format",
            choices=("binary", "json"),
            default="binary",
            help=f"HTTP: {what}",
        )


def _add_measurement_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("measurement")
    add_window_flags(
        g,
        (5000, 10.0, 10),
        (
            "window length in milliseconds (default 5000)",
            "how far (%%) the last 3 windows may differ (default 10)",
            "most windows per level (default 10)",
        ),
    )
    g.add_argument(
        "--percentile",
        type=int,
        default=None,
        help="stabilize on (and report) this latency percentile instead of the mean",
    )
    g.add_argument(
        "-l",
        "--latency-threshold",
        dest="latency_threshold",
        type=float,
        default=None,
        metavar="MS",
        help="stop the sweep once the latency reaches this many milliseconds",
    )
    g.add_argument(
        "--request-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="a request unanswered this long fails as 'timeout' (default 30)",
    )
    g.add_argument(
        "--connect-timeout",
        type=float,
        default=5.0,
        metavar="S",
        help="connecting and control requests give up after this (default 5)",
    )
    g.add_argument(
        "--no-server-stats",
        action="store_true",
        help="do not read the statistics extension",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of random data and Poisson arrivals")
    g.add_argument(
        "--grpc-client",
        choices=("raw", "grpcio"),
        default="raw",
        help="gRPC load client: raw HTTP/2 frames (default, lean) or grpcio's grpc.aio",
    )


def add_request_flags(g: argparse._ArgumentGroup, input_data_help: str) -> None:
    """``-b`` / ``--input-data`` / ``--shape``: what each request holds (``pdserve
    analyze`` passes them on to perf)."""
    g.add_argument("-b", dest="batch_size", type=int, default=1, help="batch size (default 1)")
    g.add_argument(
        "--input-data", default="random", metavar="random|zero|FILE.json", help=input_data_help
    )
    g.add_argument(
        "--shape",
        action="append",
        default=[],
        metavar="NAME:D1,D2",
        help="shape of an input with variable dims, without the batch dim (repeatable)",
    )


def add_window_flags(
    g: argparse._ArgumentGroup, defaults: tuple[int, float, int], helps: tuple[str, str, str]
) -> None:
    """``-p`` / ``-s`` / ``-r``: the measurement window (length in ms, stability
    percentage, most windows per level), with these defaults and help texts;
    ``pdserve analyze`` passes them on to perf."""
    interval, stability, trials = defaults
    g.add_argument(
        "-p",
        "--measurement-interval",
        dest="measurement_interval",
        type=int,
        default=interval,
        metavar="MS",
        help=helps[0],
    )
    g.add_argument(
        "-s",
        "--stability-percentage",
        dest="stability_percentage",
        type=float,
        default=stability,
        help=helps[1],
    )
    g.add_argument("-r", "--max-trials", dest="max_trials", type=int, default=trials, help=helps[2])


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("-f", dest="csv", metavar="FILE.csv", help="write results as CSV")
    g.add_argument("--json", metavar="FILE.json", help="write results as JSON")
    g.add_argument("--plot", metavar="FILE.png", help="plot latency against throughput (PNG)")
    g.add_argument("-q", "--quiet", action="store_true", help="no live progress")


def options_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> PerfOptions:
    """Turn parsed flags into :class:`PerfOptions` (exits 2 via ``parser.error`` on a
    bad range, shape or combination)."""
    if args.concurrency_range and args.request_rate_range:
        parser.error("give --concurrency-range or --request-rate-range, not both")
    opts = PerfOptions(
        **load_fields(args, parser),
        model=args.model,
        url=args.url,
        protocol=args.protocol,
        model_version=args.model_version,
        concurrency=parsed_or_none(
            parser, parse_concurrency_range, args.concurrency_range, "--concurrency-range"
        ),
        request_rates=parsed_or_none(
            parser, parse_rate_range, args.request_rate_range, "--request-rate-range"
        ),
        distribution=args.request_distribution,
        string_length=args.string_length,
        input_format=args.input_tensor_format,
        output_format=args.output_tensor_format,
        percentile=args.percentile,
        latency_threshold_ms=args.latency_threshold,
        workers=args.workers,
        max_connections=args.max_connections,
        request_timeout_s=args.request_timeout,
        connect_timeout_s=args.connect_timeout,
        server_stats=not args.no_server_stats,
        seed=args.seed,
        grpc_client=args.grpc_client,
    )
    try:
        opts.validate()
    except PerfError as e:
        parser.error(str(e))
    return opts


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``pdserve perf``; the process exit code (see the module docstring)."""
    opts = options_from_args(args, parser)
    progress = TerminalProgress(progress_stream(args.quiet))
    progress.max_trials = opts.max_trials
    results: list[PointResult] = []
    error: str | None = None
    try:
        results = run_sweep(opts, progress)
    except PerfError as e:
        error = str(e)
    except KeyboardInterrupt:
        error = "interrupted"
    if results:
        print(summary_table(results))
    server_stats = bool(progress.info.get("server_stats"))
    try:
        if args.csv:
            write_csv(args.csv, results, server_stats)
        if args.json:
            write_json(args.json, opts, results, progress.info, error)
        if args.plot and results:
            title = f"{opts.model} ({opts.protocol.upper()}, batch {opts.batch_size})"
            write_plot(args.plot, results, title)
    except PerfError as e:
        print(f"pdserve perf: {e}", file=sys.stderr)
        return 1
    if error is not None:
        print(f"pdserve perf: {error}", file=sys.stderr)
        return 1
    failed = [p for p in results if p.aborted or p.error_count]
    if failed:
        return 1
    return 0
