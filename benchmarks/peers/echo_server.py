"""A bare loopback HTTP echo: raw ASGI on uvicorn (uvloop + httptools).

The floor for moving bytes through a Python HTTP server: it returns the request
body unchanged. ``python echo_server.py PORT``.
"""

from __future__ import annotations

import sys

import uvicorn


async def app(scope, receive, send):  # noqa: ANN001, ANN201
    """Echo the body of every request (``GET`` gets an empty 200)."""
    if scope["type"] != "http":
        return
    parts = []
    more = True
    while more:
        message = await receive()
        parts.append(message.get("body", b""))
        more = message.get("more_body", False)
    body = b"".join(parts)
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/octet-stream"),
                (b"content-length", b"%d" % len(body)),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


if __name__ == "__main__":
    uvicorn.run(
        app,
        host="127.0.0.1",
        port=int(sys.argv[1]),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )
