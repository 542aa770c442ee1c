"""Resident memory of a server and its worker processes, from ``/proc`` (Linux).

A pdserve server is one process plus, for python-backend models, a forkserver and
one worker process per instance (all descendants of the server). Their memory is
summed: ``Rss`` (pages resident, shared libraries counted in every process that
maps them: an upper bound) and ``Pss`` (shared pages divided among the processes
sharing them: what they cost together), from ``/proc/PID/smaps_rollup``
(``/proc/PID/status`` ``VmRSS`` where that is missing; Pss is then unknown).

``pdserve analyze`` reads the sum before a configuration is loaded, after the
load, and every :data:`SAMPLE_PERIOD_S` while it serves (:class:`PeakSampler`);
the configuration's memory is the highest reading minus the one before the load.
The readings themselves are :mod:`pdserve.core.procmem`'s (shared with the model
manager, which measures each loaded model version).
"""

from __future__ import annotations

import os
import threading

from pdserve.core.procmem import (
    PROC,
    MemoryReading,
    process_memory,
    process_tree,
    tree_memory,
)

__all__ = [
    "SAMPLE_PERIOD_S",
    "MemoryReading",
    "PeakSampler",
    "listening_pid",
    "process_memory",
    "process_tree",
    "tree_memory",
]

SAMPLE_PERIOD_S = 0.25


def listening_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` (any local address), found through
    ``/proc/net/tcp{,6}`` and the socket links in ``/proc/*/fd``; None when no
    such socket, or its process is not ours to read."""
    inodes: set[str] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != "0A":  # 0A: LISTEN
                continue
            if int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(cols[9])
    if not inodes:
        return None
    targets = {f"socket:[{i}]" for i in inodes}
    for entry in os.listdir(PROC):
        if not entry.isdigit():
            continue
        fd_dir = PROC / entry / "fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd_dir / fd) in targets:
                    return int(entry)
            except OSError:
                continue
    return None


class PeakSampler:
    """Reads :func:`tree_memory` of ``pid`` every ``period`` seconds in a thread
    and keeps the highest Rss (and Pss) seen; use as a context manager."""

    def __init__(self, pid: int, period: float = SAMPLE_PERIOD_S) -> None:
        self.pid = pid
        self.period = period
        self.peak_rss = 0
        self.peak_pss: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def sample(self) -> MemoryReading | None:
        """One reading, folded into the peaks."""
        m = tree_memory(self.pid)
        if m is not None:
            self.peak_rss = max(self.peak_rss, m.rss)
            if m.pss is not None:
                self.peak_pss = max(self.peak_pss or 0, m.pss)
        return m

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.sample()

    def __enter__(self) -> PeakSampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sample()
