"""Run the V2 gRPC service: the native HTTP/2 transport (default,
:mod:`pdserve.frontends.grpc.native`), grpcio's synchronous server or ``grpc.aio``."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Protocol

import grpc

from pdserve.core.api import InferenceCore
from pdserve.frontends.grpc.codec import DEFAULT_MAX_MESSAGE_BYTES
from pdserve.frontends.grpc.engine import GRPC_SERVERS, GrpcKeepalive
from pdserve.frontends.grpc.native import serve_native
from pdserve.frontends.grpc.service import SERVICE_NAME, GrpcService, method_handlers
from pdserve.frontends.grpc.sync_bridge import Bridge, SyncServer, bridge_handlers
from pdserve.frontends.shared_memory import SharedMemoryRegistry
from pdserve.frontends.tls import ServerTls
from pdserve.frontends.traffic.gate import TrafficGate

#: Most threads of the synchronous server's unary pool (each unary call in flight
#: holds one while the event loop answers it; created as needed, so the figure is a
#: ceiling, not a cost). Calls beyond it wait for a free thread.
UNARY_THREADS = 1024
#: Most ``ModelStreamInfer`` streams open at once on the synchronous server (each
#: holds two threads, one sending and one reading, for its lifetime); a stream
#: beyond it waits for one to end.
STREAM_THREADS = 1024


class GrpcServer(Protocol):
    """What :func:`serve_grpc` returns: ``await srv.stop(grace)``."""

    async def stop(self, grace: float | None) -> object: ...


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def tls_credentials(tls: ServerTls) -> grpc.ServerCredentials:
    """grpcio's credentials for ``tls``: Triton's (the certificate and key, the root
    certificates, a verified client certificate required with mutual TLS), re-read for
    a new connection's handshake whenever ``tls`` has loaded newer files."""

    def configuration() -> grpc.ServerCertificateConfiguration:
        key, chain, root = tls.pem
        return grpc.ssl_server_certificate_configuration([(key, chain)], root)

    served = [tls.generation]

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # grpc core calls this before each handshake, on its own threads
        tls.check()
        if tls.generation == served[0]:
            return None
        served[0] = tls.generation
        return configuration()

    return grpc.dynamic_ssl_server_credentials(
        configuration(), fetch, require_client_authentication=tls.files.mutual
    )


def _bind(srv: grpc.Server | grpc.aio.Server, address: str, tls: ServerTls | None = None) -> None:
    """Listen on ``address`` (over TLS with ``tls``); RuntimeError when it cannot."""
    try:
        if tls is not None:
            bound = srv.add_secure_port(address, tls_credentials(tls))
        else:
            bound = srv.add_insecure_port(address)
    except RuntimeError:
        raise RuntimeError(f"could not listen for gRPC on {address}: address in use?") from None
    if bound == 0:
        raise RuntimeError(f"could not listen for gRPC on {address}")


async def serve_grpc(
    server: InferenceCore,
    host: str = "0.0.0.0",
    port: int = 8001,
    *,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    gate: TrafficGate | None = None,
    shared_memory: SharedMemoryRegistry | None = None,
    kind: str = "native",
    max_connections: int = 0,
    keepalive: GrpcKeepalive | None = None,
    tls: ServerTls | None = None,
) -> GrpcServer:
    """Create and start the gRPC server for ``server`` in the running event loop.

    Args:
        server: the core (:class:`~pdserve.core.api.InferenceCore`).
        host / port: where to listen.
        max_message_bytes: the largest message received or sent.
        gate: restricted APIs, auth and rate limits (same rules as HTTP); None: none.
        shared_memory: the system shared-memory registry (shared with HTTP); None: a
            disabled one.
        kind: ``"threads"``: grpcio's synchronous server, each RPC's handler run on
            this event loop (:mod:`~pdserve.frontends.grpc.sync_bridge`; less server
            CPU per call than ``grpc.aio``);
            ``"aio"``: ``grpc.aio``; ``"native"``: pdserve's own HTTP/2 transport on
            the event loop (:mod:`~pdserve.frontends.grpc.native`). Same service,
            status codes and behaviour.
        max_connections: ``native`` only: most connections open at once (0: half the
            open-file limit, as ``--http-max-connections``).
        keepalive: keepalive PINGs and ping policing (Triton's ``--grpc-keepalive-*``
            flags): grpcio's channel options for ``threads``/``aio``, done by the
            transport for ``native``; None: grpc core's defaults.
        tls: serve over TLS (Triton's ``--grpc-use-ssl`` family): the native transport
            listens with ``tls.context`` (ALPN ``h2``), grpcio with
            :func:`tls_credentials`; both take reloaded files for new connections.
            None: plaintext (h2c).

    Returns:
        The started server; ``await srv.stop(grace)`` stops it, letting in-flight
        RPCs finish for up to ``grace`` seconds.

    Raises:
        RuntimeError: the address could not be bound.
        ValueError: an unknown ``kind``.
    """
    if kind not in GRPC_SERVERS:
        raise ValueError(f"unknown gRPC server {kind!r}; expected one of {GRPC_SERVERS}")
    keepalive = keepalive or GrpcKeepalive()
    options = [
        *keepalive.channel_options(),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # A port in use must fail loudly, not be shared with another process.
        ("grpc.so_reuseport", 0),
    ]
    # the generated handlers, with request deserializers that let the servicer answer
    # bytes that are not the request message (INVALID_ARGUMENT, not UNKNOWN)
    handlers = method_handlers(GrpcService(server, max_message_bytes, gate, shared_memory))
    address = _address(host, port)
    if kind == "native":
        return await serve_native(
            handlers,
            SERVICE_NAME,
            host,
            port,
            max_message_bytes,
            max_connections,
            keepalive=keepalive,
            ssl=None if tls is None else tls.context,
        )
    if kind == "aio":
        srv = grpc.aio.server(options=options)
        srv.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),)
        )
        srv.add_registered_method_handlers(SERVICE_NAME, handlers)
        _bind(srv, address, tls)
        await srv.start()
        return srv
    pool = concurrent.futures.ThreadPoolExecutor(UNARY_THREADS, thread_name_prefix="pdserve-grpc")
    streams = concurrent.futures.ThreadPoolExecutor(
        STREAM_THREADS, thread_name_prefix="pdserve-grpc-stream"
    )
    readers = concurrent.futures.ThreadPoolExecutor(
        STREAM_THREADS, thread_name_prefix="pdserve-grpc-read"
    )
    bridge = Bridge(asyncio.get_running_loop(), streams, readers)
    handlers = bridge_handlers(handlers, bridge)
    sync = grpc.server(pool, options=options)
    sync.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    sync.add_registered_method_handlers(SERVICE_NAME, handlers)
    wrapped = SyncServer(sync, bridge, (pool, streams, readers))
    try:
        _bind(sync, address, tls)
    except RuntimeError:
        wrapped.close()
        raise
    sync.start()
    return wrapped
