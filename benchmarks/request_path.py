"""The pdserve files whose code runs for one HTTP infer and for one gRPC ModelInfer on an
ONNX model, in call order, leaving out code that also runs on an idle server (timers,
pollers), and the re-entries among them (a file entered, left and entered again).

How: a real ``pdserve serve`` (native transports unless told; 127.0.0.1, free ports)
on a copy of the example ``tiny`` model runs in a child process that installs a profile
hook (``sys.setprofile`` and ``threading.setprofile``) before pdserve's own entry point
starts; pdserve's code is not changed. After warm-up requests the parent opens a
recording window through a control pipe, sends one request (a V2 JSON infer over a
kept-alive HTTP connection, or a ``tritonclient.grpc`` ModelInfer on a warm channel),
waits for its answer and a short grace, and closes the window; an idle window of the
same length follows, and the pair repeats (``--rounds``). A function counts when it is
entered (called, or a generator or coroutine resumed) in every request window and in
no idle window; a file counts when one of its functions counts, or when its code calls
one that does. Files are listed in the order they were first entered.

Re-entry is a cycle in the request's cross-file call graph: an edge A -> B when code
in file A calls code in file B. The caller of a frame is the nearest pdserve frame
below it on its thread's stack; the walk stops at the event loop's own frames
(asyncio, uvloop), so a coroutine resumed or a callback run by the loop has no
caller, nor has a function run on a thread pool. ``server.py -> repository/rollout.py
-> server.py`` is a re-entry of ``server.py``.

Usage::

    .venv/bin/python benchmarks/request_path.py
    .venv/bin/python benchmarks/request_path.py --json --rounds 3
    .venv/bin/python benchmarks/request_path.py --http-server asgi --grpc-server aio

Paths are relative to ``pdserve/``. ``tests/integration/test_request_path.py`` keeps
the counts and cycles from growing back.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from http.client import HTTPConnection
from pathlib import Path
from typing import Any

from common import ROOT, cli_parser, free_port, pdserve_command, stop_process, tiny_repo

MODEL = "tiny"
#: the longest one control-pipe answer, one request or the start-up may take (seconds)
REPLY_SECS = 30.0
READY_SECS = 120.0
#: one recording window's events, in first-seen order: ``["enter", file, function, line]``
#: and ``["call", caller file, file, function, line]``
Window = list[list[Any]]

# Runs in the child as ``python -c BOOTSTRAP CMD_FD REPLY_FD serve ...``: installs the
# hook, starts the control thread, then runs ``python -m pdserve serve ...``.
BOOTSTRAP = r"""
import asyncio, itertools, json, os, runpy, sys, threading
try:
    import uvloop
    _LOOP_DIRS = (os.path.dirname(asyncio.__file__), os.path.dirname(uvloop.__file__))
except ImportError:
    _LOOP_DIRS = (os.path.dirname(asyncio.__file__),)
_PKG = os.path.join(os.getcwd(), "pdserve") + os.sep
_LOOP = object()
_names = {}
_seen = {}
_on = False
_tick = itertools.count()


def _name(filename):
    # a pdserve file's path under pdserve/, _LOOP for the event loop's files, else None
    name = _names.get(filename, 0)
    if name == 0:
        path = os.path.abspath(filename)
        if path.startswith(_PKG):
            name = path[len(_PKG):]
        elif path.startswith(tuple(d + os.sep for d in _LOOP_DIRS)):
            name = _LOOP
        else:
            name = None
        _names[filename] = name
    return name


def _hook(frame, event, arg):
    # first entry of each pdserve function, and of each (caller file, function) pair
    if not _on or event != "call":
        return
    code = frame.f_code
    callee = _name(code.co_filename)
    if callee is None or callee is _LOOP:
        return
    function = (callee, code.co_qualname, code.co_firstlineno)
    back = frame.f_back
    while back is not None:
        caller = _name(back.f_code.co_filename)
        if caller is _LOOP:
            break
        if caller is not None:
            if caller != callee and (caller, function) not in _seen:
                _seen[(caller, function)] = next(_tick)
            break
        back = back.f_back
    if function not in _seen:
        _seen[function] = next(_tick)


def _control(cmd_fd, reply_fd):
    global _on
    with os.fdopen(cmd_fd, "r") as commands, os.fdopen(reply_fd, "w") as replies:
        for line in commands:
            if line.strip() == "start":
                _seen.clear()
                _on = True
                replies.write("{}\n")
            else:
                _on = False
                seen = _seen.copy()
                events = [
                    ["enter", *e] if len(e) == 3 else ["call", e[0], *e[1]]
                    for e in sorted(seen, key=seen.__getitem__)
                ]
                replies.write(json.dumps(events) + "\n")
            replies.flush()


