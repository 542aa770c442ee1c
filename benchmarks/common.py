"""Helpers shared by the benchmark scripts in this folder.

The scripts run as ``python benchmarks/X.py``, so this folder is ``sys.path[0]``
and they import these helpers with ``from common import ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[1]
REPO = ROOT / "examples" / "model_repository"
GOLDENS = ROOT / "examples" / "goldens"
LOADGEN = ROOT / "benchmarks" / "loadgen.py"
PY = sys.executable


def _plain(text: str) -> str:
    """``text`` without reST markup: ``literal`` -> literal, :role:`~a.b.C` -> C, **x** -> x."""
    text = re.sub(r":\w+:`~[\w.]*?\.?(\w+)`", r"\1", text)
    text = re.sub(r":\w+:`([^`]+)`", r"\1", text)
    return text.replace("``", "").replace("**", "")


def cli_parser(doc: str | None, script: str, **kwargs: Any) -> argparse.ArgumentParser:
    """The argument parser of a benchmark script, with its ``--help`` texts taken from the
    script's module docstring ``doc`` (written in reST).

    The description is the docstring's whole first paragraph (every script's first
    paragraph is one or more complete sentences that say what it measures); the epilog
    is each indented block of the docstring that runs ``benchmarks/SCRIPT`` (its usage
    examples, as written there), then where the rest of the explanation is.

    Args:
        doc: the script's ``__doc__``.
        script: the script's file (``__file__``).
        kwargs: more :class:`argparse.ArgumentParser` arguments.

    Raises:
        ValueError: ``doc`` is empty.
    """
    if not doc or not doc.strip():
        raise ValueError(f"{script}: no module docstring for --help")
    name = Path(script).name
    paragraphs = re.split(r"\n[ \t]*\n", doc.strip("\n"))
    width = min(shutil.get_terminal_size().columns, 100) - 2
    description = textwrap.fill(_plain(" ".join(paragraphs[0].split())), width)
    examples = [
        textwrap.indent(textwrap.dedent(p), "  ")
        for p in paragraphs
        if p.startswith((" ", "\t")) and f"benchmarks/{name}" in p
    ]
    epilog = f"details: the docstring at the top of benchmarks/{name}"
    if examples:
        epilog = "examples:\n" + "\n\n".join(examples) + "\n\n" + epilog
    return argparse.ArgumentParser(
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kwargs,
    )


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def taskset(core: str | None) -> list[str]:
    """``taskset -c core`` prefix (empty when taskset is missing or ``core`` is None)."""
    if core is None or shutil.which("taskset") is None:
        return []
    return ["taskset", "-c", core]


def pdserve_command(
    repo: Path,
    http_port: int,
    grpc_port: int,
    metrics_port: int,
    *args: str,
    core: str | None = None,
) -> list[str]:
    """The ``pdserve serve`` command line on ``repo`` (pinned to ``core`` if given)."""
    return [
        *taskset(core),
        PY,
        "-m",
        "pdserve",
        "serve",
        "--model-repository",
        str(repo),
        "--http-port",
        str(http_port),
        "--grpc-port",
        str(grpc_port),
        "--metrics-port",
        str(metrics_port),
        *args,
    ]


def start_server(
    repo: Path, *args: str, core: str = "0", log: bool = True
) -> tuple[subprocess.Popen[bytes], int, int, float]:
    """Start pdserve on ``core``; return (process, http port, grpc port, seconds to ready).

    With ``log``, the server's output goes to ``pdserve-bench-PORT.log`` in the
    temporary directory; without, it is discarded.
    """
    http_port, grpc_port = free_port(), free_port()
    cmd = pdserve_command(repo, http_port, grpc_port, free_port(), *args, core=core)
    t0 = time.monotonic()
    out: IO[bytes] | int = subprocess.DEVNULL
    if log:
        out = open(Path(tempfile.gettempdir()) / f"pdserve-bench-{http_port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT if log else subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{http_port}/v2/health/ready"
    while time.monotonic() - t0 < 120:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return proc, http_port, grpc_port, time.monotonic() - t0
        except OSError:
            time.sleep(0.05)
    proc.kill()
    if isinstance(out, int):
        raise RuntimeError("server did not become ready")
    raise RuntimeError(f"server did not become ready; log in {out.name}")


def wait_ready(
    proc: subprocess.Popen[bytes],
    port: int,
    log: Path,
    name: str,
    interval: float,
    tail: int | None = None,
) -> None:
    """Poll ``/v2/health/ready`` on ``port`` for up to 120 s; raise if ``proc`` exits
    (with the last ``tail`` characters of ``log``, all of it when None) or never answers."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text()
            raise RuntimeError(f"{name} exited:\n{text if tail is None else text[-tail:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=1):
                return
        except OSError:
            time.sleep(interval)
    proc.kill()
    raise RuntimeError(f"{name} did not become ready")


def run_client(
    script: str,
    flag: str,
    target: str,
    body: bytes,
    concurrency: int,
    duration: float,
    *,
    extra: Sequence[str] = (),
    timeout: float,
    suffix: str = ".body",
    core: str = "1",
) -> Any:
    """Run a load client ``script FLAG TARGET --body-file F --concurrency C --duration D
    EXTRA...`` pinned to ``core``, with ``body`` in a temporary file; return the JSON
    object on its last line of output."""
    with tempfile.NamedTemporaryFile(suffix=suffix, delete=False) as f:
        f.write(body)
    try:
        cmd = [
            *taskset(core),
            PY,
            script,
            flag,
            target,
            "--body-file",
            f.name,
            "--concurrency",
            str(concurrency),
            "--duration",
            str(duration),
            *extra,
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=timeout)
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        os.unlink(f.name)


def tritonserver_command(
    py: Path,
    repo: Path,
    http_port: int,
    backends: Path,
    *,
    core: str | None = None,
    grpc_port: int | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of real Triton (the ``tritonserver`` 2.51 in
    the ``nvidia-pytriton`` wheel of the venv whose interpreter is ``py``) on ``repo``.

    Follows ``../shared/ANCHORS.md``: ``backends/python`` is refreshed from the
    bundle with the stub for this Python version; the venv's ``bin`` goes first on
    PATH (the stub imports numpy/onnxruntime/Pillow from that venv) and the
    interpreter's own LIBDIR first in LD_LIBRARY_PATH (otherwise the stub loads the
    system libpython). The venv must hold numpy < 2: the bundled stub's pybind11
    predates numpy 2's ABI, and with numpy 2 the arrays it hands to ``model.py`` are
    garbage (BYTES lengths like 0xD5D5D5D5, undecodable images).

    ``grpc_port``: Triton's gRPC port (None: a free one nobody is told of).

    Returns:
        (argv, environment additions); servers listen on 127.0.0.1 only.

    Raises:
        subprocess.CalledProcessError: ``py`` has no ``pytriton``.
    """
    site = Path(
        subprocess.check_output(
            [str(py), "-c", "import pytriton, os; print(os.path.dirname(pytriton.__file__))"],
            text=True,
        ).strip()
    )
    bundle = site / "tritonserver"
    libdir = subprocess.check_output(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"], text=True
    ).strip()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    shutil.rmtree(backends, ignore_errors=True)
    shutil.copytree(bundle / "backends" / "python", backends / "python")
    stub = bundle / "python_backend_stubs" / version / "triton_python_backend_stub"
    shutil.copy(stub, backends / "python" / "triton_python_backend_stub")
    libs = site.parent / "nvidia_pytriton.libs"
    env = {
        "PATH": f"{py.parent}:{os.environ.get('PATH', '')}",
        "LD_LIBRARY_PATH": f"{libdir}:{libs}:{os.environ.get('LD_LIBRARY_PATH', '')}",
    }
    cmd = [
        *taskset(core),
        str(bundle / "bin" / "tritonserver"),
        f"--model-repository={repo}",
        f"--backend-directory={backends}",
        "--http-address=127.0.0.1",
        "--grpc-address=127.0.0.1",
        "--metrics-address=127.0.0.1",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port or free_port()}",
        f"--metrics-port={free_port()}",
        "--allow-gpu-metrics=false",
    ]
    return cmd, env


def header_args(headers: Sequence[str]) -> list[str]:
    """``--header H`` for each of ``headers`` (loadgen.py options)."""
    return [arg for h in headers for arg in ("--header", h)]


# --------------------------------------------------------------------------- process trees


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])  # fields after "(comm)": state ppid
        children.setdefault(ppid, []).append(int(entry))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def proc_stats(pid: int) -> dict[str, Any] | None:
    """``rss_kib``, ``pss_kib``, ``fds``, ``threads`` and ``cpu_s`` (user + system CPU
    seconds of the process and of its children it has reaped) of one process (None once
    it is gone or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        ticks = [int(x) for x in stat[stat.rindex(b")") + 2 :].split()[11:15]]
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        if "VmRSS" not in status:
            return None  # zombie
        pss = 0
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1])
        return {
            "rss_kib": int(status["VmRSS"].split()[0]),
            "pss_kib": pss,
            "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"]),
            "cpu_s": sum(ticks) / os.sysconf("SC_CLK_TCK"),
        }
    except (OSError, ValueError, KeyError):
        return None


