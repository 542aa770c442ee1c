"""Shared-memory arenas and the control channel between the server and python workers.

Tensors cross the process boundary through *arenas*: anonymous shared memory made
with ``memfd_create`` and handed to the other process as a file descriptor over the
worker's ``AF_UNIX`` socketpair (``SCM_RIGHTS``). Compared with named POSIX segments
in ``/dev/shm`` (DESIGN.md measured a pre-allocated pool as the fastest mechanism;
this is that pool), a memfd has no name that can be left behind: the kernel frees it
when the last descriptor and mapping are gone, even after a SIGKILL of the server,
and no ``resource_tracker`` is involved on either side.

Each side owns an :class:`ArenaPool` (arenas it created, a first-fit
:class:`FreeListAllocator` in each) and maps the other side's arenas in a
:class:`PeerArenas`. The writer copies a tensor into a block of its own pool (one
copy, :func:`write_tensor`) and sends a descriptor; the reader makes a numpy view of
the block (no copy, :meth:`PeerArenas.read`). Who frees the block:

* a batch's request inputs (server -> worker) are freed by the server when the
  worker's responses arrive: they are valid while ``execute`` runs, as in Triton;
* everything else — model outputs and BLS inputs (worker -> server), BLS
  responses (server -> worker) — is freed when the reader's last view of it is
  garbage-collected: the reader queues ``(arena, offset)`` and the release rides on
  its next message to the owner.

A pool that is full grows by a new, larger arena, announced with the message that
first uses it. So a 3x224x224 FP32 image or a 32x3x224x224 batch is copied exactly
once each way. BYTES tensors are serialised by
:func:`pdserve.core.datatypes.serialize_bytes_tensor` (the binary tensor extension's
layout: uint32 LE length + bytes per element), copied into the block, and rebuilt
into ``bytes`` objects by the reader with
:func:`~pdserve.core.datatypes.deserialize_bytes_tensor`. Tensors of at most
:data:`INLINE_MAX` bytes (and anything that finds no room below
:data:`MAX_POOL_BYTES`) travel inside the control message.

The control channel (:class:`FrameReader`, :func:`encode_frame`) carries the records
of :mod:`~pdserve.backends.python.messages`, pickled (protocol 5) in their plain-tuple
wire form and framed by a 4-byte little-endian length; a frame's file descriptors
are sent with its first byte and consumed in order by the reader. On an event loop,
:class:`FramedSocket` owns one end: the write queue, the reading and both directions'
arenas (the server side of a python worker and the ``--http-workers`` channel use it).
"""

from __future__ import annotations

import array
import asyncio
import bisect
import contextlib
import math
import mmap
import os
import pickle
import socket
import struct
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from pdserve.backends.python.messages import (
    ArenaControl,
    Block,
    Frame,
    Message,
    NewArena,
    TensorDesc,
    from_wire,
    to_wire,
)
from pdserve.core.datatypes import deserialize_bytes_tensor, serialize_bytes_tensor

#: Every block starts on a 64-byte boundary (cache line; AVX-512 loads).
ALIGN = 64
#: Tensors of at most this many bytes ride inside the control message.
INLINE_MAX = 256
#: Size of a pool's first arena (pools grow on demand).
DEFAULT_ARENA_BYTES = 8 * 1024 * 1024
#: A pool stops growing at this many bytes; larger tensors then go inline.
MAX_POOL_BYTES = 4 * 1024 * 1024 * 1024
#: Arena sizes are rounded up to this.
ARENA_GRANULE = 1024 * 1024
#: ``recvmsg`` buffer size: under glibc's mmap threshold, so no mmap per call.
RECV_BYTES = 64 * 1024
#: Most file descriptors one frame may carry.
MAX_FDS_PER_FRAME = 16

_HEADER = struct.Struct("<I")


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


# --------------------------------------------------------------------------- tensors


def is_bytes_dtype(dtype: np.dtype) -> bool:
    """True for the numpy dtypes that hold BYTES tensors (object, S, U)."""
    return dtype.kind in "OSU"


