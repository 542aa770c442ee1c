"""HTTP/1.1 on a raw socket, for black-box tests of pdserve's HTTP transports
(``--http-server native`` and ``asgi``): build request bytes, read responses one by
one (status line, headers, a body framed by Content-Length, chunked or the close),
tell a closed connection from a silent one, and start a server of either kind.

No HTTP library sits between the tests and the server: what is on the wire is what
the tests send and what they assert.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import ROOT, ServerProcess, start_server

#: The transports ``--http-server`` selects.
KINDS = ("native", "asgi")

_STATUS_LINE = re.compile(rb"HTTP/1\.([01]) (\d{3})(?: (.*))?")


def native_available() -> bool:
    """``--http-server`` exists in this checkout (the native transport is built)."""
    return '"--http-server"' in (ROOT / "pdserve" / "app" / "settings.py").read_text()


def server_kind_args(kind: str) -> list[str]:
    """The flags that select transport ``kind``; skips the test where ``native`` does
    not exist yet (``asgi`` is then today's only server and needs no flag)."""
    if not native_available():
        if kind == "native":
            pytest.skip("--http-server does not exist yet (no native transport)")
        return []
    return ["--http-server", kind]


def start_kind(kind: str, repo: Path, log_path: Path, *args: str, **kw: Any) -> ServerProcess:
    """``start_server`` for transport ``kind`` (the environment's PDSERVE_HTTP_SERVER
    is removed so that the flag alone decides)."""
    saved = os.environ.pop("PDSERVE_HTTP_SERVER", None)
    try:
        return start_server(repo, log_path, *server_kind_args(kind), *args, **kw)
    finally:
        if saved is not None:
            os.environ["PDSERVE_HTTP_SERVER"] = saved


@dataclass
class Response:
    """One HTTP response as read off the wire."""

    version: str  # "1.1" or "1.0"
    status: int
    reason: str
    headers: list[tuple[str, str]]  # names lower-cased, in order
    body: bytes = b""
    raw_head: bytes = b""
    chunked: bool = False
    trailers: list[tuple[str, str]] = field(default_factory=list)

    def header(self, name: str) -> str | None:
        """The first value of header ``name`` (case-insensitive), or None."""
        name = name.lower()
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body)

    @property
    def closes(self) -> bool:
        """The response announces that the server closes the connection after it."""
        return "close" in (self.header("connection") or "").lower()


class WireError(AssertionError):
    """The server sent something that is not HTTP/1.x."""


