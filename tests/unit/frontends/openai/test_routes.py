"""The OpenAI routes' error answers and completion text (pdserve.frontends.openai.routes);
the routes end to end are in tests/integration/test_openai.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator

import numpy as np
import orjson

from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.streaming import StreamResponse
from pdserve.core.types import InferResponse
from pdserve.frontends.http.status import HttpError
from pdserve.frontends.openai import routes


def test_error_answers_keep_statuses_and_headers() -> None:
    limited = InferError("slow down", ErrorCode.RESOURCE_EXHAUSTED)
    limited.retry_after = 3  # type: ignore[attr-defined]
    answer = routes.error_answer(limited)
    assert answer.status == 429 and (b"retry-after", b"3") in answer.headers
    assert orjson.loads(answer.body)["error"]["code"] == "rate_limit_exceeded"
    big = routes.error_answer(HttpError("too large", 413))
    assert big.status == 413 and orjson.loads(big.body)["error"]["message"] == "too large"
    crash = routes.error_answer(RuntimeError("boom"))
    assert crash.status == 500 and orjson.loads(crash.body)["error"]["type"] == "server_error"


async def _stream(words: list[str]) -> AsyncGenerator[StreamResponse, None]:
    for w in words:
        out = np.array([w.encode()], dtype=object)
        response = InferResponse(model_name="g", model_version="1", outputs={"text_output": out})
        yield StreamResponse(response, None, False, ("g", "1"))
    yield StreamResponse(None, None, True, ("g", "1"))


def _collect(words: list[str], stop: list[str], max_tokens: object) -> list[object]:
    async def run() -> list[object]:
        return [p async for p in routes._pieces(_stream(words), stop, max_tokens)]

    return asyncio.run(run())


def test_pieces_cut_at_a_stop_sequence_across_pieces() -> None:
    assert _collect(["ab", "c", "de"], [], None) == ["ab", "c", "de", ("stop", 0, 0)]
    got = _collect(["ab", "cd", "ef"], ["de"], None)
    assert "".join(p for p in got if isinstance(p, str)) == "abc"
    assert got[-1] == ("stop", 0, 0)
    assert _collect(["a", "b"], [], 2)[-1] == ("length", 0, 0)
