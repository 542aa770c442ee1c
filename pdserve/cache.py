"""Response cache: answers repeated identical requests without running the model.

Triton's response cache (docs/user_guide/response_cache.md): :class:`ResponseCache`
(the ``local`` flavour, an LRU in this process) and :class:`RedisResponseCache` (the
``redis`` flavour, shared by replicas), with the same keys (:meth:`ResponseCache.key`)
and value format (:func:`encode_outputs`). A model opts in with
``response_cache { enable: true }``; the server consults the cache before the
scheduler (:meth:`pdserve.server.InferenceServer.infer_on`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pdserve.backends.base import ExecRequest
    from pdserve.repository.model import ModelVersion

log = logging.getLogger("pdserve.cache")

_LEN = struct.Struct("<Q")


def _array_nbytes(arr: np.ndarray) -> int:
    if arr.dtype == object:
        return sum(len(x) if isinstance(x, bytes | str) else 8 for x in arr.flat) + 8 * arr.size
    return int(arr.nbytes)


def _frozen_copy(arr: np.ndarray) -> np.ndarray:
    out = np.array(arr, copy=True)
    out.flags.writeable = False
    return out


class ResponseCache:
    """An LRU cache of model outputs bounded in bytes (``--cache-config local,size=N``).

    Triton's response cache (docs/user_guide/response_cache.md), ``local`` flavour:

    - A model opts in with ``response_cache { enable: true }`` in its config.pbtxt;
      the server gives the cache a size with ``--response-cache-byte-size N`` (or
      Triton's ``--cache-config local,size=N``). Without a size there is no cache.
    - The key is a 128-bit BLAKE2b digest of the model name, the version, and for
      every input (sorted by name) its name, dtype, shape and exact bytes (BYTES
      elements with their lengths), plus the names of the requested outputs. The
      classification extension and the binary/JSON choice are applied after the
      cache, so they are not part of the key.
    - Entries are the model's outputs (copied, read-only); their size is the sum of
      the arrays' bytes (BYTES: the element lengths). The least recently used entries
      are evicted until a new entry fits; an entry larger than the whole cache is not
      stored.
    - ``redis`` flavour (Triton's redis cache, ``--cache-config redis,host=H``
      ``--cache-config redis,port=P`` ...): :class:`RedisResponseCache`, the same keys and
      a pickle-free value format (:func:`encode_outputs`) in a Redis shared by replicas;
      Redis down means requests run uncached.
    - Hits skip the scheduler. Statistics (``cache_hit`` / ``cache_miss`` counts and
      lookup durations) go to the model's :class:`~pdserve.core.stats.ModelStats`;
      a hit also counts as a success with no queue or compute time, as in Triton.

    Args:
        capacity_bytes: the most bytes of outputs held (> 0).

    Attributes:
        hits / misses / evictions: counters since start.
        bytes_used: bytes of outputs held now.
    """

    kind = "local"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError("response cache size must be > 0 bytes")
        self.capacity_bytes = capacity_bytes
        self.bytes_used = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self._entries: OrderedDict[bytes, tuple[dict[str, np.ndarray], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def enabled_for(mv: ModelVersion) -> bool:
        """True when the model's configuration has ``response_cache { enable: true }``."""
        return bool(mv.config.response_cache.enable)

    @staticmethod
    def key(mv: ModelVersion, request: ExecRequest) -> bytes:
        """The cache key (16 bytes) of ``request`` for model version ``mv``."""
        h = hashlib.blake2b(digest_size=16)
        h.update(mv.name.encode())
        h.update(b"\0")
        h.update(mv.version_str.encode())
        for name in sorted(request.inputs):
            arr = request.inputs[name]
            h.update(b"\0i")
            h.update(name.encode())
            h.update(b"\0")
            h.update(arr.dtype.str.encode())
            h.update(repr(arr.shape).encode())
            if arr.dtype == object:
                for x in arr.flat:
                    b = x if isinstance(x, bytes) else str(x).encode()
                    h.update(_LEN.pack(len(b)))
                    h.update(b)
            else:
                h.update(np.ascontiguousarray(arr).data)
        for name in sorted(request.output_names):
            h.update(b"\0o")
            h.update(name.encode())
        return h.digest()

    def lookup(self, key: bytes) -> dict[str, np.ndarray] | None:
        """The outputs stored under ``key`` (and mark them recently used), or None."""
        entry = self._entries.get(key)
        if entry is None:
            self.misses += 1
            return None
        self._entries.move_to_end(key)
        self.hits += 1
        return dict(entry[0])

    def insert(self, key: bytes, outputs: dict[str, np.ndarray]) -> bool:
        """Store a copy of ``outputs`` under ``key``, evicting LRU entries to fit.

        Returns:
            False when the entry alone is larger than the cache (not stored).
        """
        if key in self._entries:
            self._entries.move_to_end(key)
            return True
        size = sum(_array_nbytes(a) for a in outputs.values()) + len(key)
        if size > self.capacity_bytes:
            return False
        while self.bytes_used + size > self.capacity_bytes and self._entries:
            _, (_, old) = self._entries.popitem(last=False)
            self.bytes_used -= old
            self.evictions += 1
        self._entries[key] = ({n: _frozen_copy(a) for n, a in outputs.items()}, size)
        self.bytes_used += size
        return True

    async def get(self, key: bytes) -> dict[str, np.ndarray] | None:
        """:meth:`lookup` (the interface the server uses for every cache kind)."""
        return self.lookup(key)

    async def put(self, key: bytes, outputs: dict[str, np.ndarray]) -> None:
        """:meth:`insert` (the interface the server uses for every cache kind)."""
        self.insert(key, outputs)


# -- the Redis cache ------------------------------------------------------------------

_MAGIC = b"PDC1"
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")


def encode_outputs(outputs: dict[str, np.ndarray]) -> bytes:
    """Serialize model outputs for the Redis cache (no pickle).

    Format: ``PDC1``, u32 count, then per output: u16 name length, name (UTF-8), u16
    dtype length, numpy dtype string (``<f4``; ``|O`` for BYTES), u32 ndim, ndim x u64
    dims, then numeric arrays as u64 byte count + C-order bytes, BYTES arrays as u64
    length + bytes per element. All integers little-endian.
    """
    parts = [_MAGIC, _U32.pack(len(outputs))]
    for name, arr in outputs.items():
        nb = name.encode()
        obj = arr.dtype == object
        dt = b"|O" if obj else arr.dtype.str.encode()
        parts += [_U16.pack(len(nb)), nb, _U16.pack(len(dt)), dt, _U32.pack(arr.ndim)]
        parts += [_LEN.pack(d) for d in arr.shape]
        if obj:
            for x in arr.flat:
                b = x if isinstance(x, bytes) else str(x).encode()
                parts += [_LEN.pack(len(b)), b]
        else:
            data = np.ascontiguousarray(arr).tobytes()
            parts += [_LEN.pack(len(data)), data]
    return b"".join(parts)


def decode_outputs(blob: bytes) -> dict[str, np.ndarray]:
    """The outputs :func:`encode_outputs` wrote (read-only arrays).

    Raises:
        ValueError: a malformed or truncated value.
    """
    view = memoryview(blob)
    pos = 0

    def take(n: int) -> memoryview:
        nonlocal pos
        if n < 0 or pos + n > len(view):
            raise ValueError("truncated cache entry")
        out = view[pos : pos + n]
        pos += n
        return out

    if bytes(take(4)) != _MAGIC:
        raise ValueError("not a pdserve cache entry")
    outputs: dict[str, np.ndarray] = {}
    for _ in range(_U32.unpack(take(4))[0]):
        name = bytes(take(_U16.unpack(take(2))[0])).decode()
        dt = bytes(take(_U16.unpack(take(2))[0])).decode()
        ndim = _U32.unpack(take(4))[0]
        if ndim > 64:
            raise ValueError("bad rank in cache entry")
        shape = tuple(_LEN.unpack(take(8))[0] for _ in range(ndim))
        count = int(np.prod(shape, dtype=np.int64))
        if dt == "|O":
            if count > len(view):
                raise ValueError("bad shape in cache entry")
            items = [bytes(take(_LEN.unpack(take(8))[0])) for _ in range(count)]
            arr = np.empty(count, dtype=object)
            arr[:] = items
            arr = arr.reshape(shape)
        else:
            dtype = np.dtype(dt)
            if dtype.hasobject or dtype.itemsize * count != (n := _LEN.unpack(take(8))[0]):
                raise ValueError("bad array in cache entry")
            arr = np.frombuffer(bytes(take(n)), dtype=dtype).reshape(shape)
        arr.flags.writeable = False
        outputs[name] = arr
    if pos != len(view):
        raise ValueError("trailing bytes in cache entry")
    return outputs


#: ``--cache-config redis,KEY=VALUE`` settings: Triton's redis cache's names (host, port,
#: user, password, db, connect_timeout / socket_timeout / wait_timeout in ms,
#: pool_size) plus pdserve's ttl (seconds, 0: none) and prefix.
REDIS_KEYS = (
    "host",
    "port",
    "user",
    "password",
    "db",
    "connect_timeout",
    "socket_timeout",
    "pool_size",
    "wait_timeout",
    "ttl",
    "prefix",
)


@dataclass(frozen=True)
class RedisCacheOptions:
    """The Redis response cache's settings (``--cache-config redis,...``).

    Timeouts are milliseconds, as in Triton's redis cache; Triton's default 0 ("wait
    forever") becomes 1000 here, so that a Redis that hangs cannot hold requests.
    """

    host: str = "127.0.0.1"
    port: int = 6379
    user: str | None = None
    password: str | None = None
    db: int = 0
    connect_timeout: int = 1000
    socket_timeout: int = 1000
    pool_size: int = 32
    wait_timeout: int = 100
    ttl: int = 0
    prefix: str = "pdserve:cache:"


class _PoolBusy(Exception):
    """No pooled Redis connection became free within ``wait_timeout``."""


class RedisResponseCache:
    """The response cache in Redis, shared by every replica pointing at it.

    Same keys as :class:`ResponseCache` (under ``prefix``, hex); values are
    :func:`encode_outputs` bytes written with ``SET`` (``EX ttl`` when set). Capacity
    and eviction are Redis's (``maxmemory`` / ``maxmemory-policy``, e.g. allkeys-lru).
    Concurrent writers: a key is a digest of the model version and the request, so two
    replicas writing it write the same value; ``SET`` is atomic, last writer wins.

    Redis down (connection refused, timeout, any Redis error): the request runs
    uncached; one warning per outage and one info line when it is back; while down,
    Redis is retried at most once per :attr:`RETRY_SECS`. :attr:`errors` counts
    failed Redis calls (``pdserve_cache_errors_total``). At most ``pool_size`` calls
    run at once; a request that waits ``wait_timeout`` ms for one runs uncached
    (:attr:`busy`), which is not an outage.

    Raises:
        ImportError (at first use): redis-py is not installed (the ``traffic`` extra).
    """

    kind = "redis"
    #: While Redis is down, seconds between attempts (requests in between skip it).
    RETRY_SECS = 1.0

    def __init__(self, options: RedisCacheOptions) -> None:
        self.options = options
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.errors = 0
        self.outages = 0
        self.down = False
        self._retry_at = 0.0
        self.busy = 0
        self._client: Any = None
        self._slots: asyncio.Semaphore | None = None

    enabled_for = staticmethod(ResponseCache.enabled_for)
    key = staticmethod(ResponseCache.key)

    def _redis(self) -> Any:
        if self._client is None:
            import redis.asyncio  # lazy: the traffic extra

            o = self.options
            self._client = redis.asyncio.Redis(
                host=o.host,
                port=o.port,
                db=o.db,
                username=o.user,
                password=o.password,
                socket_connect_timeout=o.connect_timeout / 1000 if o.connect_timeout else None,
                socket_timeout=o.socket_timeout / 1000 if o.socket_timeout else None,
                max_connections=o.pool_size,
            )
        return self._client

    def _where(self) -> str:
        return f"{self.options.host}:{self.options.port}/{self.options.db}"

    def _available(self) -> bool:
        return not self.down or time.monotonic() >= self._retry_at

    def _failed(self, e: BaseException) -> None:
        self.errors += 1
        self._retry_at = time.monotonic() + self.RETRY_SECS
        if not self.down:
            self.down = True
            self.outages += 1
            log.warning(
                "redis response cache %s unavailable (%s: %s): serving uncached until it is back",
                self._where(),
                type(e).__name__,
                e,
            )

    def _ok(self) -> None:
        if self.down:
            self.down = False
            log.info("redis response cache %s is reachable again", self._where())

    async def _call(self, op: str, *args: Any, **kw: Any) -> Any:
        """One Redis call on a pooled connection.

        Raises:
            _PoolBusy: every connection stayed in use for ``wait_timeout`` ms.
        """
        o = self.options
        if self._slots is None:
            self._slots = asyncio.Semaphore(o.pool_size)
        try:
            await asyncio.wait_for(self._slots.acquire(), (o.wait_timeout or 0) / 1000 or None)
        except TimeoutError:
            raise _PoolBusy from None
        try:
            timeout = (o.socket_timeout or 0) / 1000 + (o.connect_timeout or 0) / 1000
            coro = getattr(self._redis(), op)(*args, **kw)
            return await asyncio.wait_for(coro, timeout or None)
        finally:
            self._slots.release()

    async def get(self, key: bytes) -> dict[str, np.ndarray] | None:
        """The outputs stored under ``key`` or None (a miss, Redis down, or a value
        that is not a pdserve entry: counted in :attr:`errors`)."""
        if not self._available():
            self.misses += 1
            return None
        try:
            blob = await self._call("get", self.options.prefix + key.hex())
        except _PoolBusy:
            self.busy += 1
            self.misses += 1
            return None
        except Exception as e:  # noqa: BLE001 - any Redis failure: serve uncached
            self._failed(e)
            self.misses += 1
            return None
        self._ok()
        if blob is None:
            self.misses += 1
            return None
        try:
            outputs = decode_outputs(blob)
        except (ValueError, UnicodeDecodeError, TypeError) as e:
            self.errors += 1
            log.warning("redis response cache: bad entry %s: %s", key.hex(), e)
            self.misses += 1
            return None
        self.hits += 1
        return outputs

    async def put(self, key: bytes, outputs: dict[str, np.ndarray]) -> None:
        """Store ``outputs`` under ``key`` (failures are counted, never raised)."""
        if not self._available():
            return
        try:
            await self._call(
                "set",
                self.options.prefix + key.hex(),
                encode_outputs(outputs),
                ex=self.options.ttl or None,
            )
        except _PoolBusy:
            self.busy += 1
            return
        except Exception as e:  # noqa: BLE001
            self._failed(e)
            return
        self._ok()

    async def close(self) -> None:
        """Close the connection pool."""
        if self._client is not None:
            with contextlib.suppress(Exception):
                await self._client.aclose()
            self._client = None


# -- server flags -------------------------------------------------------------


def parse_redis_cache_config(values: list[str]) -> RedisCacheOptions | None:
    """The Redis cache options of ``--cache-config redis,KEY=VALUE`` values (repeatable,
    as Triton's; several ``KEY=VALUE`` in one value work too), or None when no value is
    for ``redis``.

    Raises:
        ValueError: an unknown key or a bad number.
    """
    given: dict[str, str] = {}
    for value in values:
        kind, _, rest = value.partition(",")
        if kind != "redis":
            continue
        for item in filter(None, rest.split(",")):
            k, eq, v = item.partition("=")
            k = k.strip()
            if not eq or k not in REDIS_KEYS:
                raise ValueError(
                    f"--cache-config: unknown redis setting {k!r} (known: {', '.join(REDIS_KEYS)})"
                )
            given[k] = v.strip()
    if not any(v.partition(",")[0] == "redis" for v in values):
        return None
    kw: dict[str, Any] = {}
    for k, v in given.items():
        default = getattr(RedisCacheOptions, k)
        if isinstance(default, int) and not isinstance(default, bool):
            try:
                kw[k] = int(v)
            except ValueError:
                raise ValueError(
                    f"--cache-config: redis {k} must be an integer, got {v!r}"
                ) from None
            if kw[k] < 0 or (k == "pool_size" and kw[k] < 1):
                raise ValueError(f"--cache-config: redis {k} out of range: {v}")
        else:
            kw[k] = v
    return RedisCacheOptions(**kw)


def parse_cache_config(values: list[str]) -> int:
    """Size in bytes of the local cache from Triton-style ``--cache-config`` values.

    Accepts ``local,size=N`` (Triton's form) and ``size=N``; ``redis,...`` values are
    :func:`parse_redis_cache_config`'s. As in Triton, one cache at a time.

    Raises:
        ValueError: an unknown cache kind, a missing / bad size, or both a local
            and a redis cache.
    """
    size = 0
    kinds = {v.partition(",")[0] for v in values if "=" not in v.partition(",")[0]}
    if "redis" in kinds and ("local" in kinds or any("=" in v.partition(",")[0] for v in values)):
        raise ValueError("--cache-config: give either a local or a redis cache, not both")
    for value in values:
        kind, _, rest = value.partition(",")
        if "=" in kind:
            kind, rest = "local", value
        if kind == "redis":
            continue
        if kind != "local":
            raise ValueError(
                f"--cache-config: only the 'local' and 'redis' caches are supported, got {kind!r}"
            )
        for item in rest.split(","):
            k, _, v = item.partition("=")
            if k.strip() == "size":
                try:
                    size = int(v)
                except ValueError:
                    raise ValueError(
                        f"--cache-config: size must be an integer, got {v!r}"
                    ) from None
    return size


#: Either kind of response cache (the server calls ``enabled_for``, ``key``, ``get``
#: and ``put``).
AnyResponseCache = ResponseCache | RedisResponseCache
