"""Rate limits per key, per model and global (issue 12, item 2), memory storage and a
Redis that is not there (fail open / fail closed)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time

import pytest

from pdserve.core.errors import ErrorCode, InferError
from pdserve.frontends.traffic.ratelimit import (
    RateLimitConfigError,
    RateLimiter,
    RateLimitExceededError,
    TokenBucket,
    parse_rate,
)


def run(limiter: RateLimiter, model: str, key: str = "k", key_limit: str | None = None) -> None:
    asyncio.run(limiter.check(model, key, key_limit))


def refused(
    limiter: RateLimiter, model: str, key: str = "k", key_limit: str | None = None
) -> RateLimitExceededError:
    with pytest.raises(RateLimitExceededError) as e:
        run(limiter, model, key, key_limit)
    return e.value


def test_token_bucket_bursts_then_refills() -> None:
    now = [100.0]
    bucket = TokenBucket(clock=lambda: now[0])
    limit = (4.0, 2.0)  # "4 per 2 seconds": 4 tokens, 2 per second back
    assert [bucket.hit(*limit, ("k",)) for _ in range(4)] == [0.0] * 4
    assert bucket.hit(*limit, ("k",)) == pytest.approx(0.5)
    assert bucket.hit(*limit, ("other",)) == 0.0  # its own bucket
    now[0] += 0.5
    assert bucket.hit(*limit, ("k",)) == 0.0
    assert bucket.hit(*limit, ("k",)) == pytest.approx(0.5)
    now[0] += 100  # refilled to the capacity, never above
    assert [bucket.hit(*limit, ("k",)) for _ in range(5)][-1] > 0
    assert bucket.hit(10.0, 5.0, ("k",)) == 0.0  # a changed limit: a new, full bucket


@pytest.mark.parametrize(
    "strategy", ["auto", "moving-window", "fixed-window", "sliding-window-counter"]
)
def test_global_model_and_key_limits(strategy: str) -> None:
    limiter = RateLimiter(
        {"global": "5/minute", "models": {"tiny*": "2/minute", "x": "1/hour"}}, strategy=strategy
    )
    run(limiter, "tiny")
    run(limiter, "tiny")
    e = refused(limiter, "tiny")
    assert e.code is ErrorCode.RESOURCE_EXHAUSTED and e.scope == "model"
    assert 1 <= e.retry_after <= 60
    assert "rate limit of model 'tiny' exceeded" in e.message
    run(limiter, "tiny_specific")  # each model counted apart
    run(limiter, "other")
    run(limiter, "other")  # the global limit (5) counts every allowed model request
    e = refused(limiter, "other")
    assert e.scope == "global"
    assert limiter.limited == {("model", "tiny", ""): 1, ("global", "", ""): 1}
    keyed = RateLimiter({}, strategy=strategy)
    run(keyed, "m", "team-a", "1/minute")
    e = refused(keyed, "m", "team-a", "1/minute")
    assert e.scope == "key" and "of key 'team-a'" in e.message
    run(keyed, "m", "team-b", "1/minute")  # another key has its own budget


def test_bad_limits_and_storage() -> None:
    with pytest.raises(RateLimitConfigError, match="bad rate limit"):
        parse_rate("lots")
    with pytest.raises(RateLimitConfigError, match="exactly one"):
        parse_rate("1/second;5/minute")
    with pytest.raises(RateLimitConfigError, match="unknown field"):
        RateLimiter({"per_model": {}})
    with pytest.raises(RateLimitConfigError, match="memory:// or redis://"):
        RateLimiter({}, "mongodb://x")
    with pytest.raises(RateLimitConfigError, match="strategy"):
        RateLimiter({}, strategy="leaky")
    with pytest.raises(RateLimitConfigError, match="memory only"):
        RateLimiter({}, "redis://127.0.0.1:1", strategy="token-bucket")


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redis_down_fails_open_by_default(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, "pdserve.ratelimit")
    limiter = RateLimiter({"global": "1/minute"}, f"redis://:hunter2@127.0.0.1:{dead_port()}/0")

    async def many() -> float:
        t0 = time.monotonic()
        for _ in range(50):
            await limiter.check("m", "k", None)  # over the limit, but let through
        return time.monotonic() - t0

    elapsed = asyncio.run(many())
    assert elapsed < 5  # the dead storage is not asked per request
    assert limiter.storage_errors == 50 and limiter.storage_down
    assert caplog.text.count("rate limit storage") == 1  # once per outage
    assert "failing open" in caplog.text
    assert "hunter2" not in caplog.text  # no password from the URI


def test_redis_down_fail_closed() -> None:
    limiter = RateLimiter(
        {"global": "100/second"}, f"redis://127.0.0.1:{dead_port()}", fail_open=False
    )
    with pytest.raises(InferError) as e:
        run(limiter, "m")
    assert e.value.code is ErrorCode.UNAVAILABLE
    assert "rate limit storage unavailable" in e.value.message
