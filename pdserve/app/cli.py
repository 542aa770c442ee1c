"""Command line: ``pdserve SUBCOMMAND`` (and ``python -m pdserve SUBCOMMAND``).

The subcommands, listed here and nowhere else (:func:`build_parser`): ``serve`` (a
model repository; every flag is a field of :class:`~pdserve.app.settings.Settings`),
``rollback`` (pin a model to an earlier version on a running server), ``check`` (lint
a repository for CI), ``perf`` (load-test a model, perf_analyzer's role), ``analyze``
(search instance counts and batching under a latency SLO, model_analyzer's role) and
``top`` (live per-model figures of a running server).

A flag with a bad value, or flags that do not go together, end the process with
an argparse error (exit code 2) naming the flag, before anything starts.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

# first: grpc reads GRPC_EXPERIMENTS once, when it is imported (engine's docstring)
from pdserve.frontends.grpc import engine  # noqa: F401

# isort: split
from pdserve import __version__
from pdserve.app import check, rollback, top
from pdserve.app.analyze import cli as analyze_cli
from pdserve.app.flag_syntax import ServeHelpFormatter
from pdserve.app.logging_setup import setup_logging, setup_serve_logging
from pdserve.app.perf import cli as perf_cli
from pdserve.app.settings import Settings, SettingsError, add_arguments

Command = Callable[[argparse.Namespace], int]


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    serve = sub.add_parser(
        "serve",
        help="serve a model repository",
        description="Serve a Triton-layout model repository over the KServe V2 protocol "
        "(HTTP, gRPC, Prometheus metrics).",
        formatter_class=ServeHelpFormatter,
    )
    add_arguments(serve)

    def run(args: argparse.Namespace) -> int:
        try:
            settings = Settings.from_namespace(args)
        except SettingsError as e:
            serve.error(str(e))  # exits 2
        setup_serve_logging(settings)
        from pdserve.app.main import run as run_server

        return run_server(settings)

    serve.set_defaults(run=run)


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve`` argument parser; each subcommand's defaults set ``run``
    (``run(args) -> exit code``)."""
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Serve a Triton-layout model repository over the KServe V2 protocol.",
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    rollback.add_parser(sub)
    check.add_parser(sub)
    perf_cli.add_parser(sub)
    analyze_cli.add_parser(sub)
    top.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pdserve`` console script; returns the process exit code.

    Raises:
        SystemExit(2): bad arguments (argparse's message names the flag);
            SystemExit(0) for ``--help`` / ``--version``.
    """
    args = build_parser().parse_args(argv)
    command: Command = args.run
    if args.command != "serve":
        setup_logging(0)
    return command(args)