class Conn:
    """One client connection: send bytes, read whole responses in order."""

    def __init__(self, port: int, timeout: float = 15.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""
        self.eof = False

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client's end."""
        self.sock.close()

    def send(self, data: bytes) -> None:
        """Send all of ``data``."""
        self.sock.sendall(data)

    def settimeout(self, timeout: float | None) -> None:
        """The socket's timeout for the reads that follow."""
        self.sock.settimeout(timeout)

    def _fill(self) -> bool:
        """Read more bytes into the buffer; False at the end of the stream (a reset
        counts as the end)."""
        if self.eof:
            return False
        try:
            chunk = self.sock.recv(1 << 20)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            self.eof = True
            return False
        self.buf += chunk
        return True

    def _read_until(self, marker: bytes) -> bytes | None:
        while (i := self.buf.find(marker)) < 0:
            if not self._fill():
                return None
        out, self.buf = self.buf[: i + len(marker)], self.buf[i + len(marker) :]
        return out

    def _read_exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            if not self._fill():
                raise WireError(f"connection closed after {len(self.buf)} of {n} body bytes")
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def read_head(self) -> Response | None:
        """Read a status line and headers (an interim 1xx included); None when the
        connection closed before a whole head came (the bytes that did are in ``buf``)."""
        head = self._read_until(b"\r\n\r\n")
        if head is None:
            return None
        lines = head[:-4].split(b"\r\n")
        m = _STATUS_LINE.fullmatch(lines[0])
        if m is None:
            raise WireError(f"not an HTTP/1.x status line: {lines[0][:200]!r}")
        headers = []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise WireError(f"malformed response header line: {line[:200]!r}")
            headers.append((name.decode("latin-1").lower(), value.strip().decode("latin-1")))
        return Response(
            "1." + m.group(1).decode(),
            int(m.group(2)),
            (m.group(3) or b"").decode("latin-1"),
            headers,
            raw_head=head,
        )

    def read_response(self, head_request: bool = False) -> Response | None:
        """The next whole final response (interim 1xx responses are skipped), or None
        when the connection closed before one began.

        Raises:
            WireError: a malformed status line, header or framing, or a close in the
                middle of a response.
        """
        while True:
            r = self.read_head()
            if r is None:
                if self.buf:
                    raise WireError(f"connection closed inside a response head: {self.buf!r}")
                return None
            if not 100 <= r.status < 200:
                break
        te = (r.header("transfer-encoding") or "").lower()
        cl = r.header("content-length")
        if head_request or r.status in (204, 304):
            return r
        if te:
            if te != "chunked":
                raise WireError(f"unexpected transfer-encoding {te!r}")
            r.chunked = True
            parts = []
            while True:
                size_line = self._read_until(b"\r\n")
                if size_line is None:
                    raise WireError("connection closed inside a chunked body")
                size = int(size_line.split(b";")[0].strip(), 16)
                if size == 0:
                    while (line := self._read_until(b"\r\n")) not in (b"\r\n", None):
                        name, _, value = line.partition(b":")
                        r.trailers.append((name.decode().lower(), value.strip().decode()))
                    break
                parts.append(self._read_exact(size))
                if self._read_exact(2) != b"\r\n":
                    raise WireError("chunk not followed by CRLF")
            r.body = b"".join(parts)
        elif cl is not None:
            r.body = self._read_exact(int(cl))
        else:
            while self._fill():
                pass
            r.body, self.buf = self.buf, b""
        return r

    def expect_response(self) -> Response:
        """:meth:`read_response`, failing when the connection closed instead."""
        r = self.read_response()
        assert r is not None, "the connection closed instead of answering"
        return r

    def closed_within(self, seconds: float) -> bool:
        """True when the server closes the connection (EOF or reset) within ``seconds``
        and sends nothing more; False when it is still open then."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                if not self._fill():
                    return not self.buf
            except TimeoutError:
                return False
        return False


def request(
    method: str,
    path: str,
    body: bytes | None = None,
    headers: Sequence[tuple[str, str]] = (),
    version: str = "1.1",
    content_length: bool = True,
) -> bytes:
    """The bytes of one request; ``Host`` and (for a body) ``Content-Length`` added."""
    lines = [f"{method} {path} HTTP/{version}", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in headers]
    if body is not None and content_length:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def chunked(body: bytes, sizes: Iterable[int]) -> bytes:
    """``body`` in chunked transfer coding, cut into pieces of ``sizes`` (cycled)."""
    out = []
    pos = 0
    sizes = list(sizes)
    i = 0
    while pos < len(body):
        n = max(1, sizes[i % len(sizes)])
        piece = body[pos : pos + n]
        out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        pos += n
        i += 1
    out.append(b"0\r\n\r\n")
    return b"".join(out)


def tiny_body(x: np.ndarray) -> bytes:
    """A V2 JSON inference request for ``tiny`` with input ``x`` (FP32 [n, 64])."""
    return json.dumps(
        {
            "inputs": [
                {
                    "name": "INPUT0",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "data": x.ravel().tolist(),
                }
            ]
        }
    ).encode()


def tiny_output(r: Response) -> np.ndarray:
    """``OUTPUT0`` of a JSON ``tiny`` response, as FP32 [n, 64]."""
    assert r.status == 200, (r.status, r.body[:500])
    (out,) = r.json()["outputs"]
    assert out["name"] == "OUTPUT0" and out["datatype"] == "FP32"
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` now."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


def health(port: int, timeout: float = 10.0) -> int:
    """Status of ``GET /v2/health/live`` on a new connection."""
    with Conn(port, timeout) as c:
        c.send(request("GET", "/v2/health/live"))
        return c.expect_response().status
