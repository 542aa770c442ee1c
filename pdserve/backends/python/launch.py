"""Starting a python worker process: the forkserver context (numpy and the worker module
preloaded, plus the modules named in ``PDSERVE_PYTHON_PRELOAD``), a socketpair to it,
and its pinning to the cores of its host policy."""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing
import os
import signal
import socket
import threading
from multiprocessing.context import ForkServerContext, ForkServerProcess

from pdserve.backends import host_policy
from pdserve.backends.python.messages import WorkerInit

_ctx_lock = threading.Lock()
_start_lock = threading.Lock()
_ctx: ForkServerContext | None = None


_launching = threading.local()


def _install_preparation_filter() -> None:
    """Keep workers from re-importing the server's ``__main__`` module.

    A ``spawn``/``forkserver`` child normally runs the parent's main script (or
    ``-m`` module) again as ``__mp_main__`` before its target: a script without an
    ``if __name__ == "__main__"`` guard would then start a second server, and
    heavy scripts would be imported in every worker. Workers need nothing from
    it, so while this module starts one, the main-module entries are left out of
    the preparation data (``multiprocessing.spawn.get_preparation_data``).
    """
    from multiprocessing import spawn

    original = spawn.get_preparation_data
    if getattr(original, "_pdserve", False):
        return

    def get_preparation_data(name: str) -> dict[str, object]:
        data = original(name)
        if getattr(_launching, "active", False):
            data.pop("init_main_from_name", None)
            data.pop("init_main_from_path", None)
        return data

    get_preparation_data._pdserve = True  # type: ignore[attr-defined]  # a marker on our wrapper
    spawn.get_preparation_data = get_preparation_data


def _mp_context() -> ForkServerContext:
    """The forkserver context, with numpy and the worker module preloaded."""
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            _install_preparation_filter()
            ctx = multiprocessing.get_context("forkserver")
            assert isinstance(ctx, ForkServerContext)
            # lifetime: the fork server exits as soon as this process is gone
            preload = [
                "numpy",
                "pdserve.backends.python.lifetime",
                "pdserve.backends.python.worker",
            ]
            extra = os.environ.get("PDSERVE_PYTHON_PRELOAD", "")
            preload += [m.strip() for m in extra.split(",") if m.strip()]
            ctx.set_forkserver_preload(preload)
            _ctx = ctx
        return _ctx


def close_process(proc: ForkServerProcess) -> None:
    """Close an exited process object's descriptors (two pipes to the fork server)."""
    with contextlib.suppress(ValueError):  # still running: its descriptors stay
        proc.close()


def _reap(proc: ForkServerProcess) -> None:
    """Wait (5 s at most) for a killed process, then close its descriptors."""
    proc.join(5.0)
    close_process(proc)


def exit_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "exited (status unknown)"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"was killed by {name}"
    return f"exited with code {exitcode}"


async def start_process(
    name: str, init: WorkerInit, cores: frozenset[int] | None
) -> tuple[ForkServerProcess, socket.socket]:
    """Start a worker process (forkserver) and return it with the server's end of its
    socketpair.

    Raises:
        OSError: the process could not be started.
        pdserve.backends.host_policy.HostPolicyError: it could not be pinned to ``cores``.
    """
    ctx = _mp_context()
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    from pdserve.backends.python.worker import worker_main

    proc = ctx.Process(target=worker_main, args=(child, init), name=f"pdserve-{name}", daemon=False)

    def launch() -> None:
        with _start_lock:
            _launching.active = True
            try:
                proc.start()
            finally:
                _launching.active = False
        if cores:
            assert proc.pid is not None  # set by start()
            try:
                host_policy.pin(proc.pid, cores)
            except ProcessLookupError:
                pass  # died at once: seen as end of file on its socket
            except host_policy.HostPolicyError:
                proc.kill()
                proc.join(5.0)
                close_process(proc)
                raise

    launched = asyncio.get_running_loop().run_in_executor(None, launch)
    try:
        await asyncio.shield(launched)
    except asyncio.CancelledError:  # shutdown while loading: kill what was started
        with contextlib.suppress(BaseException):
            await launched
        if proc.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)
            threading.Thread(target=_reap, args=(proc,), daemon=True).start()
        parent.close()
        raise
    except BaseException:
        parent.close()
        raise
    finally:
        child.close()
    return proc, parent
