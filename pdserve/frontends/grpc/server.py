"""Run the V2 gRPC service on ``grpc.aio``."""

from __future__ import annotations

import grpc

from pdserve.core.api import InferenceCore
from pdserve.frontends.grpc.codec import DEFAULT_MAX_MESSAGE_BYTES
from pdserve.frontends.grpc.service import SERVICE_NAME, GrpcService, method_handlers
from pdserve.frontends.shared_memory import SharedMemoryRegistry
from pdserve.frontends.traffic.gate import TrafficGate


async def serve_grpc(
    server: InferenceCore,
    host: str = "0.0.0.0",
    port: int = 8001,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    gate: TrafficGate | None = None,
    shared_memory: SharedMemoryRegistry | None = None,
) -> grpc.aio.Server:
    """Create and start the gRPC server for ``server`` in the running event loop.

    Args:
        server: the core (:class:`~pdserve.core.api.InferenceCore`).
        host / port: where to listen.
        max_message_bytes: the largest message received or sent.
        gate: restricted APIs, auth and rate limits (same rules as HTTP); None: none.
        shared_memory: the system shared-memory registry (shared with HTTP); None: a
            disabled one.

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
    # the generated handlers, with request deserializers that let the servicer answer
    # bytes that are not the request message (INVALID_ARGUMENT, not UNKNOWN)
    handlers = method_handlers(GrpcService(server, max_message_bytes, gate, shared_memory))
    srv.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    srv.add_registered_method_handlers(SERVICE_NAME, handlers)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = srv.add_insecure_port(address)
    except RuntimeError:
        raise RuntimeError(f"could not listen for gRPC on {address}: address in use?") from None
    if bound == 0:
        raise RuntimeError(f"could not listen for gRPC on {address}")
    await srv.start()
    return srv
