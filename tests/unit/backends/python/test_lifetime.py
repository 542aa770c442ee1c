"""Unit tests: python-backend processes die with the server
(pdserve.backends.python.lifetime), with real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from pdserve.backends.python import lifetime
from tests.conftest import ROOT

#: Runs in a grandchild: arm the given mechanism against its parent, then wait.
GRANDCHILD = """
import os, sys, time
from pdserve.backends.python import lifetime
parent = os.getppid()
if sys.argv[1] == "pdeathsig":
    assert lifetime.set_parent_death_signal()
else:
    lifetime.exit_when_gone(parent)
print(os.getpid(), flush=True)
time.sleep(60)
"""

#: The child: start the grandchild, print its pid, then wait to be killed.
CHILD = """
import subprocess, sys, time
p = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdout=subprocess.PIPE)
print(p.stdout.readline().decode().strip(), flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115, PTH123
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _grandchild_outlives_child(mechanism: str) -> float | None:
    """SIGKILL the child; seconds until the grandchild is gone (None: it lives on)."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, GRANDCHILD, mechanism], stdout=subprocess.PIPE, cwd=ROOT
    )
    assert child.stdout is not None
    grandchild = int(child.stdout.readline())
    try:
        assert _alive(grandchild)
        child.send_signal(signal.SIGKILL)
        child.wait()
        t0 = time.monotonic()
        while time.monotonic() - t0 < 5:
            if not _alive(grandchild):
                return time.monotonic() - t0
            time.sleep(0.01)
        return None
    finally:
        if _alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)


def test_parent_death_signal_kills_the_child_with_its_parent() -> None:
    took = _grandchild_outlives_child("pdeathsig")
    assert took is not None and took < 1.0


def test_exit_when_gone_ends_the_process_when_the_watched_one_exits() -> None:
    took = _grandchild_outlives_child("watch")
    assert took is not None and took < 1.0


def test_imported_outside_the_fork_server_it_arms_nothing() -> None:
    assert not lifetime._in_fork_server()
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
    assert lifetime._alive(os.getpid())
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert not lifetime._alive(gone.pid)


def test_exit_when_gone_exits_at_once_with_the_code_for_a_pid_already_gone() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    script = (
        "import sys, time\n"
        "from pdserve.backends.python import lifetime\n"
        "lifetime.exit_when_gone(int(sys.argv[1]), code=7)\n"
        "time.sleep(30)\n"
    )
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script, str(gone.pid)], cwd=ROOT, timeout=30)
    assert done.returncode == 7
    assert time.monotonic() - t0 < 10
