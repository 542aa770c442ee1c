"""Closing the HTTP and gRPC listeners at the end of a shutdown without failing a
request that reached them (after SIGTERM they stay open for the drain and answer 503
/ ``UNAVAILABLE``; then they close). Closing naively loses requests in four places
(the remedies of 1 and 4 are Linux only; elsewhere the listeners simply close):

1. connections the kernel accepted but the server has not (the listen queue):
   :func:`drain_accept_queues` drops new SYNs first, then waits for the queue to empty;
2. a request sent on an idle keep-alive connection as it closes (RFC 9112, 9.6):
   :func:`close_connections_while` says ``Connection: close`` from SIGTERM on;
3. HTTP requests still being read: :func:`wait_http_settled`;
4. gRPC calls grpc core has not handed to the application, which its shutdown fails
   as ``CANCELLED`` (grpc/grpc#41785): :func:`end_tcp_connections` ends the
   connections at the TCP level first, so they fail as ``UNAVAILABLE``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import logging
import os
import socket
import struct
import termios
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any, Protocol

log = logging.getLogger("pdserve")

__all__ = [
    "accept_queue_length",
    "close_connections_while",
    "drain_accept_queues",
    "end_tcp_connections",
    "refuse_new_connections",
    "tcp_sockets_on_port",
    "wait_http_settled",
]

#: ``SO_ATTACH_FILTER`` from ``<asm-generic/socket.h>``.
SO_ATTACH_FILTER = 26
#: A classic BPF program run on each TCP segment reaching a listening socket
#: (``ld`` offsets are in the TCP header): drop it when its SYN flag is set, keep
#: it otherwise (the last ACK of a handshake still completes the connection).
_DROP_SYN = (
    (0x30, 0, 0, 13),  # ldb [13]           TCP flags
    (0x45, 0, 1, 0x02),  # jset #SYN, 0, 1
    (0x06, 0, 0, 0),  # ret #0              drop
    (0x06, 0, 0, 0xFFFFFFFF),  # ret #-1    keep
)
_DROP_SYN_CODE = ctypes.create_string_buffer(
    b"".join(struct.pack("HBBI", *insn) for insn in _DROP_SYN)
)
#: Offset of ``tcpi_unacked`` in ``struct tcp_info``: for a listening socket, the
#: number of connections waiting in its accept queue.
_TCPI_UNACKED = 24
#: Seconds between two looks at a queue or at the connections.
_POLL_S = 0.005

#: An ASGI message or scope.
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Message, Receive, Send], Awaitable[None]]


class HasFileno(Protocol):
    """A socket, or anything with the descriptor of one."""

    def fileno(self) -> int: ...


def _dup(sock: HasFileno) -> socket.socket:
    """A real socket object on a duplicate of ``sock``'s descriptor (options set on
    it apply to ``sock``; closing it does not close ``sock``)."""
    return socket.socket(fileno=os.dup(sock.fileno()))


def refuse_new_connections(sock: HasFileno) -> bool:
    """Make a listening TCP socket drop new connection attempts (SYNs) from now on.

    Connections already queued or half-open still complete. A dropped client
    retries its SYN after about a second.

    Args:
        sock: a listening socket (``socket.socket`` or any object with ``fileno()``).

    Returns:
        True when the filter is attached; False where it cannot be (not Linux).
    """
    prog = struct.pack("HL", len(_DROP_SYN), ctypes.addressof(_DROP_SYN_CODE))
    try:
        with _dup(sock) as s:
            s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, prog)
    except OSError:
        return False
    return True


def accept_queue_length(sock: HasFileno) -> int | None:
    """Connections waiting in a listening socket's accept queue (Linux
    ``TCP_INFO``); None when it cannot be told."""
    try:
        with _dup(sock) as s:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except (OSError, AttributeError):
        return None
    if len(info) < _TCPI_UNACKED + 4:
        return None
    return int(struct.unpack_from("I", info, _TCPI_UNACKED)[0])


async def drain_accept_queues(listeners: Iterable[HasFileno], timeout: float = 1.0) -> None:
    """Refuse new connections on ``listeners`` and wait (``timeout`` s at most) until
    the server has accepted every connection already queued on them.

    The event loop (or the gRPC library's threads) must go on accepting meanwhile;
    the caller closes the listeners afterwards.
    """
    socks = list(listeners)
    watched = [s for s in socks if refuse_new_connections(s)]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    empty_since: float | None = None
    while watched and loop.time() < deadline:
        if all(not accept_queue_length(s) for s in watched):
            # a handshake that was half done when the filter went on lands in the
            # queue a moment later: the queue must stay empty for a little while
            if empty_since is None:
                empty_since = loop.time()
            elif loop.time() - empty_since >= 0.02:
                return
        else:
            empty_since = None
        await asyncio.sleep(_POLL_S)


def tcp_sockets_on_port(port: int) -> list[socket.socket]:
    """This process's TCP sockets whose local port is ``port`` (listening and
    connected), as duplicates the caller closes. Linux (``/proc/self/fd``); an
    empty list elsewhere."""
    found: list[socket.socket] = []
    seen: set[str] = set()  # a socket once (the listing may name one of our duplicates)
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in fds:
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
            if not link.startswith("socket:") or link in seen:
                continue
            s = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue  # closed meanwhile, or not a socket after all
        try:
            if (
                s.family in (socket.AF_INET, socket.AF_INET6)
                and s.type == socket.SOCK_STREAM
                and s.getsockname()[1] == port
            ):
                seen.add(link)
                found.append(s)
                continue
        except OSError:
            pass
        s.close()
    return found


def _listening(sock: socket.socket) -> bool:
    try:
        return bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN))
    except OSError:
        return False


async def end_tcp_connections(port: int, timeout: float = 1.0) -> int:
    """Stop the listeners on ``port`` from taking new connections, wait for their
    queues to empty, then end every connection on ``port`` at the TCP level
    (``shutdown(SHUT_RDWR)``: the peer sees the connection closed).

    For a listener whose library gives no other way to stop its connections
    without failing calls in flight on them as ``CANCELLED`` (gRPC; see the
    module docstring). The library still owns the descriptors and closes them.

    Returns:
        The number of connections ended.
    """
    socks = tcp_sockets_on_port(port)
    try:
        await drain_accept_queues([s for s in socks if _listening(s)], timeout)
    finally:
        for s in socks:
            s.close()
    ended = 0
    for s in tcp_sockets_on_port(port):  # again: the queue's connections are in now
        with s:
            if _listening(s):
                continue
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
                ended += 1
    return ended


def close_connections_while(draining: Callable[[], bool], app: ASGIApp) -> ASGIApp:
    """Wrap an ASGI app: while ``draining()`` is true, each response says
    ``Connection: close`` (the server closes the connection after it)."""

    async def wrapped(scope: Message, receive: Receive, send: Send) -> None:
        if scope.get("type") != "http":
            await app(scope, receive, send)
            return

        async def send_closing(message: Message) -> None:
            if message.get("type") == "http.response.start" and draining():
                headers = [
                    (k, v) for k, v in message.get("headers", ()) if k.lower() != b"connection"
                ]
                headers.append((b"connection", b"close"))
                message = {**message, "headers": headers}
            await send(message)

        await app(scope, receive, send_closing)

    return wrapped


def _unread_bytes(transport: asyncio.BaseTransport | None) -> int:
    """Bytes received on a connection and not read yet (``FIONREAD``); 0 if unknown."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return 0
    buf = bytearray(4)
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, buf)
    except (OSError, ValueError):
        return 0
    return int(struct.unpack("i", bytes(buf))[0])


def _settled(connection: object) -> bool:
    """A uvicorn HTTP connection with no request in progress and nothing unread."""
    cycle = getattr(connection, "cycle", None)
    if cycle is not None and not getattr(cycle, "response_complete", True):
        return False
    scope = getattr(connection, "scope", None)  # set when a request's first bytes came
    if scope is not None and (cycle is None or getattr(cycle, "scope", None) is not scope):
        return False  # its head is not complete yet
    if getattr(connection, "pipeline", None):
        return False
    transport = getattr(connection, "transport", None)
    if transport is not None and transport.is_closing():
        return True
    return _unread_bytes(transport) == 0


async def wait_http_settled(http: object, timeout: float) -> None:
    """Wait (``timeout`` s at most) until every connection of the uvicorn server
    ``http`` has answered what it received (its listeners already closed)."""
    state = getattr(http, "server_state", None)
    connections = getattr(state, "connections", None)
    if connections is None:
        return
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while loop.time() < deadline:
        if all(_settled(c) for c in list(connections)):
            return
        await asyncio.sleep(_POLL_S)
    log.warning("HTTP connections still busy %.0f s after the listener closed", timeout)
