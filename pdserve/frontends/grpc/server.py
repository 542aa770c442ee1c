"""Run the V2 gRPC service on ``grpc.aio``."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from tritonclient.grpc import service_pb2_grpc

from pdserve.core.api import InferenceCore
from pdserve.frontends.grpc.codec import DEFAULT_MAX_MESSAGE_BYTES
from pdserve.frontends.grpc.service import GrpcService

log = logging.getLogger("pdserve.grpc")


async def serve_grpc(
    server: InferenceCore,
    host: str = "0.0.0.0",
    port: int = 8001,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
) -> grpc.aio.Server:
    """Create and start the gRPC server for ``server`` in the running event loop.

    Args:
        server: the core (:class:`~pdserve.core.api.InferenceCore`).
        host / port: where to listen.
        max_message_bytes: the largest message received or sent.

    Returns:
        The started ``grpc.aio.Server``; ``await srv.stop(grace)`` stops it, letting
        in-flight RPCs finish for up to ``grace`` seconds.

    Raises:
        RuntimeError: the address could not be bound.
    """
    options = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # A port in use must fail loudly, not be shared with another process.
        ("grpc.so_reuseport", 0),
    ]
    srv = grpc.aio.server(options=options)
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(GrpcService(server), srv)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = srv.add_insecure_port(address)
    except RuntimeError:
        raise RuntimeError(f"could not listen for gRPC on {address}: address in use?") from None
    if bound == 0:
        raise RuntimeError(f"could not listen for gRPC on {address}")
    await srv.start()
    return srv


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``serve`` flags of the gRPC frontend (``--grpc-port`` is the CLI's own)."""
    parser.add_argument(
        "--grpc-max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="largest gRPC message received or sent, in bytes (default 64 MiB; "
        "Triton uses 2147483647)",
    )
    parser.add_argument(
        "--allow-grpc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="serve the V2 gRPC protocol on --grpc-port (default on)",
    )


async def start(args: argparse.Namespace, server: Any) -> Callable[[], Awaitable[None]] | None:
    """CLI hook: start gRPC on ``--host``:``--grpc-port``; return its stopper.

    Raises:
        SystemExit(1): the port cannot be bound (logged).
    """
    if not getattr(args, "allow_grpc", True):
        return None
    try:
        srv = await serve_grpc(
            server,
            args.host,
            args.grpc_port,
            max_message_bytes=getattr(args, "grpc_max_message_bytes", DEFAULT_MAX_MESSAGE_BYTES),
        )
    except RuntimeError as e:
        log.error("%s", e)
        raise SystemExit(1) from None
    log.info("gRPC (KServe V2) listening on %s:%d", args.host, args.grpc_port)

    async def stop() -> None:
        await srv.stop(5)

    return stop


def _register() -> None:
    from pdserve import cli

    cli.register_serve_extension(add_arguments, start)


_register()