def shm_rss_kib(pid: int) -> int:
    """Resident KiB of ``pid``'s memfd mappings (the python backend's shared-memory
    arenas: pools that keep their high-water size by design), 0 once it is gone."""
    total, in_memfd = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                if not line[0].isupper():  # a mapping's header line: "start-end perms ..."
                    in_memfd = "/memfd:" in line
                elif in_memfd and line.startswith("Rss:"):
                    total += int(line.split()[1])
    except (OSError, ValueError):
        return 0
    return total


def tcp_connections(port: int) -> int:
    """Established TCP connections whose local port is ``port`` (``/proc/net/tcp``, tcp6)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "01" and int(local.rsplit(":", 1)[1], 16) == port:
                    count += 1
    return count


def tree_stats(pid: int) -> dict[str, Any]:
    """Resources of ``pid`` and of all its descendants.

    Returns:
        ``server`` (:func:`proc_stats` of ``pid`` itself), ``processes`` (descendants
        alive), and over ``pid`` plus descendants: ``rss_mib`` (sum of RSS: pages shared
        between processes count once per process), ``pss_mib`` (sum of proportional set
        sizes: shared pages split between their users), ``shm_rss_mib`` (the part of
        ``rss_mib`` in memfd mappings: :func:`shm_rss_kib`), ``fds``, ``threads``, ``cpu_s``
        (CPU seconds used so far, workers reaped by the fork server included).
    """
    server = proc_stats(pid)
    pids = descendants(pid)
    kids = [s for s in (proc_stats(p) for p in pids) if s is not None]
    every = ([server] if server else []) + kids
    shm = sum(shm_rss_kib(p) for p in [pid, *pids]) / 1024
    return {
        "server": server,
        "processes": len(kids),
        "rss_mib": round(sum(s["rss_kib"] for s in every) / 1024, 2),
        "shm_rss_mib": round(shm, 2),
        "pss_mib": round(sum(s["pss_kib"] for s in every) / 1024, 2),
        "fds": sum(s["fds"] for s in every),
        "threads": sum(s["threads"] for s in every),
        "cpu_s": round(sum(s["cpu_s"] for s in every), 2),
    }


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs`` (0.0 with fewer than 2 points)."""
    if len(xs) < 2:
        return 0.0
    import numpy as np

    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 30.0) -> list[int]:
    """SIGTERM ``proc``, wait up to ``timeout`` s, then SIGKILL it and what is left below it.

    Returns:
        the pids of its descendants (taken just before SIGTERM) still alive 2 s after it
        exited: processes that outlived the server (there should be none).
    """
    kids = descendants(proc.pid)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    deadline = time.monotonic() + 2.0
    alive = kids
    while alive and time.monotonic() < deadline:
        time.sleep(0.1)
        alive = [p for p in alive if proc_stats(p) is not None]
    for p in alive:  # only processes this server started
        with contextlib.suppress(OSError):
            os.kill(p, 9)
    return alive


