"""Command line: ``pdserve serve`` (and ``python -m pdserve serve``).

Flags follow ``tritonserver``'s where they exist (``--model-repository``,
``--http-port``, ``--grpc-port``, ``--metrics-port``, ``--strict-readiness``,
``--exit-timeout-secs``, ``--log-verbose``), with ``--host`` defaulting to
127.0.0.1 (Triton binds 0.0.0.0; pdserve listens on loopback unless told).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve import __version__

log = logging.getLogger("pdserve")

#: The example repository that ``examples/build.py`` builds.
EXAMPLE_REPOSITORY = Path(__file__).resolve().parents[1] / "examples" / "model_repository"

#: Extra ``serve`` flags and start-up hooks that other modules register
#: (gRPC, metrics, model control): ``(add_arguments, start)`` where
#: ``start(args, server) -> awaitable stop()``.
SERVE_EXTENSIONS: list[tuple[Callable[[argparse.ArgumentParser], None], Any]] = []


def register_serve_extension(
    add_arguments: Callable[[argparse.ArgumentParser], None], start: Any
) -> None:
    """Add ``(add_arguments, start)`` to :data:`SERVE_EXTENSIONS` unless it is there
    already (the extension modules call this when imported)."""
    entry = (add_arguments, start)
    if entry not in SERVE_EXTENSIONS:
        SERVE_EXTENSIONS.append(entry)


#: Extra subcommands other modules register: ``add(subparsers)`` adds a parser whose
#: defaults set ``run(args) -> exit code`` (e.g. ``pdserve rollback``).
COMMANDS: list[Callable[[Any], None]] = []


class HostPolicyAction(argparse.Action):
    """``--host-policy NAME,SETTING=VALUE`` (repeatable): collect and check host policies.

    The namespace attribute holds ``policy name -> {setting: value}``; options with
    the same name merge (a later value of a setting wins), as in Triton. Each
    option is checked as soon as it is read (its syntax, the setting, and the cores
    of the merged policy: see :func:`pdserve.backends.host_policy.resolve_policy`), so a bad
    one is an argparse error (exit code 2) naming the option.
    """

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        from pdserve.backends.host_policy import HostPolicyError, parse_option, resolve_policy

        policies: dict[str, dict[str, str]] = dict(getattr(namespace, self.dest, None) or {})
        try:
            name, setting, value = parse_option(str(values))
            settings = {**policies.get(name, {}), setting: value}
            resolve_policy(name, settings)
        except HostPolicyError as e:
            raise argparse.ArgumentError(self, str(e)) from None
        policies[name] = settings
        setattr(namespace, self.dest, policies)


def host_policies(args: argparse.Namespace) -> dict[str, frozenset[int]]:
    """The ``--host-policy`` options of ``args`` as ``policy name -> CPU ids``.

    Raises:
        pdserve.backends.host_policy.HostPolicyError: a core left the process's affinity
            mask since the options were read.
    """
    from pdserve.backends.host_policy import resolve_policy

    raw = getattr(args, "host_policy", None) or {}
    return {name: resolve_policy(name, settings) for name, settings in raw.items()}


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve`` argument parser."""
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Serve a Triton-layout model repository over the KServe V2 protocol.",
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve a model repository",
        description="Serve a Triton-layout model repository over the KServe V2 protocol "
        "(HTTP; gRPC and metrics when available).",
    )
    serve.add_argument(
        "--model-repository",
        type=Path,
        default=None,
        help="model repository folder (default: the example repository built by examples/build.py)",
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    serve.add_argument("--http-port", type=int, default=8000, help="V2 HTTP port (default 8000)")
    serve.add_argument("--grpc-port", type=int, default=8001, help="V2 gRPC port (default 8001)")
    serve.add_argument(
        "--metrics-port", type=int, default=8002, help="Prometheus metrics port (default 8002)"
    )
    serve.add_argument(
        "--log-verbose", type=int, default=0, help="verbose logging level: 0 (info) or 1+ (debug)"
    )
    serve.add_argument(
        "--exit-timeout-secs",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds to wait for in-flight requests (default 30)",
    )
    serve.add_argument(
        "--strict-readiness",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="report not-ready while any model meant to be loaded is not ready",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=64 * 1024 * 1024,
        help="largest HTTP request body accepted, after decompression (default 64 MiB)",
    )
    serve.add_argument(
        "--http-body-timeout-secs",
        type=float,
        default=60.0,
        help="longest wait for the next piece of an HTTP request body before answering 408 "
        "and closing the connection; 0 waits forever (default 60)",
    )
    serve.add_argument(
        "--host-policy",
        action=HostPolicyAction,
        default=None,
        metavar="NAME,SETTING=VALUE",
        help="host policy, as in tritonserver (repeatable): SETTING is cpu-cores (e.g. "
        "cpu-cores=0-3,5) or numa-node (e.g. numa-node=0: that node's CPUs; memory is not "
        "bound to the node, Python cannot); both settings: their intersection. Instances "
        "of a group whose host_policy is NAME run pinned to those cores; a group without "
        "host_policy uses 'cpu' (KIND_CPU), 'gpu_<id>' (KIND_GPU) or 'model' (KIND_MODEL), "
        "so --host-policy cpu,cpu-cores=0 pins every CPU instance. A group naming a policy "
        "not given fails to load",
    )
    for add_arguments, _ in SERVE_EXTENSIONS:
        add_arguments(serve)
    for add_command in COMMANDS:
        add_command(sub)
    return parser


def _setup_logging(verbose: int) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose > 0 else logging.INFO,
        format="%(asctime)s %(levelname).1s %(name)s: %(message)s",
        stream=sys.stderr,
    )


