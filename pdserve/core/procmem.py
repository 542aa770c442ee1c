"""Resident memory of processes, from ``/proc`` (Linux), and memory sizes with units.

Shared by the model manager (what each loaded model version costs: the server's own
Rss delta around an in-process load, or the Rss of a python model's worker
processes) and by ``pdserve analyze`` (a whole server's process tree). ``Rss`` counts
pages resident, shared libraries in every process that maps them (an upper bound);
``Pss`` divides shared pages among the processes sharing them. Both are read from
``/proc/PID/smaps_rollup`` (``/proc/PID/status`` ``VmRSS`` where that is missing;
Pss is then unknown). Off Linux every reading is None.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")


@dataclass(frozen=True)
class MemoryReading:
    """Resident memory of a process tree (bytes); ``pss`` None when unknown."""

    rss: int
    pss: int | None
    processes: int


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    try:
        entries = os.listdir(PROC)
    except OSError:
        return kids
    for entry in entries:
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


def own_rss() -> int | None:
    """Resident memory of this process in bytes (``/proc/self/statm``, cheap); None
    where it cannot be read."""
    try:
        with open(PROC / "self" / "statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def gpu_memory_by_pid() -> dict[int, int] | None:
    """GPU memory used by each process, summed over the GPUs NVML sees, in bytes;
    None without ``pynvml`` or a GPU (never raises)."""
    try:
        import pynvml  # type: ignore[import-not-found]  # optional, ships no stubs
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        used: dict[int, int] = {}
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h):
                if p.usedGpuMemory is not None:
                    used[p.pid] = used.get(p.pid, 0) + int(p.usedGpuMemory)
        return used
    except Exception:  # noqa: BLE001 - no driver / no GPU / not allowed: no reading
        return None


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``2GiB``, ``512MiB``, ``2G`` (binary), ``1.5GB`` (decimal), ``1048576`` (bytes)
    -> bytes.

    Raises:
        ValueError: not a size, or 0.
    """
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"'{text}' is not a size such as 2GiB or 512MiB")
    number, unit, binary, b = m.groups()
    power = " kmgt".index(unit.lower()) if unit else 0
    base = 1000 if (unit and b and not binary) else 1024
    value = int(float(number) * base**power)
    if value <= 0:
        raise ValueError(f"'{text}': the size must be above 0")
    return value


def format_size(n: float) -> str:
    """``2.0 GiB`` / ``512.0 MiB`` / ``12.3 KiB`` / ``17 B`` (for messages)."""
    for unit, power in (("GiB", 3), ("MiB", 2), ("KiB", 1)):
        if abs(n) >= 1024**power:
            return f"{n / 1024**power:.1f} {unit}"
    return f"{int(n)} B"


def release_free_memory() -> None:
    """Ask glibc to hand freed heap memory back to the system (``malloc_trim(0)``),
    so that the Rss of the server drops after a model is unloaded; nothing elsewhere."""
    try:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("c")
        if name:
            ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):
        pass


#: The cyclic collector's thresholds while serving (CPython's defaults: 700, 10, 10).
#: Generation 0 is collected each time tracked allocations exceed deallocations by the
#: first number; 32-128 requests in flight, each holding a few dozen containers
#: (coroutines, frames, dicts, futures), pass 700 at every batch, so the default walks
#: the young objects several times per batch (benchmarks/RESULTS.md has the figures).
#: The cost: cyclic garbage waits for up to 50,000 more allocations (a few MB at most)
#: before it is freed; reference-counted objects are freed at once.
SERVING_GC_THRESHOLDS = (50_000, 20, 20)


def settle_gc() -> None:
    """Prepare the collector for serving: freeze what is alive now and raise the
    thresholds to :data:`SERVING_GC_THRESHOLDS`.

    Freezing moves every object alive at start-up (the imported modules of numpy,
    onnxruntime, protobuf...: hundreds of thousands of objects, never garbage) out of
    the generations, so that a full collection walks only what was allocated since
    and stalls the event loop far less. Idempotent; call it once the server is loaded and before it takes traffic.
    """
    import gc

    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)