def pressure() -> dict[str, float]:
    """The kernel's pressure-stall figures (``/proc/pressure``): share of the last 10 s
    in which some task waited for a CPU (``cpu_some``) and in which every task was
    stalled on memory (``memory_full``), in percent; empty where PSI is unavailable.
    High values mean the machine, not the server, was the bottleneck."""
    out: dict[str, float] = {}
    for res, kind in (("cpu", "some"), ("memory", "full")):
        with contextlib.suppress(OSError, ValueError), open(f"/proc/pressure/{res}") as f:
            for line in f:
                if line.startswith(kind):
                    out[f"{res}_{kind}"] = float(line.split()[1].split("=")[1])
    return out


def interrupt_on_sigterm() -> None:
    """Make SIGTERM (and SIGINT, which a shell ignores in background jobs) raise
    :class:`KeyboardInterrupt` in the main thread, so that a script's ``finally`` stops
    the server it started however it is ended."""
    import signal

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)


# --------------------------------------------------------------------------- tiny + wrk/perf_analyzer


#: One row of the example ``tiny`` model (64 FP32) as a V2 JSON request body.
TINY_ROW_BODY = {
    "inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": [0.25] * 64}]
}


def tiny_repo(tmp: Path) -> Path:
    """``tmp/models``: a model repository holding a copy of the example ``tiny`` model only."""
    repo = tmp / "models"
    repo.mkdir()
    shutil.copytree(REPO / "tiny", repo / "tiny", symlinks=True)
    return repo


