"""Shared-memory arenas (memfd regions mapped read-write) and their block allocator.

Each side writes only into arenas it created; the other side maps them from the
descriptor it received. Blocks start on :data:`ALIGN` boundaries.
"""

from __future__ import annotations

import bisect
import mmap
import os

#: Every block starts on a 64-byte boundary (cache line; AVX-512 loads).
ALIGN = 64
#: Size of a pool's first arena (pools grow on demand).
DEFAULT_ARENA_BYTES = 8 * 1024 * 1024
#: A pool stops growing at this many bytes; larger tensors then go inline.
MAX_POOL_BYTES = 4 * 1024 * 1024 * 1024
#: Arena sizes are rounded up to this.
ARENA_GRANULE = 1024 * 1024


def align(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`."""
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def arena_size_for(need: int, current: int = 0) -> int:
    """Size of a new arena that holds ``need`` bytes: at least twice ``current``,
    at least :data:`DEFAULT_ARENA_BYTES`, rounded up to :data:`ARENA_GRANULE`."""
    size = max(DEFAULT_ARENA_BYTES, 2 * current, need + need // 4)
    return (size + ARENA_GRANULE - 1) // ARENA_GRANULE * ARENA_GRANULE


class Arena:
    """One memfd-backed shared-memory region mapped read-write in this process.

    Attributes:
        id: identifier the two processes use for it (unique per direction and worker).
        size: bytes.
        fd: the memfd (kept by the creator so it can be sent again; -1 once closed).
        mm: the mapping; numpy views into it keep it alive after :meth:`close`.
    """

    __slots__ = ("id", "size", "fd", "mm")

    def __init__(self, arena_id: int, size: int, fd: int) -> None:
        self.id = arena_id
        self.size = size
        self.fd = fd
        self.mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)

    @classmethod
    def create(cls, arena_id: int, size: int, label: str) -> Arena:
        """Make a new arena of ``size`` bytes (``label`` shows in ``/proc/<pid>/fd``).

        Raises:
            OSError: memfd_create or ftruncate failed (out of memory).
        """
        fd = os.memfd_create(f"pdserve:{label}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
            return cls(arena_id, size, fd)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def attach(cls, arena_id: int, size: int, fd: int, keep_fd: bool = False) -> Arena:
        """Map an arena received as ``fd``; the descriptor is closed unless ``keep_fd``."""
        arena = cls(arena_id, size, fd)
        if not keep_fd:
            os.close(fd)
            arena.fd = -1
        return arena

    def close(self) -> None:
        """Close the descriptor and unmap when no numpy view still uses the memory."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.mm.close()
        except BufferError:  # views still exported: unmapped when they are collected
            pass


class FreeListAllocator:
    """First-fit allocator with coalescing, for blocks freed in any order.

    Free blocks are kept sorted by offset in two parallel lists.
    """

    __slots__ = ("size", "_starts", "_sizes", "_used")

    def __init__(self, size: int) -> None:
        self.size = size
        self._starts: list[int] = [0]
        self._sizes: list[int] = [size]
        self._used: dict[int, int] = {}

    @property
    def used_bytes(self) -> int:
        """Bytes currently allocated."""
        return sum(self._used.values())

    def alloc(self, nbytes: int) -> int | None:
        """Offset of a block of ``nbytes`` (aligned), or None when none is big enough."""
        need = align(max(nbytes, 1))
        for i, free in enumerate(self._sizes):
            if free >= need:
                offset = self._starts[i]
                if free == need:
                    del self._starts[i]
                    del self._sizes[i]
                else:
                    self._starts[i] += need
                    self._sizes[i] -= need
                self._used[offset] = need
                return offset
        return None

    def free(self, offset: int) -> None:
        """Return the block at ``offset``; unknown offsets are ignored."""
        size = self._used.pop(offset, None)
        if size is None:
            return
        i = bisect.bisect_left(self._starts, offset)
        starts, sizes = self._starts, self._sizes
        # merge with the following free block
        if i < len(starts) and offset + size == starts[i]:
            size += sizes[i]
            del starts[i]
            del sizes[i]
        # merge with the preceding free block
        if i > 0 and starts[i - 1] + sizes[i - 1] == offset:
            sizes[i - 1] += size
        else:
            starts.insert(i, offset)
            sizes.insert(i, size)
