"""Unit tests: the raw HTTP/2 gRPC client of ``pdserve perf`` (pdserve.app.perf.h2grpc):
HPACK encoding of the request headers, frames, and how answers are read."""

from __future__ import annotations

import struct
from typing import Any

import hpack

from pdserve.app.perf import h2grpc
from pdserve.app.perf.h2grpc import (
    DATA,
    END_HEADERS,
    END_STREAM,
    HEADERS,
    SETTINGS,
    H2Connection,
    frame,
    grpc_message,
    request_headers,
)


def test_request_headers_decode_with_hpack() -> None:
    block = request_headers("127.0.0.1:8001")
    assert hpack.Decoder().decode(block) == [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/inference.GRPCInferenceService/ModelInfer"),
        (":authority", "127.0.0.1:8001"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ]
    long = "h" * 300  # lengths past the 7-bit prefix take continuation bytes
    assert hpack.Decoder().decode(request_headers(long))[3] == (":authority", long)


def test_frame_and_message_layout() -> None:
    f = frame(DATA, END_STREAM, 3, b"abc")
    assert f == b"\x00\x00\x03" + b"\x00" + b"\x01" + b"\x00\x00\x00\x03" + b"abc"
    assert grpc_message(b"xy") == b"\x00\x00\x00\x00\x02xy"


class _Transport:
    def __init__(self) -> None:
        self.out = b""

    def write(self, data: bytes) -> None:
        self.out += data

    def writelines(self, parts: list[bytes]) -> None:
        self.out += b"".join(parts)

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        pass


def _conn() -> tuple[H2Connection, list[tuple[int, Any, str]]]:
    done: list[tuple[int, Any, str]] = []
    conn = H2Connection(
        "h:1", lambda st, err, msg: done.append((st.sid, err, msg)), lambda c: None, lambda: 0
    )
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    return conn, done


def _block(headers: list[tuple[str, str]]) -> bytes:
    enc = hpack.Encoder()
    enc.header_table_size = 0
    return enc.encode(headers)


def test_answers_are_read() -> None:
    conn, done = _conn()
    out = conn.tr.out  # type: ignore[union-attr]
    assert out.startswith(h2grpc.PREFACE)
    a, b, c = (conn.call(grpc_message(b"req")) for _ in range(3))
    assert (a.sid, b.sid, c.sid) == (1, 3, 5)
    ok = _block([(":status", "200"), ("content-type", "application/grpc")])
    trailers_ok = _block([("grpc-status", "0")])
    trailers_only = _block(
        [(":status", "200"), ("grpc-status", "14"), ("grpc-message", "model%20busy")]
    )
    wire = (
        frame(SETTINGS, 0, 0, struct.pack(">HI", 0x3, 100))
        + frame(HEADERS, END_HEADERS, 1, ok)
        + frame(DATA, 0, 1, grpc_message(b"resp"))
        + frame(HEADERS, END_HEADERS | END_STREAM, 1, trailers_ok)
        # trailers-only error answer
        + frame(HEADERS, END_HEADERS | END_STREAM, 3, trailers_only)
    )
    # Frames split at arbitrary points are put back together.
    for i in range(0, len(wire), 7):
        conn.data_received(wire[i : i + 7])
    assert done == [(1, None, ""), (3, "UNAVAILABLE", "model busy")]
    assert conn.peer_max_streams == 100 and conn.free_streams == 99
    # The server's SETTINGS were acknowledged.
    assert frame(SETTINGS, 1, 0, b"") in conn.tr.out  # type: ignore[union-attr]
    # An HTTP error status, and a lost connection, fail the call.
    conn.data_received(frame(HEADERS, END_HEADERS | END_STREAM, 5, _block([(":status", "404")])))
    assert done[-1] == (5, "HTTP 404", "")
    d = conn.call(grpc_message(b"req"))
    conn.connection_lost(None)
    assert done[-1][:2] == (d.sid, "connection lost")


def test_big_requests_wait_for_the_window() -> None:
    conn, done = _conn()
    tr = conn.tr
    assert tr is not None
    st = conn.call(grpc_message(b"x" * 100_000))  # more than the initial 65,535-byte windows
    sent = tr.out  # type: ignore[attr-defined]
    assert st.pending and len(st.pending) == 100_005 - 65_535
    # The server opens the windows: the rest goes out, in frames of at most 16 KiB.
    conn.data_received(
        frame(h2grpc.WINDOW_UPDATE, 0, 0, struct.pack(">I", 100_000))
        + frame(h2grpc.WINDOW_UPDATE, 0, st.sid, struct.pack(">I", 100_000))
    )
    assert not st.pending
    rest = tr.out[len(sent) :]  # type: ignore[attr-defined]
    assert rest.endswith(b"x" * 10) and len(rest) == 100_005 - 65_535 + 9 * 3
