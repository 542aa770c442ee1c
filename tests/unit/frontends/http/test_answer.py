"""pdserve.frontends.http.answer: the answer to an exception, and how a streaming answer
is written (head before its first piece, an early error raised, stopped on disconnect)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import orjson
import pytest

from pdserve.core.errors import InferError, not_found
from pdserve.frontends.http.answer import CLOSE, WrongMethodError, error_answer, pump_stream
from pdserve.frontends.http.status import BodyTooLargeError


def test_error_answer_maps_each_kind_of_error() -> None:
    missing = error_answer(not_found("no such model"))
    assert missing.status == 404
    assert orjson.loads(missing.body) == {"error": "no such model"}
    assert (b"content-length", b"%d" % len(missing.body)) in missing.headers
    too_large = error_answer(BodyTooLargeError("too big"))
    assert too_large.status == 413 and CLOSE in too_large.headers
    wrong = error_answer(WrongMethodError("GET"))
    assert wrong.status == 405 and (b"allow", b"GET") in wrong.headers
    crash = error_answer(RuntimeError("boom"), "GET", "/v2")
    assert crash.status == 500 and b"RuntimeError: boom" in crash.body
    assert error_answer(InferError("bad")).status == 400


def _run_stream(
    pieces: list[bytes | Exception], disconnect_after: float | None = None
) -> tuple[list[str], bool]:
    log: list[str] = []
    closed = False

    async def stream() -> AsyncGenerator[bytes, None]:
        nonlocal closed
        try:
            for piece in pieces:
                if isinstance(piece, Exception):
                    raise piece
                yield piece
            if disconnect_after is not None:
                await asyncio.sleep(10)
        finally:
            closed = True

    async def start() -> None:
        log.append("start")

    async def write(piece: bytes) -> None:
        log.append(piece.decode())

    async def end() -> None:
        log.append("end")

    async def gone() -> None:
        await asyncio.sleep(disconnect_after if disconnect_after is not None else 10)

    asyncio.run(pump_stream(stream(), start, write, end, gone()))
    return log, closed


def test_a_stream_starts_before_its_first_piece_and_ends() -> None:
    assert _run_stream([b"a", b"b"]) == (["start", "a", "b", "end"], True)
    assert _run_stream([]) == (["start", "end"], True)


def test_an_error_before_the_first_piece_is_raised_unstarted() -> None:
    with pytest.raises(InferError):
        _run_stream([InferError("refused")])


def test_a_disconnect_stops_and_closes_the_stream() -> None:
    log, closed = _run_stream([b"a"], disconnect_after=0.05)
    assert log == ["start", "a"] and closed
