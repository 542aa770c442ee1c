"""Frames on an ``AF_UNIX`` stream socket: a 4-byte little-endian length and one pickle
(protocol 5); a frame's file descriptors ride with its first byte (``SCM_RIGHTS``) and
are consumed in order by the reader. Each channel encodes its own records into a
payload; :class:`FramedSocket` owns one end on an asyncio event loop.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import pickle
import socket
import struct
from collections import deque
from collections.abc import Callable
from typing import Any

from pdserve.shm.pools import ArenaPool, PeerArenas, outgoing_control
from pdserve.shm.records import ArenaControl

#: ``recvmsg`` buffer size: under glibc's mmap threshold, so no mmap per call.
RECV_BYTES = 64 * 1024
#: Most file descriptors one frame may carry.
MAX_FDS_PER_FRAME = 16

_HEADER = struct.Struct("<I")


def encode_payload(wire: Any) -> bytes:
    """Any picklable value as one frame: 4-byte LE length + pickle (protocol 5), read
    back by :meth:`FrameReader.payloads`."""
    payload = pickle.dumps(wire, protocol=5)
    return _HEADER.pack(len(payload)) + payload


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


def send_payload(sock: socket.socket, frame: bytes, fds: list[int] | None = None) -> None:
    """Send one encoded frame on a *blocking* socket, with ``fds`` attached to its first byte."""
    data = memoryview(frame)
    if fds:
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        data = data[sent:]
    if data:
        sock.sendall(data)


class FrameReader:
    """Incremental parser of frames and the file descriptors that came with them.

    Feed it whatever ``recvmsg`` returned (:meth:`feed`); :meth:`payloads` returns the
    complete frames' content. A frame that carries descriptors lists their arenas in its
    :attr:`ArenaControl.new_arenas <pdserve.shm.records.ArenaControl>`;
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

    def payloads(self) -> list[Any]:
        """The unpickled content of every complete frame received so far, in order
        (:func:`encode_payload`'s value).

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

    Shared by the python backend's server side and the HTTP front-end workers'
    channel; each encodes its own records into a frame of :func:`encode_payload`.

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
