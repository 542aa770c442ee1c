"""Response cache: answers repeated identical requests without running the model.

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
- Hits skip the scheduler. Statistics (``cache_hit`` / ``cache_miss`` counts and
  lookup durations) go to the model's :class:`~pdserve.observability.stats.ModelStats`;
  a hit also counts as a success with no queue or compute time, as in Triton.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pdserve.backends.base import ExecRequest
    from pdserve.repository.model import ModelVersion

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
    """An LRU cache of model outputs bounded in bytes.

    Args:
        capacity_bytes: the most bytes of outputs held (> 0).

    Attributes:
        hits / misses / evictions: counters since start.
        bytes_used: bytes of outputs held now.
    """

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


# -- server flags -------------------------------------------------------------


def parse_cache_config(values: list[str]) -> int:
    """Size in bytes from Triton-style ``--cache-config`` values.

    Accepts ``local,size=N`` (Triton's form) and ``size=N``.

    Raises:
        ValueError: an unknown cache kind or a missing / bad size.
    """
    size = 0
    for value in values:
        kind, _, rest = value.partition(",")
        if "=" in kind:
            kind, rest = "local", value
        if kind != "local":
            raise ValueError(f"--cache-config: only the 'local' cache is supported, got {kind!r}")
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
