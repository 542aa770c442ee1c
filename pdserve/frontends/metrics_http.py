"""The Prometheus scrape listener: ``GET /metrics`` on ``--metrics-port`` (Triton: 8002).

A tiny HTTP/1.1 server on the main asyncio loop (no framework, one request per
connection, ``Connection: close``), so a scrape reads the server's numbers on the
same thread that changes them and sees a consistent picture. What it serves is
rendered by a callable (:meth:`pdserve.observability.metrics.MetricsExporter.render`
when the app starts it); this module knows nothing about metrics.

- ``GET /metrics`` / ``HEAD /metrics`` (a query string is ignored): 200 with the
  rendered body (HEAD: headers only) and the given content type.
- Any other path or method: 404 ``text/plain`` naming ``/metrics``.
- A client that sends no complete request head within 10 s is disconnected; a
  failure while rendering is logged and the connection closed, never the server.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from ssl import SSLContext

log = logging.getLogger("pdserve.metrics")

#: Seconds a client has to send its request head.
HEAD_TIMEOUT_SECS = 10.0


async def _handle(
    render: Callable[[], bytes],
    content_type: str,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
) -> None:
    """Serve ``GET /metrics`` (and HEAD) on one connection, then close it."""
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_TIMEOUT_SECS)
        line = head.split(b"\r\n", 1)[0].decode("latin-1")
        method, _, rest = line.partition(" ")
        path = rest.split(" ", 1)[0].split("?", 1)[0]
        if path == "/metrics" and method in ("GET", "HEAD"):
            body = render()
            status = "200 OK"
            ctype = content_type
        else:
            body = b"not found: metrics are served at /metrics\n"
            status = "404 Not Found"
            ctype = "text/plain; charset=utf-8"
        writer.write(
            f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        if method != "HEAD":
            writer.write(body)
        await writer.drain()
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
        pass
    except Exception:  # noqa: BLE001 - a scrape never takes the server down
        log.exception("metrics request failed")
    finally:
        writer.close()


async def serve_metrics(
    render: Callable[[], bytes],
    host: str,
    port: int,
    *,
    content_type: str,
    ssl: SSLContext | None = None,
) -> asyncio.Server:
    """Start the ``/metrics`` listener on the running loop.

    Args:
        render: returns the whole response body for one scrape (called on the loop).
        host / port: where to listen.
        content_type: the ``Content-Type`` of a 200 answer (Prometheus text format:
            :data:`pdserve.observability.metrics.CONTENT_TYPE`).
        ssl: serve HTTPS with this server context
            (:attr:`pdserve.frontends.tls.ServerTls.context`); None: plain HTTP.

    Returns:
        The listening ``asyncio.Server``; ``close()`` then ``await wait_closed()`` stops it.

    Raises:
        OSError: the port cannot be bound.
    """
    return await asyncio.start_server(
        lambda r, w: _handle(render, content_type, r, w), host, port, ssl=ssl
    )