threading.Thread(
    target=_control, args=(int(sys.argv[1]), int(sys.argv[2])), daemon=True
).start()
sys.argv = ["pdserve", *sys.argv[3:]]
sys.path.insert(0, os.getcwd())
threading.setprofile(_hook)
sys.setprofile(_hook)
runpy.run_module("pdserve", run_name="__main__", alter_sys=True)
"""


class Child:
    """The hooked server process and its control pipe."""

    def __init__(self, repo: Path, log: Path, *args: str) -> None:
        self.http_port, self.grpc_port = free_port(), free_port()
        cmd = pdserve_command(
            repo, self.http_port, self.grpc_port, free_port(), "--host", "127.0.0.1", *args
        )
        cmd_r, self._cmd_w = os.pipe()
        self._reply_r, reply_w = os.pipe()
        at = cmd.index("-m")
        cmd[at : at + 2] = ["-c", BOOTSTRAP, str(cmd_r), str(reply_w)]
        self.log = log
        with open(log, "wb") as out:
            self.proc: subprocess.Popen[bytes] = subprocess.Popen(
                cmd,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                pass_fds=(cmd_r, reply_w),
            )
        os.close(cmd_r)
        os.close(reply_w)
        self._buffer = b""

    def wait_ready(self) -> None:
        """Poll ``/v2/models/tiny/ready`` until it answers 200 (at most READY_SECS)."""
        deadline = time.monotonic() + READY_SECS
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve exited:\n{self.log.read_text()[-3000:]}")
            try:
                conn = HTTPConnection("127.0.0.1", self.http_port, timeout=2)
                try:
                    conn.request("GET", f"/v2/models/{MODEL}/ready")
                    if conn.getresponse().status == 200:
                        return
                finally:
                    conn.close()
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"pdserve not ready in {READY_SECS:.0f} s")

    def command(self, word: str) -> Any:
        """Send ``start`` or ``stop`` to the hook; its JSON answer."""
        os.write(self._cmd_w, word.encode() + b"\n")
        deadline = time.monotonic() + REPLY_SECS
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._reply_r], [], [], left)[0]:
                raise RuntimeError(f"no answer to {word!r} from the hook in {REPLY_SECS} s")
            chunk = os.read(self._reply_r, 1 << 16)
            if not chunk:
                raise RuntimeError(f"the hook closed its pipe:\n{self.log.read_text()[-3000:]}")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        """Close the pipes and stop the server (SIGTERM by PID, SIGKILL after 30 s)."""
        for fd in (self._cmd_w, self._reply_r):
            os.close(fd)
        stop_process(self.proc)


def http_sender(port: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(one V2 JSON infer over a kept-alive connection, close it)."""
    conn = HTTPConnection("127.0.0.1", port, timeout=REPLY_SECS)
    body = json.dumps(
        {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]}
    ).encode()

    def send() -> None:
        conn.request(
            "POST",
            f"/v2/models/{MODEL}/infer",
            body=body,
            headers={"Content-Type": "application/json"},
        )
        answer = conn.getresponse()
        data = answer.read()
        if answer.status != 200 or b"OUTPUT0" not in data:
            raise RuntimeError(f"HTTP infer failed: {answer.status} {data[:300]!r}")

    return send, conn.close