def write_tensor(array: np.ndarray, alloc: Callable[[int], tuple[Arena, int] | None]) -> TensorDesc:
    """Copy ``array`` once into shared memory (or inline when tiny) and describe it.

    Args:
        array: any numpy array; object/``S``/``U`` arrays are BYTES.
        alloc: ``alloc(nbytes) -> (arena, offset)``, or None when no space is left
            (the tensor is then sent inline, inside the control message).

    Returns:
        the descriptor :func:`read_tensor` understands.
    """
    shape = array.shape  # a tuple of ints
    if is_bytes_dtype(array.dtype):
        data = serialize_bytes_tensor(array)
        nbytes = len(data)
        placed = alloc(nbytes) if nbytes > INLINE_MAX else None
        if placed is None:
            return TensorDesc("BYTES", shape, data)
        arena, offset = placed
        arena.mm[offset : offset + nbytes] = data
        return TensorDesc("BYTES", shape, None, arena.id, offset, nbytes)
    dtype = array.dtype
    if dtype.byteorder == ">":
        array = array.astype(dtype.newbyteorder("<"))
        dtype = array.dtype
    nbytes = array.nbytes
    placed = alloc(nbytes) if nbytes > INLINE_MAX else None
    if placed is None:
        return TensorDesc(dtype.str, shape, np.ascontiguousarray(array).tobytes())
    arena, offset = placed
    dst = np.ndarray(shape, dtype=dtype, buffer=arena.mm, offset=offset)
    np.copyto(dst, array, casting="no")
    return TensorDesc(dtype.str, shape, None, arena.id, offset, nbytes)


