"""The Redis response cache (pdserve.cache, issue 14 item 5): value format, flags,
and :class:`RedisResponseCache` against a real redis-server."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import numpy as np
import pytest

from pdserve.cache import (
    RedisCacheOptions,
    RedisResponseCache,
    decode_outputs,
    encode_outputs,
    parse_cache_config,
    parse_redis_cache_config,
)
from tests.conftest import free_port
from tests.integration.test_rate_limit import Redis as RedisServer


def outputs() -> dict[str, np.ndarray]:
    text = np.array([[b"a", b""], [b"\x00\xff", "\u00e9".encode()]], dtype=object)
    return {
        "F": np.arange(12, dtype=np.float32).reshape(3, 4),
        "I": np.array([[-1, 2**40]], dtype=">i8"),  # big-endian survives
        "B": np.array([True, False]),
        "S": text,
        "E": np.zeros((0, 5), dtype=np.float16),
    }


def test_encode_decode_round_trip() -> None:
    out = decode_outputs(encode_outputs(outputs()))
    assert list(out) == ["F", "I", "B", "S", "E"]
    for name, arr in outputs().items():
        assert out[name].dtype == arr.dtype and out[name].shape == arr.shape
        assert out[name].tolist() == arr.tolist()
        assert not out[name].flags.writeable


@pytest.mark.parametrize(
    "blob",
    [
        b"",
        b"PICKLE",
        encode_outputs(outputs())[:-1],
        encode_outputs(outputs()) + b"x",
        b"PDC1\x01\x00\x00\x00\x01\x00A\x03\x00|O8\x00\x00\x00\x00",
    ],
)
def test_malformed_values_are_refused(blob: bytes) -> None:
    with pytest.raises(ValueError):
        decode_outputs(blob)


def test_cache_config_flags() -> None:
    assert parse_redis_cache_config(["local,size=10"]) is None
    o = parse_redis_cache_config(
        ["redis,host=10.0.0.2", "redis,port=6380", "redis,password=pw,db=2,ttl=60"]
    )
    assert o == RedisCacheOptions(host="10.0.0.2", port=6380, password="pw", db=2, ttl=60)
    assert parse_redis_cache_config(["redis"]) == RedisCacheOptions()
    with pytest.raises(ValueError, match="unknown redis setting 'hots'"):
        parse_redis_cache_config(["redis,hots=x"])
    with pytest.raises(ValueError, match="port must be an integer"):
        parse_redis_cache_config(["redis,port=abc"])
    with pytest.raises(ValueError, match="either a local or a redis"):
        parse_cache_config(["local,size=10", "redis,host=h"])
    assert parse_cache_config(["redis,host=h", "redis,port=1"]) == 0


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    r = RedisServer(free_port())
    r.start()
    yield r
    r.kill()


def test_two_caches_share_entries_and_survive_an_outage(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        a = RedisResponseCache(RedisCacheOptions(port=redis_server.port, ttl=30))
        b = RedisResponseCache(RedisCacheOptions(port=redis_server.port, ttl=30))
        key = b"k" * 16
        assert await a.get(key) is None
        await a.put(key, outputs())
        got = await b.get(key)  # another replica's hit
        assert got is not None and got["S"].tolist() == outputs()["S"].tolist()
        # Concurrent writers of the same key: the value stays a whole entry.
        await asyncio.gather(*(c.put(key, outputs()) for c in (a, b) for _ in range(10)))
        assert (await a.get(key) or {})["F"].tolist() == outputs()["F"].tolist()
        assert (a.hits, a.misses, b.hits, b.misses, a.errors) == (1, 1, 1, 0, 0)
        import redis

        r = redis.Redis(port=redis_server.port)
        assert 0 < r.ttl(b"pdserve:cache:" + key.hex().encode()) <= 30
        r.set(b"pdserve:cache:" + (b"z" * 16).hex().encode(), b"junk")
        assert await a.get(b"z" * 16) is None and a.errors == 1

        redis_server.kill()
        for _ in range(5):
            assert await a.get(key) is None
            await a.put(key, outputs())
        assert a.down and a.errors == 2  # one failed call, then skipped until RETRY_SECS
        redis_server.start()
        a._retry_at = 0
        assert await a.get(key) is None  # a new, empty Redis
        assert not a.down
        await a.close()
        await b.close()

    with caplog.at_level(logging.INFO, "pdserve.cache"):
        asyncio.run(scenario())
    assert caplog.text.count("unavailable") == 1
    assert caplog.text.count("reachable again") == 1


def test_a_busy_pool_serves_uncached_without_an_outage(redis_server: RedisServer) -> None:
    async def scenario() -> None:
        c = RedisResponseCache(
            RedisCacheOptions(port=redis_server.port, pool_size=1, wait_timeout=20)
        )
        await c.put(b"q" * 16, outputs())
        assert c._slots is not None
        await c._slots.acquire()  # the only connection is in use
        assert await c.get(b"q" * 16) is None
        await c.put(b"r" * 16, outputs())
        assert (c.busy, c.errors, c.down) == (2, 0, False)
        c._slots.release()
        assert await c.get(b"q" * 16) is not None
        await c.close()

    asyncio.run(scenario())