def start_logged_server(
    repo: Path, log: Path, *args: str, core: str = "0", env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], int, int]:
    """Start pdserve on 127.0.0.1 serving ``repo``, pinned to ``core``, its output in
    ``log``, with ``env`` added to this process's environment; wait until it is ready.

    Returns:
        (process, HTTP port, gRPC port).

    Raises:
        RuntimeError: it exited (with the end of its log) or was not ready in 120 s.
    """
    http_port, grpc_port = free_port(), free_port()
    cmd = pdserve_command(
        repo, http_port, grpc_port, free_port(), "--host", "127.0.0.1", *args, core=core
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
    wait_ready(proc, http_port, log, "pdserve", 0.1, tail=3000)
    return proc, http_port, grpc_port


def success_count(http_port: int, model: str = "tiny") -> int:
    """The server's successful inference count of ``model`` (statistics extension)."""
    url = f"http://127.0.0.1:{http_port}/v2/models/{model}/stats"
    with urllib.request.urlopen(url, timeout=10) as r:
        doc = json.load(r)
    return sum(int(m["inference_stats"]["success"]["count"]) for m in doc["model_stats"])


def proc_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads), from /proc; 0.0 once
    it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and of every live descendant."""
    return sum(proc_cpu_seconds(p) for p in [pid, *descendants(pid)])


def write_post_lua(tmp: Path, body: Any, headers: dict[str, str] | None = None) -> Path:
    """``tmp/post.lua``: a wrk script POSTing ``body`` (JSON, written to ``tmp/body.json``)
    with ``Content-Type: application/json`` and ``headers``."""
    data = tmp / "body.json"
    data.write_text(json.dumps(body))
    lua = tmp / "post.lua"
    lua.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        + "".join(f'wrk.headers["{k}"] = "{v}"\n' for k, v in (headers or {}).items())
        + f'local f = io.open("{data}", "rb")\n'
        'wrk.body = f:read("*all")\n'
        "f:close()\n"
    )
    return lua


def wrk_latency_ms(text: str, label: str) -> float | None:
    """The latency wrk's ``--latency`` output gives for ``label`` (``50%``, ``99%``), in
    ms; None when absent."""
    m = re.search(rf"^\s+{label}\s+([\d.]+)(us|ms|s)\s*$", text, re.M)
    if not m:
        return None
    return round(float(m.group(1)) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[m.group(2)], 3)


def run_wrk(
    port: int, lua: Path, seconds: int, connections: int, core: str | None = "1"
) -> dict[str, float | int | None]:
    """``wrk -t1 -cC -dDs --latency -s lua`` against ``tiny`` on ``port``, pinned to
    ``core`` (None: not pinned).

    Returns:
        ``rps``, ``requests``, ``p50_ms``, ``p99_ms``, ``non_2xx`` and ``socket_errors``
        (wrk's line, None when it had none).

    Raises:
        subprocess.CalledProcessError: wrk failed.
    """
    cmd = [
        *taskset(core), "wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--latency",
        "-s", str(lua), f"http://127.0.0.1:{port}/v2/models/tiny/infer",
    ]  # fmt: skip
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout

    def ms(label: str) -> float | None:
        return wrk_latency_ms(text, label)

    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    total = re.search(r"(\d+) requests in", text)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    errors = re.search(r"Socket errors:.*", text)
    return {
        "rps": float(rps.group(1)) if rps else None,
        "requests": int(total.group(1)) if total else 0,
        "p50_ms": ms("50%"),
        "p99_ms": ms("99%"),
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": errors.group(0) if errors else None,  # type: ignore[dict-item]
    }


def perf_analyzer_command(venv: Path, hint: str = "") -> tuple[list[str], dict[str, str]]:
    """Triton's perf_analyzer from ``venv`` and the environment it needs (ANCHORS.md: the
    binary of the tritonclient 2.50.0 wheel; libb64/libcudart copied from
    nvidia-pytriton's hashed libraries under their plain names, into ``venv/palibs``).

    Raises:
        RuntimeError: the venv has no perf_analyzer (``make bench-perf-tool`` makes it;
            ``hint`` is added to the message).
    """
    binary = venv / "bin" / "perf_analyzer"
    if not binary.exists():
        raise RuntimeError(f"{binary} is missing: run `make bench-perf-tool`{hint}")
    libs = venv / "palibs"
    if not (libs / "libcudart.so.12").exists():
        site = next((venv / "lib").glob("python3*/site-packages"))
        bundled = site / "nvidia_pytriton.libs"
        libs.mkdir(exist_ok=True)
        shutil.copy(next(bundled.glob("libb64-*.so.0d")), libs / "libb64.so.0d")
        shutil.copy(next(bundled.glob("libcudart-*.so.12*")), libs / "libcudart.so.12")
    return [str(binary)], {"LD_LIBRARY_PATH": str(libs)}


def parse_pa_csv(path: Path, rps_digits: int | None = 1) -> dict[str, float | None]:
    """Throughput (``rps``, rounded to ``rps_digits``; None: not rounded) and p50/p99 (ms)
    from perf_analyzer's ``-f`` CSV (None when it reported nothing, e.g. no stable
    measurement)."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError:
        rows = []
    if not rows:
        return {"rps": None, "p50_ms": None, "p99_ms": None}
    r = rows[-1]
    rps = float(r["Inferences/Second"])
    return {
        "rps": rps if rps_digits is None else round(rps, rps_digits),
        "p50_ms": round(float(r["p50 latency"]) / 1000, 3),
        "p99_ms": round(float(r["p99 latency"]) / 1000, 3),
    }