def read_tensor(
    desc: TensorDesc,
    arenas: dict[int, Arena],
    on_release: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """Turn a descriptor back into an array.

    Fixed-size tensors in an arena become views of the shared memory (no copy);
    with ``on_release``, ``on_release(arena_id, offset)`` is called once the last
    view is garbage-collected. BYTES tensors are rebuilt as object arrays of
    ``bytes`` (their block is released at once).

    Raises:
        KeyError: the arena is not mapped here.
        pdserve.core.errors.InferError: BYTES data that does not hold the shape's
            element count (a peer's bug).
    """
    shape = desc.shape
    count = math.prod(shape)
    inline = desc.inline
    if inline is not None:
        if desc.dtype == "BYTES":
            return deserialize_bytes_tensor(inline, count).reshape(shape)
        return np.frombuffer(inline, dtype=np.dtype(desc.dtype)).reshape(shape).copy()
    arena_id, offset = desc.arena, desc.offset
    arena = arenas[arena_id]
    if desc.dtype == "BYTES":
        block = memoryview(arena.mm)[offset : offset + desc.nbytes]
        try:
            out = deserialize_bytes_tensor(block, count).reshape(shape)
        finally:
            block.release()
        if on_release is not None:
            on_release(arena_id, offset)
        return out
    dtype = np.dtype(desc.dtype)
    flat = np.frombuffer(arena.mm, dtype=dtype, count=count, offset=offset)
    if on_release is not None:
        root: Any = flat
        while isinstance(root, np.ndarray):
            root = root.base
        weakref.finalize(root, on_release, arena_id, offset)
    return flat.reshape(shape)


# --------------------------------------------------------------------------- pools


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

    @property
    def total_bytes(self) -> int:
        """Bytes of all arenas."""
        return self._total

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


# --------------------------------------------------------------------------- framing


def encode_frame(message: Message, control: ArenaControl | None = None) -> bytes:
    """A message and its arena control as one frame: 4-byte LE length + pickle
    (protocol 5) of their wire form (:func:`pdserve.backends.python.messages.to_wire`).

    Raises:
        KeyError: ``message`` is not a :data:`~pdserve.backends.python.messages.Message`.
    """
    return encode_payload(to_wire(message, control))


def encode_payload(wire: Any) -> bytes:
    """Any picklable value as one frame: 4-byte LE length + pickle (protocol 5).
    :func:`encode_frame` frames this module's messages with it; another channel
    (the HTTP front-end workers' :mod:`pdserve.frontends.workers.channel`) frames its
    own records and reads them back with :meth:`FrameReader.payloads`."""
    payload = pickle.dumps(wire, protocol=5)
    return _HEADER.pack(len(payload)) + payload


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


def apply_control(
    control: ArenaControl | None, frames: FrameReader, peer: PeerArenas, pool: ArenaPool
) -> None:
    """Act on a received frame's arena control (see :func:`outgoing_control`): map
    the peer's new arenas from the descriptors that came with it, and free this
    side's blocks the peer released.

    Raises:
        RuntimeError: fewer descriptors arrived than arenas were announced.
    """
    if control is None:
        return
    if control.new_arenas:
        peer.add(control.new_arenas, frames.take_fds(len(control.new_arenas)))
    pool.free_many(control.releases)


def send_frame(
    sock: socket.socket,
    message: Message,
    control: ArenaControl | None = None,
    fds: list[int] | None = None,
) -> None:
    """Send one frame on a *blocking* socket, with ``fds`` attached to its first byte."""
    data = memoryview(encode_frame(message, control))
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


class FrameReader:
    """Incremental parser of frames and the file descriptors that came with them.

    Feed it whatever ``recvmsg`` returned (:meth:`feed`); :meth:`frames` returns the
    complete frames. A frame that carries descriptors lists their arenas in its
    :attr:`ArenaControl.new_arenas <pdserve.backends.python.messages.ArenaControl>`;
    :func:`apply_control` takes them, in arrival order, from :attr:`fds`.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self.fds: deque[int] = deque()

    def feed(self, data: bytes, ancdata: list[tuple[int, int, bytes]]) -> None:
        """Add received bytes and any ``SCM_RIGHTS`` descriptors."""
        self._buf += data
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
                self.fds.extend(fds)

    def frames(self) -> list[Frame]:
        """Every complete frame received so far, in order.

        Raises:
            pickle.UnpicklingError, IndexError, TypeError, ValueError: bytes that are
                not a frame of :func:`encode_frame`.
        """
        return [from_wire(wire) for wire in self.payloads()]

    def payloads(self) -> list[Any]:
        """The unpickled content of every complete frame received so far, in order
        (:func:`encode_payload`'s value; :meth:`frames` decodes this module's messages
        from it).

        Raises:
            pickle.UnpicklingError: bytes that are not a frame of :func:`encode_payload`.
        """
        out = []
        buf = self._buf
        pos = 0
        n = len(buf)
        while n - pos >= 4:
            (length,) = _HEADER.unpack_from(buf, pos)
            if n - pos - 4 < length:
                break
            out.append(pickle.loads(memoryview(buf)[pos + 4 : pos + 4 + length]))
            pos += 4 + length
        if pos:
            del buf[:pos]
        return out

    def take_fds(self, count: int) -> list[int]:
        """The next ``count`` received descriptors.

        Raises:
            RuntimeError: fewer than ``count`` arrived (a protocol error).
        """
        if len(self.fds) < count:
            raise RuntimeError(f"frame announced {count} descriptors, {len(self.fds)} arrived")
        return [self.fds.popleft() for _ in range(count)]

    def close(self) -> None:
        """Close descriptors that arrived but were never taken."""
        while self.fds:
            try:
                os.close(self.fds.popleft())
            except OSError:
                pass


#: ``recvmsg`` ancillary buffer size for :data:`MAX_FDS_PER_FRAME` descriptors.
ANCILLARY_SPACE = socket.CMSG_SPACE(MAX_FDS_PER_FRAME * 4)


class FramedSocket:
    """One end of a framed ``AF_UNIX`` socket on the running asyncio event loop: the
    arenas of both directions, the write queue and the reading.

    Shared by the python backend's server side
    (:class:`pdserve.backends.python.backend.WorkerProcess`) and the HTTP front-end
    workers' channel (:class:`pdserve.frontends.workers.channel.Channel`); each
    encodes its own records (:func:`encode_frame`, :func:`encode_payload`).

    - **Writing**: :meth:`send` takes the arena bookkeeping that has to go out
      (:func:`outgoing_control`: new arenas of :attr:`pool`, blocks of :attr:`peer`
      released), lets the caller encode one frame around it and queues the frame; the
      new arenas' descriptors ride with its first byte (``SCM_RIGHTS``). Bytes the
      socket does not take at once wait for it to be writable (the loop's writer).
      A send that fails (the peer is gone) drops the queue: the reader sees the end of
      file and reports it.
    - **Reading**: when the socket is readable, one ``recvmsg`` of at most
      :data:`RECV_BYTES`; ``on_payloads(list)`` gets the unpickled payloads of the
      frames it completed, in order (none: not called); end of file or a socket error
      calls ``on_eof()`` once.

    Args:
        sock: the connected stream socket (made non-blocking here).
        label: names this end's arenas (``/proc/<pid>/fd`` shows ``pdserve:<label>.<n>``).
        on_payloads: called with each read's complete payloads; it must not raise
            (an exception escapes to the event loop's handler and the read's later
            payloads are lost).
        on_eof: called once when the peer is gone.
    """

    def __init__(
        self,
        sock: socket.socket,
        label: str,
        on_payloads: Callable[[list[Any]], None],
        on_eof: Callable[[], None],
    ) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.pool = ArenaPool(label)
        self.peer = PeerArenas()
        self.frames = FrameReader()
        self.on_payloads = on_payloads
        self.on_eof = on_eof
        #: True once the end of file was seen or :meth:`close` ran.
        self.closed = False
        self._out: deque[list[Any]] = deque()  # [memoryview, fds, arenas] not yet sent
        self._writing = False
        sock.setblocking(False)
        self.loop.add_reader(sock.fileno(), self._on_readable)

    def send(self, encode: Callable[[ArenaControl | None], bytes]) -> None:
        """Queue one frame: ``encode(control)`` makes its bytes (a frame of
        :func:`encode_payload`) around the arena bookkeeping that rides with it.
        Nothing happens once closed."""
        if self.closed:
            return
        control, arenas = outgoing_control(self.pool, self.peer)
        self._out.append([memoryview(encode(control)), [a.fd for a in arenas], arenas])
        if not self._writing:
            self._flush()

    def _flush(self) -> None:
        out = self._out
        while out:
            item = out[0]
            data, fds, arenas = item
            try:
                if fds:  # descriptors ride with the first byte; they precede their frame
                    sent = self.sock.sendmsg(
                        [data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
                    )
                    item[1] = []
                    self.pool.sent(arenas)
                else:
                    sent = self.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:  # the peer is gone: the reader sees the end of file
                self._drop_queue()
                self._stop_writing()
                return
            if sent < len(data):
                item[0] = data[sent:]
                if not self._writing:
                    self._writing = True
                    self.loop.add_writer(self.sock.fileno(), self._flush)
                return
            out.popleft()
        self._stop_writing()

    def _stop_writing(self) -> None:
        if self._writing:
            self._writing = False
            with contextlib.suppress(Exception):
                self.loop.remove_writer(self.sock.fileno())

    def _drop_queue(self) -> None:
        for _, fds, arenas in self._out:
            if fds:
                self.pool.sent(arenas)
        self._out.clear()

    def _on_readable(self) -> None:
        try:
            data, ancdata, _, _ = self.sock.recvmsg(RECV_BYTES, ANCILLARY_SPACE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data, ancdata = b"", []
        if not data:
            self._eof()
            return
        self.frames.feed(data, ancdata)
        payloads = self.frames.payloads()
        if payloads:
            self.on_payloads(payloads)

    def _eof(self) -> None:
        if self.closed:
            return
        self.closed = True
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.sock.fileno())
        self._stop_writing()
        self.on_eof()

    def close(self) -> None:
        """Stop reading and writing, close the socket and the descriptors not yet
        taken, and drop both directions' arenas (numpy views keep their memory)."""
        self.closed = True
        with contextlib.suppress(Exception):
            self.loop.remove_reader(self.sock.fileno())
        self._stop_writing()
        with contextlib.suppress(OSError):
            self.sock.close()
        self.frames.close()
        self._drop_queue()
        self.pool.close()
        self.peer.close()
