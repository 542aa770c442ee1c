"""The decode process that :func:`pdserve.frontends.offload.off_process` runs work in
(``python -m pdserve.frontends.offload_worker``, one per decode thread).

It reads calls from stdin and writes one result each to the stdout it was started with:
a message is a pickle with its out-of-band buffers (:func:`write_message`); a call is
``(function, args)``; a result is ``("ok", value)``, ``("infer_error", message, code,
reason)`` for an :class:`~pdserve.core.errors.InferError`, or ``("error", exception)``.
It exits when stdin ends (the server closed the pipe or died); fd 1 points to stderr so
that what the work prints cannot corrupt the messages; it runs at a lower priority
(:data:`NICE`) and hands memory freed by a large call back to the system.
"""

from __future__ import annotations

import os
import pickle
import struct
import sys
from collections.abc import Callable
from typing import IO, Any

from pdserve.core.errors import InferError

#: How much lower than the server this process runs (``os.nice`` increment).
NICE = 5

#: After a call whose messages were larger than this many bytes, freed heap memory is
#: returned to the system (a large JSON body expands to many times its size while it
#: is parsed).
TRIM_BYTES = 4 << 20

_LEN = struct.Struct("<Q")


def read_message(stream: IO[bytes]) -> tuple[Any, int] | None:
    """Read one message (see :func:`write_message`): the object unpickled and the
    message's size in bytes; ``None`` at the end of the stream.

    Raises:
        EOFError: the stream ended inside a message.
    """
    head = stream.read(_LEN.size)
    if not head:
        return None
    count = _read_length(head)
    payload = _read_exact(stream, _read_length(stream.read(_LEN.size)))
    buffers = [_read_exact(stream, _read_length(stream.read(_LEN.size))) for _ in range(count)]
    size = (2 + count) * _LEN.size + len(payload) + sum(len(b) for b in buffers)
    return pickle.loads(payload, buffers=buffers), size


def write_message(stream: IO[bytes], obj: object) -> int:
    """Pickle ``obj`` and write it to ``stream`` as one message; its size in bytes.

    A message is the number of out-of-band buffers, the pickle, then each buffer,
    every part after the first preceded by its length (8-byte little-endian
    integers). Out-of-band buffers (pickle protocol 5: numpy arrays, and ``bytes``
    wrapped in :class:`pickle.PickleBuffer`) are written straight from their memory,
    never copied into the pickle: the GIL is not held while they are written.
    """
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    stream.write(_LEN.pack(len(buffers)))
    stream.write(_LEN.pack(len(payload)))
    stream.write(payload)
    size = 2 * _LEN.size + len(payload)
    for buf in buffers:
        view = buf.raw()
        stream.write(_LEN.pack(view.nbytes))
        stream.write(view)
        size += _LEN.size + view.nbytes
    stream.flush()
    return size


def _read_length(head: bytes) -> int:
    if len(head) != _LEN.size:
        raise EOFError("the stream ended inside a message")
    (size,) = _LEN.unpack(head)
    return int(size)


def _read_exact(stream: IO[bytes], size: int) -> bytearray:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = stream.readinto(view[got:])  # type: ignore[attr-defined]  # a buffered pipe; IO lacks it
        if not n:
            raise EOFError(f"the stream ended after {got} of {size} bytes")
        got += n
    return buf


def run_call(call: tuple[Callable[..., object], tuple[object, ...]]) -> tuple[object, ...]:
    """Run one ``(function, args)`` call; its result tuple (see the module docstring)."""
    func, args = call
    try:
        return ("ok", func(*args))
    except InferError as exc:
        return ("infer_error", exc.message, exc.code, exc.reason)
    except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
        try:
            pickle.loads(pickle.dumps(exc))
        except Exception:  # noqa: BLE001 - an exception that cannot travel
            return ("error", RuntimeError(f"{type(exc).__name__}: {exc}"))
        return ("error", exc)


def _trim() -> None:
    """Give freed heap memory back to the system (glibc only; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _die_with_parent() -> None:
    """Linux: be killed when the thread that started this process ends (the server
    died, even by SIGKILL, or its decode pool shut down); stdin's end covers the rest."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != os.environ.get("PDSERVE_DECODE_PARENT", str(os.getppid())):
        os._exit(0)  # the server died before prctl took effect


def main() -> int:
    """Serve calls until stdin ends; the process exit code (0)."""
    _die_with_parent()
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what the work prints goes to stderr, never into a message
    try:
        os.nice(NICE)
    except OSError:
        pass
    calls = sys.stdin.buffer
    while True:
        try:
            message = read_message(calls)
        except EOFError:
            return 0
        if message is None:
            return 0
        call, size = message
        try:
            size += write_message(replies, run_call(call))
        except BrokenPipeError:
            return 0
        except Exception as exc:  # noqa: BLE001 - a result that cannot be pickled
            size += write_message(replies, ("error", RuntimeError(f"{type(exc).__name__}: {exc}")))
        del call, message
        if size > TRIM_BYTES:
            _trim()


if __name__ == "__main__":
    raise SystemExit(main())