async def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM/SIGINT; return the process exit code.

    Order of events: HTTP starts (live, not ready) -> models load -> ready.
    On a signal: readiness goes false and new requests get 503, in-flight
    requests finish (at most ``--exit-timeout-secs``), models unload (workers
    stop), listeners close, exit 0.
    """
    from pdserve.frontends.http.app import create_http_app
    from pdserve.frontends.http.server import serve_http
    from pdserve.server import InferenceServer

    repo = args.model_repository or EXAMPLE_REPOSITORY
    if not repo.is_dir():
        log.error(
            "model repository %s does not exist%s",
            repo,
            " (build it with `python examples/build.py`)" if args.model_repository is None else "",
        )
        return 2
    from pdserve.backends.host_policy import HostPolicyError, format_cpu_list

    try:
        policies = host_policies(args)
    except HostPolicyError as e:
        log.error("--host-policy: %s", e)
        return 2
    for name, cores in sorted(policies.items()):
        log.info("host policy %s: cpu-cores %s", name, format_cpu_list(cores))
    server = InferenceServer(
        repo,
        strict_readiness=args.strict_readiness,
        load_models=getattr(args, "load_models", None),
        host_policies=policies,
    )
    stop_event = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_event.set)

    app = create_http_app(
        server,
        max_request_bytes=args.max_request_bytes,
        body_timeout=args.http_body_timeout_secs,
    )
    http = serve_http(app, args.host, args.http_port)
    http_task = asyncio.create_task(http.serve())
    stoppers = []
    for _, start in SERVE_EXTENSIONS:
        if start is not None:
            stopper = await start(args, server)
            if stopper is not None:
                stoppers.append(stopper)
    log.info("HTTP (KServe V2) listening on http://%s:%d", args.host, args.http_port)
    await server.start()
    rows = server.repository_index()
    ready = [r for r in rows if r.get("state") == "READY"]
    failed = [r for r in rows if r.get("state") not in (None, "READY")]
    not_loaded = sorted({r["name"] for r in rows if r.get("state") is None})
    log.info(
        "model repository %s: %d version%s ready, %d failed%s",
        repo,
        len(ready),
        "" if len(ready) == 1 else "s",
        len(failed),
        f", {len(not_loaded)} model(s) not loaded (explicit mode)" if not_loaded else "",
    )
    for r in failed:
        log.warning(
            "  %s version %s %s: %s",
            r["name"],
            r.get("version", "-"),
            r.get("state"),
            r.get("reason", ""),
        )
    waiter = asyncio.create_task(stop_event.wait())
    await asyncio.wait([waiter, http_task], return_when=asyncio.FIRST_COMPLETED)
    if http_task.done() and not stop_event.is_set():
        exc = http_task.exception() if not http_task.cancelled() else None
        log.error("HTTP server stopped: %s", exc)
        await server.stop(0)
        return 1
    log.info("shutting down: finishing in-flight requests (timeout %.0fs)", args.exit_timeout_secs)
    await server.stop(args.exit_timeout_secs)
    for stopper in stoppers:
        with contextlib.suppress(Exception):
            await stopper()
    http.should_exit = True
    with contextlib.suppress(Exception):
        await asyncio.wait_for(http_task, 5)
    log.info("pdserve stopped")
    return 0


def _load_extensions() -> None:
    """Import optional modules that register ``serve`` extensions."""
    import importlib

    for name in (
        "pdserve.frontends.grpc.server",
        "pdserve.observability.metrics",
        "pdserve.cache",
        "pdserve.repository.control",
    ):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``pdserve`` console script."""
    _load_extensions()
    args = build_parser().parse_args(argv)
    _setup_logging(getattr(args, "log_verbose", 0))
    run = getattr(args, "run", None)
    if run is not None:
        return run(args)
    if args.command == "serve":
        try:
            import uvloop

            return uvloop.run(serve(args))
        except ImportError:  # pragma: no cover - uvloop is a dependency
            return asyncio.run(serve(args))
    return 2
