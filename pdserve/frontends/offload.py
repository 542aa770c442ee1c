"""Work the frontends keep off the event loop: worker threads and decode processes.

- :func:`off_loop` runs a function on a two-thread pool: decompressing, decoding
  binary tensor data and encoding large responses (mostly copies, which give the
  event loop its turn often enough).
- :func:`off_process` runs a function in a decode process: parsing large JSON bodies
  and writing large outputs as JSON. ``orjson`` and numpy's list-to-array conversion
  hold the GIL for a whole C call, which would stall the event loop from any thread;
  and the memory a JSON body expands to while parsed goes back to the system after.

The decode processes (:data:`DECODE_PROCESSES`, each ``python -m
pdserve.frontends.offload_worker``, which holds the protocol) start on first use, run at
a lower priority than the server, exit when the server closes their pipe or dies, and
are restarted after one is killed (the call it was running fails with UNAVAILABLE).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any, TypeVar, TypeVarTuple, Unpack

from pdserve.core.errors import InferError, unavailable
from pdserve.frontends.offload_worker import read_message, write_message

#: Threads of :func:`codec_pool`.
CODEC_THREADS = 2

#: Processes (and the threads that feed them) of :func:`off_process`.
DECODE_PROCESSES = 2

#: ``bytes`` arguments of :func:`off_process` this large or larger are sent out of band.
_OUT_OF_BAND_BYTES = 64 * 1024

#: thread name prefix -> the pool (:func:`codec_pool`, :func:`_decode_threads`)
_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}
_pool_lock = threading.Lock()
_local = threading.local()
_workers: set[subprocess.Popen[bytes]] = set()


def _pool(prefix: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
    """The thread pool named ``prefix``, created on first use."""
    pool = _pools.get(prefix)
    if pool is None:
        with _pool_lock:
            pool = _pools.get(prefix)
            if pool is None:
                pool = _pools[prefix] = concurrent.futures.ThreadPoolExecutor(
                    max_workers=threads, thread_name_prefix=prefix
                )
    return pool


_R = TypeVar("_R")
_Args = TypeVarTuple("_Args")


def codec_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The shared two-thread pool, created on first use."""
    return _pool("pdserve-codec", CODEC_THREADS)


async def off_loop(func: Callable[[Unpack[_Args]], _R], *args: *_Args) -> _R:
    """Run ``func(*args)`` on :func:`codec_pool` and wait for its result."""
    return await asyncio.get_running_loop().run_in_executor(codec_pool(), func, *args)


def _decode_threads() -> concurrent.futures.ThreadPoolExecutor:
    """The threads that feed the decode processes, one each."""
    return _pool("pdserve-decode", DECODE_PROCESSES)


async def off_process(func: Callable[[Unpack[_Args]], _R], *args: *_Args) -> _R:
    """Run ``func(*args)`` in a decode process and wait for its result.

    ``func`` must be a module-level function (it is pickled by reference) and its
    arguments and result picklable; calls queue for the :data:`DECODE_PROCESSES`
    processes.

    Raises:
        InferError: what ``func`` raised, with its code.
        InferError(UNAVAILABLE): the decode process died during the call (killed,
            out of memory) or could not be started; the next call starts a new one.
        Exception: any other exception ``func`` raised (a ``RuntimeError`` with its
            text when it cannot be pickled).
    """
    call = (func, tuple(_out_of_band(a) for a in args))
    loop = asyncio.get_running_loop()
    reply = await loop.run_in_executor(_decode_threads(), _call_worker, call)
    kind = reply[0]
    if kind == "ok":
        return reply[1]
    if kind == "infer_error":
        raise InferError(reply[1], reply[2], reply[3])
    raise reply[1]


def _out_of_band(arg: object) -> object:
    """Large ``bytes`` and ``bytearray`` travel as out-of-band buffers: written to the
    pipe from their own memory, not copied into the pickle while holding the GIL. The
    worker gets a ``bytearray``."""
    if (type(arg) is bytes or type(arg) is bytearray) and len(arg) >= _OUT_OF_BAND_BYTES:
        return pickle.PickleBuffer(arg)
    return arg


def _call_worker(call: tuple[Callable[..., object], tuple[object, ...]]) -> tuple[Any, ...]:
    """On a decode thread: send ``call`` to this thread's process, return its reply."""
    proc: subprocess.Popen[bytes] | None = getattr(_local, "proc", None)
    if proc is None or proc.poll() is not None:
        proc = _local.proc = _start_worker()
    message: tuple[Any, int] | None
    try:
        try:
            write_message(_pipes(proc)[0], call)
        except BrokenPipeError:  # it died while idle: a new one takes the call
            _reap(proc)
            proc = _local.proc = _start_worker()
            write_message(_pipes(proc)[0], call)
        del call
        message = read_message(_pipes(proc)[1])
    except (OSError, EOFError):
        message = None
    except Exception as exc:  # noqa: BLE001 - the reply came whole but cannot be unpickled
        return ("error", RuntimeError(f"{type(exc).__name__}: {exc}"))
    if message is None:
        _local.proc = None
        _reap(proc)
        raise unavailable(
            f"the JSON decode process {_exit_text(proc)} while decoding this request "
            "(out of memory?); try again"
        )
    reply: tuple[Any, ...] = message[0]
    return reply


def _pipes(proc: subprocess.Popen[bytes]) -> tuple[IO[bytes], IO[bytes]]:
    """A decode process's stdin and stdout."""
    assert proc.stdin is not None and proc.stdout is not None
    return proc.stdin, proc.stdout


def _start_worker() -> subprocess.Popen[bytes]:
    """Start one decode process (``python -m pdserve.frontends.offload_worker``)."""
    root = str(Path(__file__).resolve().parents[2])  # the folder holding ``pdserve``
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else root
    env["PDSERVE_DECODE_PARENT"] = str(os.getpid())
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.frontends.offload_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd=root,
        )
    except OSError as exc:
        raise unavailable(f"could not start a JSON decode process: {exc}") from None
    _workers.add(proc)
    return proc


def _reap(proc: subprocess.Popen[bytes]) -> None:
    for stream in (proc.stdin, proc.stdout):
        if stream is not None:
            try:
                stream.close()
            except OSError:
                pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _workers.discard(proc)


def _exit_text(proc: subprocess.Popen[bytes]) -> str:
    try:
        code = proc.wait(1)
    except subprocess.TimeoutExpired:
        return "stopped answering"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def decode_processes() -> list[int]:
    """The process ids of the decode processes running now (for tests and metrics)."""
    return [p.pid for p in list(_workers) if p.poll() is None]


def shutdown() -> None:
    """Stop the decode processes (they exit when their pipe closes) and the pools.

    Safe to call more than once; the next :func:`off_process` or :func:`off_loop`
    starts them again.
    """
    with _pool_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.shutdown(wait=True)
    for proc in list(_workers):
        _reap(proc)
