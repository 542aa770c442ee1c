"""Resident memory from ``/proc`` (:mod:`pdserve.app.analyze.memory`) on real
processes: this one, a child that allocates, and a listening socket's owner."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from pdserve.app.analyze.memory import (
    PeakSampler,
    listening_pid,
    process_memory,
    process_tree,
    tree_memory,
)

#: A child that holds 64 MiB resident (written, so the pages are real) until stdin closes.
HOLD = (
    "import sys; b = bytearray(64 << 20)\n"
    "for i in range(0, len(b), 4096): b[i] = 1\n"
    "print('ready', flush=True); sys.stdin.read()"
)


def test_own_process_memory() -> None:
    rss, pss = process_memory(os.getpid())
    assert rss > 10 << 20
    assert pss is None or 0 < pss <= rss
    assert process_memory(2**22 + 12345) is None  # no such process


def test_tree_memory_counts_children() -> None:
    alone = tree_memory(os.getpid())
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        assert child.pid in process_tree(os.getpid())
        both = tree_memory(os.getpid())
        assert alone is not None and both is not None
        assert both.processes >= alone.processes + 1
        assert both.rss - alone.rss > 60 << 20
        with PeakSampler(os.getpid(), period=0.01) as sampler:
            time.sleep(0.05)
        assert sampler.peak_rss >= both.rss - (8 << 20)
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(10)
    assert child.pid not in process_tree(os.getpid())


def test_listening_pid_finds_the_socket_owner() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert listening_pid(s.getsockname()[1]) == os.getpid()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening
        assert listening_pid(port) is None
