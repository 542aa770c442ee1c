"""The arenas one process writes into (:class:`ArenaPool`) and the peer's arenas it
reads (:class:`PeerArenas`), with the bookkeeping that rides on every frame.

Who frees a block: a batch's request inputs (server -> python worker) are freed by the
server when the worker's responses arrive (valid while ``execute`` runs, as in
Triton); everything else is freed when the reader's last view of it is collected: the
reader queues ``(arena, offset)`` (:meth:`PeerArenas.take_releases`) and the release
rides on its next frame to the owner (:func:`outgoing_control`). A full pool grows by a new, larger arena, announced
with the frame that first uses it.
"""

from __future__ import annotations

import os
import threading
from collections import deque

import numpy as np

from pdserve.shm.arenas import MAX_POOL_BYTES, Arena, FreeListAllocator, arena_size_for
from pdserve.shm.records import ArenaControl, Block, NewArena, TensorDesc
from pdserve.shm.tensors import read_tensor


class ArenaPool:
    """The arenas one process writes into, with their allocators (thread-safe).

    Args:
        label: shows in the memfd names (``pdserve:<label>.<n>``).
        max_bytes: the pool stops growing here (:meth:`alloc` returns None).
    """

    def __init__(self, label: str, max_bytes: int = MAX_POOL_BYTES) -> None:
        self.label = label
        self.max_bytes = max_bytes
        self.arenas: dict[int, tuple[Arena, FreeListAllocator]] = {}
        self._unannounced: list[Arena] = []
        self._next_id = 0
        self._total = 0
        self._lock = threading.Lock()

    def alloc(self, nbytes: int) -> tuple[Arena, int] | None:
        """A block of ``nbytes``: ``(arena, offset)``; a new arena when none has room.

        Returns None when the pool would grow past ``max_bytes`` or the system is
        out of shared memory (the caller then sends the tensor inline).
        """
        with self._lock:
            for arena, allocator in self.arenas.values():
                offset = allocator.alloc(nbytes)
                if offset is not None:
                    return arena, offset
            largest = max((a.size for a, _ in self.arenas.values()), default=0)
            size = arena_size_for(nbytes, largest)
            if self._total + size > self.max_bytes:
                return None
            try:
                arena = Arena.create(self._next_id, size, f"{self.label}.{self._next_id}")
            except OSError:
                return None
            self._next_id += 1
            self._total += size
            allocator = FreeListAllocator(size)
            self.arenas[arena.id] = (arena, allocator)
            self._unannounced.append(arena)
            offset = allocator.alloc(nbytes)
            assert offset is not None
            return arena, offset

    def free(self, arena_id: int, offset: int) -> None:
        """Return a block (unknown arenas / offsets are ignored)."""
        with self._lock:
            entry = self.arenas.get(arena_id)
            if entry is not None:
                entry[1].free(offset)

    def free_many(self, blocks: list[Block]) -> None:
        """Return several blocks."""
        if not blocks:
            return
        with self._lock:
            for block in blocks:
                entry = self.arenas.get(block.arena)
                if entry is not None:
                    entry[1].free(block.offset)

    def take_announcements(self) -> tuple[list[NewArena], list[Arena]]:
        """Arenas the peer has not been told about: ``(records, arenas)``.

        Send the arenas' ``fd`` with the message, then call :meth:`sent` on them.
        """
        if not self._unannounced:  # the common case, without the lock: an arena made
            return [], []  # by another thread is announced by that thread's message
        with self._lock:
            new, self._unannounced = self._unannounced, []
        return [NewArena(a.id, a.size) for a in new], new

    @staticmethod
    def sent(arenas: list[Arena]) -> None:
        """Close the descriptors of announced arenas (the mappings stay)."""
        for arena in arenas:
            if arena.fd >= 0:
                os.close(arena.fd)
                arena.fd = -1

    def close(self) -> None:
        """Drop every arena (memory is freed once no mapping or view remains)."""
        with self._lock:
            for arena, _ in self.arenas.values():
                arena.close()
            self.arenas.clear()
            self._unannounced = []


class PeerArenas:
    """The other process's arenas, mapped here, and the blocks to release back."""

    def __init__(self) -> None:
        self.arenas: dict[int, Arena] = {}
        self._releases: deque[Block] = deque()

    def add(self, announced: list[NewArena], fds: list[int]) -> None:
        """Map newly announced arenas; ``fds`` are in the same order (and are closed)."""
        for new, fd in zip(announced, fds, strict=True):
            self.arenas[new.arena] = Arena.attach(new.arena, new.size, fd)

    def read(self, desc: TensorDesc, release: bool) -> np.ndarray:
        """The array a descriptor names; see :func:`read_tensor`.

        With ``release``, the block is queued for release (:meth:`take_releases`)
        once the last view of it is garbage-collected.
        """
        return read_tensor(desc, self.arenas, self._queue_release if release else None)

    def _queue_release(self, arena_id: int, offset: int) -> None:
        self._releases.append(Block(arena_id, offset))  # deque.append is thread-safe

    def take_releases(self) -> list[Block]:
        """Blocks whose views are gone since the last call (to send to the owner)."""
        out = []
        pop = self._releases.popleft
        while True:
            try:
                out.append(pop())
            except IndexError:
                return out

    def close(self) -> None:
        """Unmap every arena (views keep their memory alive)."""
        for arena in self.arenas.values():
            arena.close()
        self.arenas.clear()


def outgoing_control(pool: ArenaPool, peer: PeerArenas) -> tuple[ArenaControl | None, list[Arena]]:
    """The arena control that rides with every frame, either direction: this side's
    arenas the peer has not seen yet (their descriptors go with the frame,
    ``SCM_RIGHTS``) and the peer's blocks this side has finished reading.

    Returns:
        (the control, or None when there is nothing to say; the announced arenas: pass
        their ``fd`` with the frame and ``pool.sent(arenas)`` once it is on the socket).
    """
    announced, arenas = pool.take_announcements()
    releases = peer.take_releases()
    if not announced and not releases:
        return None, arenas
    return ArenaControl(announced, releases), arenas
