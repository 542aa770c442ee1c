"""Run the V2 REST ASGI application on uvicorn (uvloop + httptools)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import uvicorn


def serve_http(
    app: Callable[..., Awaitable[None]],
    host: str = "0.0.0.0",
    port: int = 8000,
    *,
    install_signal_handlers: bool = False,
    log_level: str = "warning",
    **uvicorn_options: Any,
) -> uvicorn.Server:
    """Build (not start) a uvicorn server for ``app`` on uvloop + httptools.

    Run it inside the caller's asyncio loop with ``await server.serve()``; set
    ``server.should_exit = True`` for a graceful shutdown (stop accepting, finish
    in-flight requests), ``server.force_exit = True`` to stop at once.

    Args:
        app: the ASGI application (from :func:`create_http_app`).
        host / port: where to listen (port 0 picks a free port; read it back from
            ``server.servers[0].sockets`` once ``server.started`` is true).
        install_signal_handlers: uvicorn's ``serve()`` takes over SIGINT/SIGTERM and
            re-raises them when it returns. The default ``False`` leaves signals to the
            caller (the CLI shuts down HTTP, gRPC and workers together).
        log_level: uvicorn's own log level.
        **uvicorn_options: passed to ``uvicorn.Config`` (``timeout_keep_alive``,
            ``backlog``, ``ssl_certfile``, ``limit_concurrency``...).

    Returns:
        The ``uvicorn.Server``.
    """
    options: dict[str, Any] = {
        "loop": "uvloop",
        "http": "httptools",
        "lifespan": "off",
        "access_log": False,
        "log_level": log_level,
        "server_header": False,
        "date_header": False,
    }
    options.update(uvicorn_options)
    config = uvicorn.Config(app, host=host, port=port, **options)
    if install_signal_handlers:
        return uvicorn.Server(config)
    return QuietServer(config)


class QuietServer(uvicorn.Server):
    """A ``uvicorn.Server`` that leaves SIGINT/SIGTERM to its owner."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
