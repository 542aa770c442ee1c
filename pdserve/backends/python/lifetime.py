"""No python-backend process outlives the server, even when the server is SIGKILLed.

Below a server run the ``multiprocessing`` fork server, the workers it forks, and the
resource tracker. A killed server runs no code, and a busy worker holds copies of the
others' pipes, so: the fork server preloads this module and exits as soon as the
server is gone (:func:`exit_when_gone`; it ignores the group's SIGTERM), each worker
asks the kernel for SIGKILL when its parent exits (:func:`set_parent_death_signal`) and
watches the server too, and the resource tracker then sees the end of its pipe.

Linux only (``prctl``, ``pidfd_open``); elsewhere :func:`exit_when_gone` polls and
:func:`set_parent_death_signal` does nothing. The worker imports this module, so it
imports nothing of pdserve.
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
