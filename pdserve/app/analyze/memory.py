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
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
SAMPLE_PERIOD_S = 0.25


@dataclass(frozen=True)
class MemoryReading:
    """Resident memory of a process tree (bytes); ``pss`` None when unknown."""

    rss: int
    pss: int | None
    processes: int


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir(PROC):
        if not entry.isdigit():
            continue
        try:
            stat = (PROC / entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) >= 2:
            kids.setdefault(int(fields[1]), []).append(int(entry))
    return kids


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants alive now (``pid`` first)."""
    kids = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def process_memory(pid: int) -> tuple[int, int | None] | None:
    """(Rss, Pss) of one process in bytes; Pss None when unknown; None when the
    process is gone or unreadable."""
    try:
        text = (PROC / str(pid) / "smaps_rollup").read_text()
    except OSError:
        text = ""
    rss = pss = None
    for line in text.splitlines():
        if line.startswith("Rss:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Pss:"):
            pss = int(line.split()[1]) * 1024
    if rss is not None:
        return rss, pss
    try:
        status = (PROC / str(pid) / "status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024, None
    return None  # a zombie, or a kernel thread


def tree_memory(pid: int) -> MemoryReading | None:
    """Summed memory of ``pid`` and its descendants; None when ``pid`` is gone."""
    rss, pss, n = 0, 0, 0
    pss_known = True
    for i, p in enumerate(process_tree(pid)):
        mem = process_memory(p)
        if mem is None:
            if i == 0:
                return None
            continue
        rss += mem[0]
        n += 1
        if mem[1] is None:
            pss_known = False
        else:
            pss += mem[1]
    return MemoryReading(rss, pss if pss_known else None, n)


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
