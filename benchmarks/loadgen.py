"""Closed-loop HTTP load generator: N connections, each sending one request at a time.

The same client is used for every server in ``bench_peers.py``. It runs in its own
process (pin it with ``taskset``) and is bounded in requests and time.

Engines:

- ``raw`` (default): HTTP/1.1 keep-alive connections on uvloop, requests written
  as prepared bytes and responses parsed with ``httptools`` (the parser uvicorn
  uses). About 4-5x cheaper per request than aiohttp, so the client is not the
  bottleneck when one core drives a fast server.
- ``aiohttp``: ``aiohttp.ClientSession`` with a connection limit of N.

Every response must be HTTP 200 (anything else counts as an error); with
``--expect`` the body must contain that substring. Latency is measured per
request from just before the write to the end of the response body.

Usage::

    python benchmarks/loadgen.py --url http://127.0.0.1:8000/v2/models/tiny/infer \\
        --body-file body.json --concurrency 32 --duration 8

Prints one JSON object: ``{"requests", "errors", "seconds", "rps", "p50_ms",
"p90_ms", "p99_ms", "max_ms", "mbps_out", "mbps_in", ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import numpy as np
from common import cli_parser


class _Conn(asyncio.Protocol):
    """One keep-alive connection: send a request, wait for the full response."""

    def __init__(self) -> None:
        import httptools

        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[tuple[int, int]] | None = None
        self.body_len = 0
        self.body_parts: list[bytes] | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception as e:  # noqa: BLE001 - reported as an error response
            if self.waiter is not None and not self.waiter.done():
                self.waiter.set_exception(e)

    def on_body(self, body: bytes) -> None:
        self.body_len += len(body)
        if self.body_parts is not None:
            self.body_parts.append(body)

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result((self.parser.get_status_code(), self.body_len))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))
        if not self.lost.done():
            self.lost.set_result(None)

    async def request(self, data: bytes, keep_body: bool) -> tuple[int, int, bytes | None]:
        loop = asyncio.get_running_loop()
        self.waiter = loop.create_future()
        self.body_len = 0
        self.body_parts = [] if keep_body else None
        assert self.transport is not None
        self.transport.write(data)
        status, n = await self.waiter
        body = b"".join(self.body_parts) if self.body_parts is not None else None
        return status, n, body


def build_request(url: str, body: bytes, headers: dict[str, str]) -> bytes:
    """Raw HTTP/1.1 POST bytes (GET when ``body`` is empty)."""
    parts = urlsplit(url)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    method = "POST" if body else "GET"
    lines = [f"{method} {path} HTTP/1.1", f"Host: {parts.netloc}"]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _run_raw(
    args: argparse.Namespace, body: bytes, headers: dict[str, str]
) -> dict[str, Any]:
    parts = urlsplit(args.url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    data = build_request(args.url, body, headers)
    loop = asyncio.get_running_loop()
    lat: list[float] = []
    errors = 0
    bytes_in = 0
    sent = 0
    expect = args.expect.encode() if args.expect else None
    warm_end = time.perf_counter() + args.warmup
    end = warm_end + args.duration
    first_error: list[str] = []

    async def worker() -> None:
        nonlocal errors, bytes_in, sent
        conn: _Conn | None = None
        while True:
            if sent >= args.max_requests:
                return
            now = time.perf_counter()
            if now >= end:
                return
            status = 0
            t0 = time.perf_counter()
            try:
                if conn is None or conn.lost.done():
                    _, conn = await loop.create_connection(_Conn, host, port)
                    t0 = time.perf_counter()
                sent += 1
                status, n, rbody = await conn.request(data, expect is not None)
                t1 = time.perf_counter()
                ok = status == 200 and (expect is None or (rbody is not None and expect in rbody))
            except (OSError, ConnectionError) as e:
                if not first_error:
                    first_error.append(repr(e))
                conn = None
                t1 = time.perf_counter()
                ok = False
                n = 0
                await asyncio.sleep(0.001)
            if t0 >= warm_end and t1 <= end:
                if ok:
                    lat.append(t1 - t0)
                    bytes_in += n
                else:
                    errors += 1
                    if not first_error:
                        first_error.append(f"HTTP {status}")

    t_start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    measured = min(time.perf_counter(), end) - max(t_start, warm_end)
    return _summary(lat, errors, measured, len(body), bytes_in, first_error)


async def _run_aiohttp(
    args: argparse.Namespace, body: bytes, headers: dict[str, str]
) -> dict[str, Any]:
    import aiohttp

    lat: list[float] = []
    errors = 0
    bytes_in = 0
    sent = 0
    warm_end = time.perf_counter() + args.warmup
    end = warm_end + args.duration
    first_error: list[str] = []
    conn = aiohttp.TCPConnector(limit=args.concurrency)
    async with aiohttp.ClientSession(connector=conn) as session:

        async def worker() -> None:
            nonlocal errors, bytes_in, sent
            while sent < args.max_requests and time.perf_counter() < end:
                sent += 1
                t0 = time.perf_counter()
                try:
                    if body:
                        resp = await session.post(args.url, data=body, headers=headers)
                    else:
                        resp = await session.get(args.url, headers=headers)
                    rbody = await resp.read()
                    ok = resp.status == 200 and (not args.expect or args.expect.encode() in rbody)
                    if not ok and not first_error:
                        first_error.append(f"HTTP {resp.status}: {rbody[:200]!r}")
                except aiohttp.ClientError as e:
                    ok, rbody = False, b""
                    if not first_error:
                        first_error.append(repr(e))
                t1 = time.perf_counter()
                if t0 >= warm_end and t1 <= end:
                    if ok:
                        lat.append(t1 - t0)
                        bytes_in += len(rbody)
                    else:
                        errors += 1

        t_start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    measured = min(time.perf_counter(), end) - max(t_start, warm_end)
    return _summary(lat, errors, measured, len(body), bytes_in, first_error)


def _summary(
    lat: list[float],
    errors: int,
    seconds: float,
    body_len: int,
    bytes_in: int,
    first_error: list[str],
) -> dict[str, Any]:
    n = len(lat)
    arr = np.asarray(lat) * 1000 if lat else np.zeros(1)
    seconds = max(seconds, 1e-9)
    return {
        "requests": n,
        "errors": errors,
        "seconds": round(seconds, 3),
        "rps": round(n / seconds, 1),
        "p50_ms": round(float(np.percentile(arr, 50)), 3),
        "p90_ms": round(float(np.percentile(arr, 90)), 3),
        "p99_ms": round(float(np.percentile(arr, 99)), 3),
        "max_ms": round(float(arr.max()), 3),
        "mbps_out": round(n * body_len / seconds / 1e6, 1),
        "mbps_in": round(bytes_in / seconds / 1e6, 1),
        "first_error": first_error[0] if first_error else None,
    }


def main(argv: list[str] | None = None) -> int:
    """Run one load point and print its JSON summary."""
    p = cli_parser(__doc__, __file__)
    p.add_argument("--url", required=True)
    p.add_argument("--body-file", help="request body (omit for GET)")
    p.add_argument("--header", action="append", default=[], help="'Name: value' (repeatable)")
    p.add_argument("--concurrency", "-c", type=int, default=1)
    p.add_argument("--duration", type=float, default=5.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=1.0, help="unmeasured seconds first")
    p.add_argument("--max-requests", type=int, default=10_000_000)
    p.add_argument("--engine", choices=("raw", "aiohttp"), default="raw")
    p.add_argument("--expect", help="substring every response body must contain")
    args = p.parse_args(argv)
    body = b""
    if args.body_file:
        with open(args.body_file, "rb") as f:
            body = f.read()
    headers = {"Content-Type": "application/json"} if body else {}
    for h in args.header:
        k, _, v = h.partition(":")
        headers[k.strip()] = v.strip()
    runner = _run_raw if args.engine == "raw" else _run_aiohttp
    try:
        import uvloop

        result = uvloop.run(runner(args, body, headers))
    except ImportError:
        result = asyncio.run(runner(args, body, headers))
    result["concurrency"] = args.concurrency
    json.dump(result, sys.stdout)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
