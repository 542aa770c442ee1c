"""Unit tests: closing listeners without failing a request (pdserve.app.listeners),
on real loopback sockets."""

from __future__ import annotations

import asyncio
import socket
import time
from typing import Any

import pytest

from pdserve.app import listeners


def _listener() -> tuple[socket.socket, int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    return srv, srv.getsockname()[1]


def test_refused_syns_queued_connections_kept() -> None:
    srv, port = _listener()
    with srv:
        queued = socket.create_connection(("127.0.0.1", port))
        queued.sendall(b"request")
        assert listeners.accept_queue_length(srv) == 1
        assert listeners.refuse_new_connections(srv)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):  # the SYN is dropped: no answer at all
            socket.create_connection(("127.0.0.1", port), timeout=0.3)
        assert time.monotonic() - t0 >= 0.3
        conn, _ = srv.accept()  # the queued connection still works
        with conn, queued:
            assert conn.recv(16) == b"request"
            conn.sendall(b"answer")
            assert queued.recv(16) == b"answer"
        assert listeners.accept_queue_length(srv) == 0
    with pytest.raises(ConnectionRefusedError):  # closed: refused, not reset
        socket.create_connection(("127.0.0.1", port), timeout=1)


def test_drain_accept_queues_waits_for_the_server_to_accept() -> None:
    async def main() -> list[bytes]:
        got: list[bytes] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            got.append(await reader.read(16))
            writer.close()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
        for c in clients:
            c.sendall(b"hi")
        await listeners.drain_accept_queues(server.sockets, timeout=2.0)
        assert listeners.accept_queue_length(server.sockets[0]) == 0
        server.close()
        await asyncio.sleep(0.05)
        for c in clients:
            c.close()
        return got

    assert asyncio.run(main()) == [b"hi"] * 5


def test_tcp_sockets_on_port_and_end_tcp_connections() -> None:
    srv, port = _listener()
    with srv:
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = srv.accept()
        found = listeners.tcp_sockets_on_port(port)
        try:
            assert len(found) == 2  # the listener and the accepted connection
        finally:
            for s in found:
                s.close()
        assert asyncio.run(listeners.end_tcp_connections(port, timeout=0.5)) == 1
        assert client.recv(16) == b""  # the peer sees the connection closed
        conn.close()
        client.close()


def test_close_connections_while_draining() -> None:
    draining = False
    sent: list[dict[str, Any]] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"connection", b"x")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    wrapped = listeners.close_connections_while(lambda: draining, app)
    asyncio.run(wrapped({"type": "http"}, None, send))
    assert sent[0]["headers"] == [(b"connection", b"x")]
    draining = True
    sent.clear()
    asyncio.run(wrapped({"type": "http"}, None, send))
    assert sent[0]["headers"] == [(b"connection", b"close")]
    assert sent[1] == {"type": "http.response.body", "body": b"ok"}
