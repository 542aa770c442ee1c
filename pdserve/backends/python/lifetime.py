"""No python-backend process outlives the server, even when the server is SIGKILLed.

The processes below a server (:mod:`pdserve.backends.python.backend`):

* the ``multiprocessing`` **fork server** (a child of the server), which forks
* the **workers** (children of the fork server), and
* the ``multiprocessing`` **resource tracker** (a child of the server).

An orderly shutdown stops the workers first; the fork server and the resource
tracker then see the end of their pipes and exit. When the server is killed
(SIGKILL, OOM killer) no code of it runs, and each worker holds a copy of both
pipes, so a worker that is busy (a long ``execute``, an ``initialize`` that
blocks) would keep all three alive. Hence:

* the fork server imports this module as a preload and, seeing that it runs in
  the fork server, starts :func:`exit_when_gone` on its parent (the server): it
  exits as soon as the server is gone, and only then (it ignores SIGTERM, which a
  signal to the whole process group would send it; workers survive it too, see
  :func:`pdserve.backends.python.worker.shield_from_group_signals`);
* each worker calls :func:`set_parent_death_signal`: the kernel SIGKILLs it when
  its parent (the fork server) exits, whatever the worker is doing (even holding
  the GIL in native code), and :func:`exit_when_gone` on the server too (should it
  have been started another way);
* the resource tracker then sees the end of its pipe (every holder is gone) and
  exits by itself.

Linux only (``prctl``, ``pidfd_open``); elsewhere the functions fall back to
polling (:func:`exit_when_gone`) or do nothing (:func:`set_parent_death_signal`).
The worker imports this module, so it imports nothing of pdserve.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from types import FrameType

__all__ = ["exit_when_gone", "set_parent_death_signal"]

#: ``PR_SET_PDEATHSIG`` from ``<linux/prctl.h>``.
PR_SET_PDEATHSIG = 1
#: Seconds between two checks where ``pidfd_open`` is not available.
POLL_S = 0.2


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits.

    ``prctl(PR_SET_PDEATHSIG, sig)``: "parent" is the thread that forked this
    process; the setting is not inherited by this process's own children.

    Returns:
        True when set; False where ``prctl`` is not available (not Linux).
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def exit_when_gone(pid: int, code: int = 0) -> None:
    """End this process (``os._exit(code)``) as soon as process ``pid`` has exited.

    A daemon thread waits on a pidfd of ``pid`` (readable once it exits; no
    polling, and no confusion with a later process of the same pid); without
    ``pidfd_open`` it checks every :data:`POLL_S` s. A ``pid`` already gone ends
    this process at once.
    """
    fd: int | None
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        os._exit(code)
    except (AttributeError, OSError):
        fd = None

    def watch() -> None:
        if fd is not None:
            select.select([fd], [], [])
        else:
            while _alive(pid):
                time.sleep(POLL_S)
        os._exit(code)

    threading.Thread(target=watch, name="pdserve-exit-with-server", daemon=True).start()


def _in_fork_server() -> bool:
    """True while ``multiprocessing.forkserver.main`` imports its preload modules."""
    main = getattr(sys.modules.get("multiprocessing.forkserver"), "main", None)
    code = getattr(main, "__code__", None)
    if code is None:
        return False
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


if _in_fork_server():  # preloaded by the fork server: live exactly as long as the server
    # A SIGTERM to the whole process group (systemd, a terminal's Ctrl-C is SIGINT,
    # which the fork server ignores already) must not end the fork server under the
    # server's orderly shutdown: its workers would die with it.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    exit_when_gone(os.getppid())