def grpc_sender(port: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(one ``tritonclient.grpc`` ModelInfer on a warm channel, close it)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    tensor = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
    tensor.set_data_from_numpy(np.full((1, 64), 0.5, np.float32))

    def send() -> None:
        result = client.infer(MODEL, [tensor], client_timeout=REPLY_SECS)
        if result.as_numpy("OUTPUT0") is None:
            raise RuntimeError("gRPC ModelInfer returned no OUTPUT0")

    return send, client.close


def measure(
    child: Child, send: Callable[[], None], rounds: int, warmup: int, grace: float
) -> dict[str, Any]:
    """Record ``rounds`` request windows, each followed by an idle one as long."""
    for _ in range(warmup):
        send()
    requests: list[Window] = []
    idles: list[Window] = []
    for _ in range(rounds):
        time.sleep(grace)
        t0 = time.monotonic()
        child.command("start")
        send()
        time.sleep(grace)
        requests.append(child.command("stop"))
        window = time.monotonic() - t0
        t0 = time.monotonic()
        child.command("start")
        time.sleep(max(0.0, window - (time.monotonic() - t0)))
        idles.append(child.command("stop"))
    return path_of(requests, idles)


def path_of(requests: list[Window], idles: list[Window]) -> dict[str, Any]:
    """The request path from the request windows' events and the idle windows'.

    A function counts when it is entered in every request window and in no idle window;
    a file counts when one of its functions counts, or when its code calls one that
    counts (a loop that was running before the window opened is never entered in it).
    Files come in the order of the first window; edges are the counted calls.
    """

    def entered(window: Window) -> set[tuple[Any, ...]]:
        return {tuple(e[1:]) for e in window if e[0] == "enter"}

    idle = set().union(*(entered(w) for w in idles))
    counted = set.intersection(*(entered(w) for w in requests)) - idle
    every_call = set.intersection(*({tuple(e[1:]) for e in w if e[0] == "call"} for w in requests))
    files: list[str] = []
    edges: list[tuple[str, str]] = []
    for event in requests[0]:
        kind, function = event[0], tuple(event[-3:])
        if function not in counted:
            continue
        if kind == "call" and tuple(event[1:]) in every_call:
            if event[1] not in files:
                files.append(event[1])
            if (event[1], event[2]) not in edges:
                edges.append((event[1], event[2]))
        if kind == "enter" and event[1] not in files:
            files.append(event[1])
    ran = {e[1] for w in requests for e in w if e[0] == "enter"}
    return {
        "count": len(files),
        "files": files,
        "cycles": cycles(files, edges),
        "edges": [list(e) for e in edges],
        "functions": sorted(f"{f}:{line} {name}" for f, name, line in counted),
        "idle_files": sorted(({f for f, _, _ in idle} & ran) - set(files)),
        "unsteady_files": sorted(ran - {f for f, _, _ in idle} - set(files)),
    }


def cycles(
    nodes: Iterable[str], edges: Iterable[tuple[str, str]], limit: int = 1000
) -> list[list[str]]:
    """The elementary cycles of a directed graph, each once, starting at its node that
    comes first in ``nodes`` (at most ``limit``): ``[a, b, a]`` for a -> b -> a."""
    rank = {n: i for i, n in enumerate(nodes)}
    after: dict[str, list[str]] = {n: [] for n in rank}
    for a, b in edges:
        after[a].append(b)
    found: list[list[str]] = []
    for start in rank:
        stack = [(start, iter(after[start]))]
        path, on_path = [start], {start}
        while stack and len(found) < limit:
            step = next(stack[-1][1], None)
            if step is None:
                stack.pop()
                on_path.discard(path.pop())
            elif step == start:
                found.append([*path, start])
            elif step not in on_path and rank[step] > rank[start]:
                stack.append((step, iter(after[step])))
                path.append(step)
                on_path.add(step)
    return found


def report(name: str, result: dict[str, Any]) -> str:
    """The text form of one protocol's result."""
    lines = [f"{name}: {result['count']} pdserve files"]
    lines += [f"  {i:2d} {f}" for i, f in enumerate(result["files"], 1)]
    lines.append(f"  re-entry cycles: {len(result['cycles'])}")
    lines += ["    " + " -> ".join(c) for c in result["cycles"]]
    if result["idle_files"]:
        lines.append(
            "  left out (only code that also runs on an idle server): "
            + ", ".join(result["idle_files"])
        )
    if result["unsteady_files"]:
        lines.append(
            "  left out (not in every request window): " + ", ".join(result["unsteady_files"])
        )
    return "\n".join(lines)


def main() -> int:
    parser = cli_parser(__doc__, __file__)
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--http-server",
        choices=("native", "asgi"),
        default="native",
        help="the server's HTTP transport (default native, the server's own default)",
    )
    parser.add_argument(
        "--grpc-server",
        choices=("native", "threads", "aio"),
        default="native",
        help="the server's gRPC server (default native, the server's own default)",
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="request windows per protocol (default 5)"
    )
    parser.add_argument(
        "--warmup", type=int, default=20, help="requests before the first window (default 20)"
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=0.1,
        help="seconds a window stays open after the answer (default 0.1)",
    )
    args = parser.parse_args()
    if args.rounds < 1 or args.warmup < 0 or args.grace < 0:
        parser.error("--rounds must be at least 1, --warmup and --grace not negative")
    with tempfile.TemporaryDirectory(prefix="pdserve-request-path-") as tmp:
        transports = ("--http-server", args.http_server, "--grpc-server", args.grpc_server)
        child = Child(tiny_repo(Path(tmp)), Path(tmp) / "server.log", *transports)
        try:
            child.wait_ready()
            results = {}
            for name, make in (("http", http_sender), ("grpc", grpc_sender)):
                send, close = make(child.http_port if name == "http" else child.grpc_port)
                try:
                    results[name] = measure(child, send, args.rounds, args.warmup, args.grace)
                finally:
                    close()
        finally:
            child.close()
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        print(report(f"HTTP infer (V2 JSON, {args.http_server})", results["http"]))
        print(report(f"gRPC ModelInfer (tritonclient.grpc, {args.grpc_server})", results["grpc"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
