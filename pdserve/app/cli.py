"""Command line: ``pdserve SUBCOMMAND`` (and ``python -m pdserve SUBCOMMAND``).

The subcommands, listed here and nowhere else (:func:`build_parser`): ``serve`` (a
model repository; every flag is a field of :class:`~pdserve.app.settings.Settings`),
``rollback`` (pin a model to an earlier version on a running server), ``check`` (lint
a repository for CI), ``perf`` (load-test a model, perf_analyzer's role), ``analyze``
(search instance counts and batching under a latency SLO, model_analyzer's role) and
``top`` (live per-model figures of a running server) and ``ray`` (deploy a repository
onto a Ray cluster). The ``tritonserver`` script
(and ``pdserve tritonserver``) is ``serve`` with tritonserver's defaults.

No parser takes an abbreviated flag. A flag with a bad value, or flags that do not
go together, end the process with an argparse error (exit code 2) naming the flag.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import cast

# first: grpc reads GRPC_EXPERIMENTS once, when it is imported (engine's docstring)
from pdserve.frontends.grpc import engine  # noqa: F401

# isort: split
from pdserve import __version__
from pdserve.app import check, ray_cmd, rollback, top
from pdserve.app.analyze import cli as analyze_cli
from pdserve.app.flag_syntax import ServeHelpFormatter, StrictArgumentParser
from pdserve.app.logging_setup import setup_logging, setup_serve_logging
from pdserve.app.perf import cli as perf_cli
from pdserve.app.settings import (
    TRITONSERVER_DEFAULTS,
    Settings,
    SettingsError,
    add_arguments,
)

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
    serve.set_defaults(run=lambda args: _run_serve(serve, args))


def _run_serve(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    defaults: dict[str, object] | None = None,
) -> int:
    """Serve with the parsed flags (``defaults``: the program's own); a bad value
    exits 2 through ``parser.error``."""
    try:
        settings = Settings.from_namespace(args, defaults)
    except SettingsError as e:
        parser.error(str(e))  # exits 2
    try:
        setup_serve_logging(settings)
    except OSError as e:
        parser.error(f"argument --log-file: cannot open {settings.log_file}: {e.strerror or e}")
    from pdserve.app.main import run as run_server

    return run_server(settings)


def build_tritonserver_parser() -> argparse.ArgumentParser:
    """The ``tritonserver`` program's parser: ``pdserve serve``'s flags with
    tritonserver's defaults in the help."""
    parser = StrictArgumentParser(
        prog="tritonserver",
        usage="%(prog)s [options]",
        description="pdserve with tritonserver's command line and defaults: serve a "
        "Triton-layout model repository over the KServe V2 protocol (HTTP, gRPC, "
        "Prometheus metrics).",
        formatter_class=ServeHelpFormatter,
    )
    add_arguments(parser, TRITONSERVER_DEFAULTS)
    return parser


def tritonserver_main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tritonserver`` console script; returns the exit code.

    tritonserver's defaults (:data:`TRITONSERVER_DEFAULTS`) and, as in Triton,
    ``--model-repository`` (or ``--model-store``) must be given.

    Raises:
        SystemExit(2): bad arguments or no repository; SystemExit(0) for ``--help``.
    """
    parser = build_tritonserver_parser()
    args = parser.parse_args(argv)
    if getattr(args, "model_repository", None) is None:
        parser.error("--model-repository must be specified")  # exits 2
    return _run_serve(parser, args, TRITONSERVER_DEFAULTS)


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve`` argument parser; each subcommand's defaults set ``run``
    (``run(args) -> exit code``)."""
    parser = StrictArgumentParser(
        prog="pdserve",
        description="Serve a Triton-layout model repository over the KServe V2 protocol.",
        epilog="`pdserve tritonserver [FLAGS]` (and the `tritonserver` console script) "
        "run serve with tritonserver's command line and defaults.",
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    # subparsers of the parser's class: none takes an abbreviated flag
    sub = cast(
        "argparse._SubParsersAction[argparse.ArgumentParser]",
        parser.add_subparsers(dest="command", required=True),
    )
    _add_serve(sub)
    rollback.add_parser(sub)
    check.add_parser(sub)
    perf_cli.add_parser(sub)
    analyze_cli.add_parser(sub)
    top.add_parser(sub)
    ray_cmd.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pdserve`` console script; returns the process exit code.

    ``pdserve tritonserver FLAGS`` is :func:`tritonserver_main` (so an image whose
    entry point is ``pdserve`` runs KServe's ``args: [tritonserver, ...]``).

    Raises:
        SystemExit(2): bad arguments (argparse's message names the flag);
            SystemExit(0) for ``--help`` / ``--version``.
    """
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tritonserver"]:
        return tritonserver_main(argv[1:])
    args = build_parser().parse_args(argv)
    command: Command = args.run
    if args.command != "serve":
        setup_logging(0)
    return command(args)
