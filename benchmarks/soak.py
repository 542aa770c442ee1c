"""Issue 10 soak: the image pipeline at ~80 % of its capacity, with bad requests and killed workers.

pdserve serves the example repository (``examples/model_repository``, built by
``examples/build.py``). The load is on ``image_classifier`` (raw JPEG bytes in, top-5
labels and confidences out), one image per request, over HTTP with the binary tensor
extension for the input and JSON outputs. Steps:

1. **Capacity**: a short closed-loop ramp (good requests only, concurrency 1, 2, 4,
   8, 16, 32; ``--ramp-secs`` each); the capacity is the best rate of correct answers.
2. **Soak** (``--minutes``, default 10): an *open-loop* constant rate of ``--load``
   (default 0.8) x capacity: request *i* is sent at ``start + i / rate`` whether or not
   earlier ones have been answered. Every ``--bad-every``-th request (default 100:
   1 %) is a bad one, cycling through :data:`BAD_KINDS` (corrupt or empty images, a
   decompression-bomb header, wrong datatypes and shapes, malformed JSON, a wrong
   binary size). Once a minute (at 30 s, 90 s, ...) one python-backend worker process
   is killed with SIGKILL, alternately ``preprocess`` and ``postprocess``; its
   restart is timed from the server log (``restarted <instance> (worker pid N)``).
   Every ``--sample-secs`` (default 5) the RSS, PSS and open fds of the server and all
   its descendants (fork server, resource tracker, every worker) are sampled, with the
   load average and the kernel's CPU and memory pressure (``/proc/pressure``: on a
   shared machine, what else slowed everything down) and the CPU time of the server's
   tree: per minute, the cores it got and its CPU milliseconds per answer (steady per
   answer with fewer cores = the server starved of CPU by others, not slower). Two
   series separate what is expected to move from leaks: the RSS outside the python
   backend's shared-memory arenas (pools that keep their high-water size) and the
   server's fds other than its HTTP connections.
3. The server is stopped with SIGTERM; any process of its tree still alive 2 s after
   it exited is reported (and killed).

Every request is accounted for:

- a good request must answer 200 with the golden top-5 of its image (PyTorch's, from
  ``examples/goldens/image_classifier.npz``; neighbours whose confidences tie within
  1e-3 may swap, as in ``tests/integration/test_pipelines.py``), or a 5xx that comes
  from a killed worker: it overlaps a restart window (the kill until 1 s after the
  restart) and its message says the worker died or is unavailable. Any other 5xx,
  any 4xx, and any 200 with another answer is a failure;
- a bad request must answer 400, or a 5xx from a killed worker as above (a bad image
  batched into the worker's last ``execute`` call dies with it before it is judged);
- *lost* = no HTTP answer at all (connection reset, client timeout ``--timeout``):
  there must be none.

Latency is measured from the time a request was *scheduled* (open loop: client-side
delays count against the server), per minute of the soak (p50, p99, max).

Usage::

    .venv/bin/python benchmarks/soak.py [--minutes 10] [--load 0.8] [--bad-every 100]
        [--kill-every 60] [--sample-secs 5] [--ramp-secs 6] [--connections 64]
        [--out benchmarks/out/soak.json]

Writes every figure as JSON to ``--out`` (the server log next to it) and prints a
Markdown summary. Bounded: the ramp and the soak run for fixed times, at most
``rate x duration`` requests are sent, at most ``--max-in-flight`` are outstanding
(requests over it are counted as *not sent*), and each waits ``--timeout`` s at most.
The server listens on 127.0.0.1 and is stopped by pid at the end, on Ctrl-C, SIGTERM
and errors. Exit status 0 when nothing was lost and nothing failed, else 1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from common import (
    GOLDENS,
    REPO,
    ROOT,
    cli_parser,
    descendants,
    free_port,
    interrupt_on_sigterm,
    pdserve_command,
    pressure,
    slope,
    stop_process,
    tcp_connections,
    tree_stats,
    wait_ready,
)

MODEL = "image_classifier"
INPUT = "input_image_bytes"
#: Python-backend instances killed in turn, one per ``--kill-every`` seconds.
KILL_TARGETS = ("preprocess_0_0", "postprocess_0_0")
#: Substrings of the messages a request caught in a killed worker gets.
RESTART_MESSAGES = ("worker process of python model instance", "could not be restarted")


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True)
class Request:
    """One prepared HTTP request: ``kind`` names it, ``golden`` is the row of the golden
    top-5 it must answer (None: a bad request, which must answer 400)."""

    kind: str
    body: bytes
    headers: dict[str, str]
    golden: int | None


def bytes_element(data: bytes) -> bytes:
    """One BYTES element in the binary tensor extension (uint32 LE length + bytes)."""
    return struct.pack("<I", len(data)) + data


def v2_binary(datatype: str, shape: list[int], raw: bytes, size: int | None = None) -> Request:
    """A request whose one input travels in the binary extension (outputs come as JSON);
    ``size`` overrides the declared ``binary_data_size``."""
    header = {
        "inputs": [
            {
                "name": INPUT,
                "datatype": datatype,
                "shape": shape,
                "parameters": {"binary_data_size": len(raw) if size is None else size},
            }
        ]
    }
    head = json.dumps(header).encode()
    headers = {
        "Content-Type": "application/octet-stream",
        "Inference-Header-Content-Length": str(len(head)),
    }
    return Request("", head + raw, headers, None)


def image_request(images: list[bytes], kind: str, golden: int | None) -> Request:
    """``images`` as one ``[N, 1]`` BYTES request."""
    r = v2_binary("BYTES", [len(images), 1], b"".join(bytes_element(i) for i in images))
    return Request(kind, r.body, r.headers, golden)


def png_header(width: int, height: int) -> bytes:
    """A ~100-byte PNG whose header declares ``width x height`` pixels (a decompression
    bomb refused from its header)."""
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 10))
        + chunk(b"IEND", b"")
    )


#: The bad requests, in the order they are sent (each must answer 400).
BAD_KINDS = (
    "truncated_jpeg",
    "not_an_image",
    "empty_image",
    "png_bomb_header",
    "good_and_corrupt_in_one_request",
    "fp32_json_for_bytes",
    "int32_binary_for_bytes",
    "wrong_shape",
    "malformed_json",
    "binary_size_too_large",
)


def bad_requests(jpeg: bytes) -> list[Request]:
    """One request of each of :data:`BAD_KINDS`, made from the valid ``jpeg``."""
    json_headers = {"Content-Type": "application/json"}
    fp32 = {"inputs": [{"name": INPUT, "datatype": "FP32", "shape": [1, 1], "data": [1.5]}]}
    made = {
        "truncated_jpeg": image_request([jpeg[: len(jpeg) // 2]], "", None),
        "not_an_image": image_request([b"this is not an image"], "", None),
        "empty_image": image_request([b""], "", None),
        "png_bomb_header": image_request([png_header(13000, 13000)], "", None),
        "good_and_corrupt_in_one_request": image_request(
            [jpeg, b"\x89PNG\r\n\x1a\n broken"], "", None
        ),
        "fp32_json_for_bytes": Request("", json.dumps(fp32).encode(), json_headers, None),
        "int32_binary_for_bytes": v2_binary("INT32", [1, 1], struct.pack("<i", 7)),
        "wrong_shape": v2_binary("BYTES", [1, 2], bytes_element(jpeg) + bytes_element(jpeg)),
        "malformed_json": Request(
            "", b'{"inputs": [{"name": "input_image_bytes", "datatype": ', json_headers, None
        ),
        "binary_size_too_large": v2_binary(
            "BYTES", [1, 1], bytes_element(jpeg), size=len(jpeg) + 4 + 1000
        ),
    }
    return [Request(k, made[k].body, made[k].headers, None) for k in BAD_KINDS]


@dataclass
class Goldens:
    """The golden images and their top-5 (``examples/goldens/image_classifier.npz``)."""

    names: list[str]
    jpegs: list[bytes]
    labels: list[list[str]]
    confidences: np.ndarray  # FP32 [images, 5]

    @classmethod
    def load(cls) -> Goldens:
        data = np.load(GOLDENS / "image_classifier.npz")
        names = [str(n) for n in data["names"]]
        return cls(
            names,
            [data[f"image_bytes_{n}"].tobytes() for n in names],
            [[str(x) for x in row] for row in data["top5_labels"]],
            data["top5_confidences"],
        )

    def matches(self, row: int, labels: list[str], confidences: list[float]) -> bool:
        """The same top-5 as PyTorch (confidences within 1e-3; neighbours whose
        confidences tie within 1e-3 may swap)."""
        want, conf = self.labels[row], self.confidences[row]
        if len(labels) != 5 or len(confidences) != 5:
            return False
        if not np.allclose(np.asarray(confidences, np.float32), conf, atol=1e-3):
            return False
        for i, (g, w) in enumerate(zip(labels, want, strict=True)):
            if g != w:
                j = want.index(g) if g in want else -1
                if abs(j - i) != 1 or abs(conf[i] - conf[j]) >= 1e-3:
                    return False
        return True


# --------------------------------------------------------------------------- the client


@dataclass
class Outcome:
    """What happened to one request (times: ``time.monotonic()`` seconds)."""

    kind: str
    good: bool
    scheduled: float
    sent: float
    done: float
    status: int  # 0: no HTTP answer
    verdict: str  # ok, wrong_answer, bad_400, bad_not_400, good_4xx, good_5xx, lost
    message: str = ""


async def send(
    session: Any, url: str, req: Request, goldens: Goldens, scheduled: float, timeout: float
) -> Outcome:
    """Send ``req`` and judge its answer (never raises, except on cancellation)."""
    import aiohttp

    sent = time.monotonic()
    good = req.golden is not None
    try:
        async with session.post(
            url, data=req.body, headers=req.headers, timeout=aiohttp.ClientTimeout(total=timeout)
        ) as resp:
            status = resp.status
            body = await resp.read()
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return Outcome(req.kind, good, scheduled, sent, time.monotonic(), 0, "lost", repr(e))
    done = time.monotonic()
    text = body[:300].decode(errors="replace")
    if not good:
        verdict = "bad_400" if status == 400 else "bad_not_400"
        return Outcome(req.kind, good, scheduled, sent, done, status, verdict, text)
    if status != 200:
        verdict = "good_5xx" if status >= 500 else "good_4xx"
        return Outcome(req.kind, good, scheduled, sent, done, status, verdict, text)
    try:
        outputs = {o["name"]: o["data"] for o in json.loads(body)["outputs"]}
        right = goldens.matches(
            req.golden or 0, outputs["top5_labels"], outputs["top5_confidences"]
        )
    except (ValueError, KeyError, TypeError):
        right = False
    if right:
        return Outcome(req.kind, good, scheduled, sent, done, status, "ok")
    return Outcome(req.kind, good, scheduled, sent, done, status, "wrong_answer", text)


def new_session(limit: int) -> Any:
    """An aiohttp session with up to ``limit`` keep-alive connections (kept idle 10 s
    at most: well under the server's idle timeout, so the server never closes a
    connection the client is about to reuse). Requests beyond ``limit`` wait in the
    client for a free connection (the wait counts in their latency)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=limit, keepalive_timeout=10)
    return aiohttp.ClientSession(connector=connector)


async def closed_loop(
    url: str, good: list[Request], goldens: Goldens, concurrency: int, seconds: float
) -> dict[str, Any]:
    """``concurrency`` clients sending good requests back to back for ``seconds``
    (after 1 s unmeasured); the rate of correct answers received in those seconds
    and their latency."""
    lat: list[float] = []
    failures = 0
    async with new_session(concurrency) as session:
        start = time.monotonic()
        warm, end = start + 1.0, start + 1.0 + seconds

        async def client(k: int) -> None:
            nonlocal failures
            i = k
            while time.monotonic() < end:
                o = await send(session, url, good[i % len(good)], goldens, time.monotonic(), 60)
                i += concurrency
                if warm <= o.done <= end:  # answers in the window, whenever sent
                    if o.verdict == "ok":
                        lat.append(o.done - o.sent)
                    else:
                        failures += 1

        await asyncio.gather(*(client(k) for k in range(concurrency)))
    ms = np.asarray(lat or [0.0]) * 1000
    return {
        "concurrency": concurrency,
        "rps": round(len(lat) / seconds, 1),
        "p50_ms": round(float(np.percentile(ms, 50)), 1),
        "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "failures": failures,
    }


# --------------------------------------------------------------------------- worker kills


def worker_pid(server_pid: int, instance: str) -> int | None:
    """The worker process of python model ``instance``: the descendant of the server that
    maps the instance's shared-memory arenas (``/memfd:pdserve:<instance>.in.N``)."""
    needle = f"memfd:pdserve:{instance}."
    for pid in descendants(server_pid):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps") as f:
            if needle in f.read():
                return pid
    return None


@dataclass
class Kill:
    """One SIGKILL of a worker and its restart (seconds from the soak's start)."""

    instance: str
    pid: int | None
    at: float
    restarted_at: float | None = None
    new_pid: int | None = None


async def kill_worker(server_pid: int, instance: str, log: Path, t0: float) -> Kill:
    """SIGKILL the worker of ``instance`` and wait (30 s at most) for the server log to
    say it was restarted."""
    pid = None
    for _ in range(50):  # the worker maps its arenas once it has served a request
        pid = worker_pid(server_pid, instance)
        if pid is not None:
            break
        await asyncio.sleep(0.1)
    offset = log.stat().st_size
    kill = Kill(instance, pid, time.monotonic() - t0)
    if pid is None:
        return kill
    os.kill(pid, signal.SIGKILL)
    pattern = re.compile(rf"restarted {re.escape(instance)} \(worker pid (\d+)\)")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with open(log, "rb") as f:
            f.seek(offset)
            m = pattern.search(f.read().decode(errors="replace"))
        if m:
            kill.restarted_at = time.monotonic() - t0
            kill.new_pid = int(m.group(1))
            break
        await asyncio.sleep(0.02)
    return kill


# --------------------------------------------------------------------------- the soak


@dataclass
class Soak:
    """The open-loop run's raw results."""

    rate: float
    t0: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    not_sent: int = 0
    kills: list[Kill] = field(default_factory=list)
    samples: list[dict[str, Any]] = field(default_factory=list)


async def run_soak(
    args: argparse.Namespace,
    url: str,
    server_pid: int,
    port: int,
    log: Path,
    good: list[Request],
    bad: list[Request],
    goldens: Goldens,
    rate: float,
) -> Soak:
    """Open-loop load at ``rate`` requests/s for ``args.minutes``, with kills and samples."""
    soak = Soak(rate)
    seconds = args.minutes * 60
    total = int(rate * seconds)
    pending: set[asyncio.Task[Outcome]] = set()
    soak.t0 = t0 = time.monotonic() + 0.5

    def sample() -> None:
        s = tree_stats(server_pid)
        s["t"] = round(time.monotonic() - t0, 2)
        s["loadavg_1m"] = os.getloadavg()[0]
        s["in_flight"] = len(pending)
        s["http_connections"] = tcp_connections(port)
        s["pressure"] = pressure()
        soak.samples.append(s)

    async def sampler() -> None:
        while time.monotonic() < t0 + seconds:
            await asyncio.to_thread(sample)
            await asyncio.sleep(args.sample_secs)

    async def killer() -> None:
        k, last = 0, -float("inf")
        while True:  # on schedule, but never two kills closer than half the period
            at = max(t0 + args.kill_every / 2 + k * args.kill_every, last + args.kill_every / 2)
            if at >= t0 + seconds:
                return
            await asyncio.sleep(max(0.0, at - time.monotonic()))
            target = KILL_TARGETS[k % len(KILL_TARGETS)]
            soak.kills.append(await kill_worker(server_pid, target, log, t0))
            last = time.monotonic()
            k += 1

    def finished(task: asyncio.Task[Outcome]) -> None:
        pending.discard(task)
        if not task.cancelled():
            soak.outcomes.append(task.result())

    async with new_session(args.connections) as session:
        side = [asyncio.create_task(sampler()), asyncio.create_task(killer())]
        n_bad = 0
        for i in range(total):
            scheduled = t0 + i / rate
            await asyncio.sleep(max(0.0, scheduled - time.monotonic()))
            if len(pending) >= args.max_in_flight:
                soak.not_sent += 1
                continue
            if i % args.bad_every == args.bad_every // 2:
                req = bad[n_bad % len(bad)]
                n_bad += 1
            else:
                req = good[i % len(good)]
            task = asyncio.create_task(send(session, url, req, goldens, scheduled, args.timeout))
            pending.add(task)
            task.add_done_callback(finished)
        await asyncio.gather(*side)
        if pending:  # each ends by its own timeout
            await asyncio.wait(set(pending))
    await asyncio.to_thread(sample)
    return soak


# --------------------------------------------------------------------------- the report


def in_restart_window(o: Outcome, soak: Soak) -> Kill | None:
    """The kill whose window (the kill until 1 s after the restart) ``o`` overlaps; of
    those, the one whose instance ``o``'s error message names, if any does."""
    overlapping = []
    for k in soak.kills:
        start = soak.t0 + k.at
        end = soak.t0 + (k.restarted_at if k.restarted_at is not None else k.at + 30) + 1.0
        if o.sent <= end and o.done >= start:
            overlapping.append(k)
    named = [k for k in overlapping if f"'{k.instance}'" in o.message]
    return (named or overlapping or [None])[0]


def cpu_use(soak: Soak, samples: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """Between the first and the last of ``samples``: the CPU cores the server's tree
    used, and its CPU milliseconds per answered request (None, None: fewer than 2 samples).
    A steady cost per answer with fewer cores means the server was starved of CPU,
    not slower."""
    if len(samples) < 2 or "cpu_s" not in samples[0]:
        return None, None
    a, b = samples[0], samples[-1]
    cpu = b["cpu_s"] - a["cpu_s"]
    lo, hi = soak.t0 + a["t"], soak.t0 + b["t"]
    answered = sum(1 for o in soak.outcomes if o.status and lo <= o.done < hi)
    per = round(1000 * cpu / answered, 1) if answered else None
    return round(cpu / max(b["t"] - a["t"], 1e-9), 2), per


def summarize(soak: Soak, ramp: list[dict[str, Any]], capacity: float, args: Any) -> dict[str, Any]:
    """Every figure of the run as one JSON-able object."""
    outs = soak.outcomes
    verdicts: dict[str, int] = {}
    for o in outs:
        verdicts[o.verdict] = verdicts.get(o.verdict, 0) + 1
    restart_5xx, other_failures = [], []
    for o in outs:
        if o.status >= 500:  # good, or bad and batched into the killed worker's last call
            k = in_restart_window(o, soak)
            if k is not None and any(m in o.message for m in RESTART_MESSAGES):
                restart_5xx.append((o, k))
                continue
        if o.verdict not in ("ok", "bad_400"):
            other_failures.append(o)
    bad_kinds: dict[str, dict[str, int]] = {}
    for o in outs:
        if not o.good:
            row = bad_kinds.setdefault(o.kind, {})
            row[str(o.status)] = row.get(str(o.status), 0) + 1
    minutes = []
    for m in range(int(args.minutes)):
        lo, hi = soak.t0 + 60 * m, soak.t0 + 60 * (m + 1)
        lat = [o.done - o.scheduled for o in outs if lo <= o.scheduled < hi and o.verdict == "ok"]
        ms = np.asarray(lat or [0.0]) * 1000
        in_minute = [s for s in soak.samples if 60 * m <= s["t"] < 60 * (m + 1)] or [{}]
        cores, cpu_ms = cpu_use(soak, in_minute)
        minutes.append(
            {
                "minute": m + 1,
                "sent": sum(1 for o in outs if lo <= o.scheduled < hi),
                "ok": len(lat),
                "p50_ms": round(float(np.percentile(ms, 50)), 1),
                "p99_ms": round(float(np.percentile(ms, 99)), 1),
                "max_ms": round(float(ms.max()), 1),
                "max_in_flight": max(s.get("in_flight", 0) for s in in_minute),
                "server_cores": cores,
                "cpu_ms_per_answer": cpu_ms,
                "loadavg_1m": round(float(np.mean([s.get("loadavg_1m", 0) for s in in_minute])), 2),
                "cpu_pressure_max": max(
                    s.get("pressure", {}).get("cpu_some", 0) for s in in_minute
                ),
                "memory_stall_max": max(
                    s.get("pressure", {}).get("memory_full", 0) for s in in_minute
                ),
            }
        )
    samples = soak.samples
    t_min = [s["t"] / 60 for s in samples]
    after = [i for i, s in enumerate(samples) if s["t"] >= 60]  # first minute: warm-up

    def trend(ys: list[float]) -> dict[str, float]:
        return {
            "first": ys[0],
            "last": ys[-1],
            "min": min(ys),
            "max": max(ys),
            "slope_per_min": round(slope(t_min, ys), 3),
            "slope_per_min_after_minute_1": round(
                slope([t_min[i] for i in after], [ys[i] for i in after]), 3
            ),
        }

    def server(key: str, scale: float = 1.0) -> list[float]:
        return [s["server"][key] / scale if s["server"] else float("nan") for s in samples]

    p99s = [m["p99_ms"] for m in minutes]
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "loadavg_start_end": [samples[0]["loadavg_1m"], samples[-1]["loadavg_1m"]],
            "loadavg_1m_median": float(np.median([s["loadavg_1m"] for s in samples])),
            "cpu_pressure_median": float(
                np.median([s.get("pressure", {}).get("cpu_some", 0) for s in samples])
            ),
        },
        "args": vars(args),
        "ramp": ramp,
        "capacity_rps": capacity,
        "rate_rps": round(soak.rate, 2),
        "requests": {
            "scheduled": len(outs) + soak.not_sent,
            "answered": sum(1 for o in outs if o.status != 0),
            "not_sent_over_max_in_flight": soak.not_sent,
            "lost_no_answer": verdicts.get("lost", 0),
            "good": sum(1 for o in outs if o.good),
            "good_ok": verdicts.get("ok", 0),
            "good_5xx_in_restart_window": sum(1 for o, _ in restart_5xx if o.good),
            "bad_5xx_in_restart_window": sum(1 for o, _ in restart_5xx if not o.good),
            "bad": sum(1 for o in outs if not o.good),
            "bad_400": verdicts.get("bad_400", 0),
            "failures": len(other_failures),
            "verdicts": verdicts,
        },
        "bad_statuses_by_kind": bad_kinds,
        "restart_5xx": [
            {
                "t": round(o.sent - soak.t0, 2),
                "kind": o.kind,
                "status": o.status,
                "instance": k.instance,
                "message": o.message[:200],
            }
            for o, k in restart_5xx
        ],
        "failures": [
            {
                "t": round(o.sent - soak.t0, 2),
                "kind": o.kind,
                "status": o.status,
                "verdict": o.verdict,
                "message": o.message[:300],
            }
            for o in other_failures[:50]
        ],
        "kills": [
            {
                "instance": k.instance,
                "pid": k.pid,
                "at_s": round(k.at, 2),
                "restart_s": None if k.restarted_at is None else round(k.restarted_at - k.at, 3),
                "new_pid": k.new_pid,
                "failed_5xx": sum(1 for _, kk in restart_5xx if kk is k),
            }
            for k in soak.kills
        ],
        "minutes": minutes,
        "p99_ms_max_over_median": round(max(p99s) / max(float(np.median(p99s)), 1e-9), 2),
        "resources": {
            "tree_rss_mib": trend([s["rss_mib"] for s in samples]),
            "tree_pss_mib": trend([s["pss_mib"] for s in samples]),
            "tree_rss_outside_shm_arenas_mib": trend(
                [s["rss_mib"] - s["shm_rss_mib"] for s in samples]
            ),
            "tree_fds": trend([s["fds"] for s in samples]),
            "server_rss_mib": trend(server("rss_kib", 1024)),
            "server_fds": trend(server("fds")),
            "server_fds_but_http_connections": trend(
                [f - s["http_connections"] for f, s in zip(server("fds"), samples, strict=True)]
            ),
            "server_threads": trend(server("threads")),
            "processes_below_server": trend([s["processes"] for s in samples]),
        },
        "samples": samples,
    }


def markdown(r: dict[str, Any]) -> str:
    """The Markdown summary of :func:`summarize`'s result."""
    q = r["requests"]
    lines = [
        f"Capacity (closed-loop ramp, best of c = 1..32): **{r['capacity_rps']} img/s**; "
        f"soak rate {r['rate_rps']} req/s for {r['args']['minutes']} min "
        f"(load average {r['machine']['loadavg_start_end'][0]:.2f} at start, "
        f"{r['machine']['loadavg_start_end'][1]:.2f} at end, median "
        f"{r['machine']['loadavg_1m_median']:.2f} on {r['machine']['cpus']} CPUs; CPU pressure "
        f"median {r['machine']['cpu_pressure_median']:.0f} %).",
        "",
        "| ramp c | img/s | p50 ms | p99 ms |",
        "|---|---|---|---|",
        *[
            f"| {x['concurrency']} | {x['rps']} | {x['p50_ms']} | {x['p99_ms']} |"
            for x in r["ramp"]
        ],
        "",
        f"- requests scheduled {q['scheduled']}, answered {q['answered']}, "
        f"**lost (no answer) {q['lost_no_answer']}**, not sent (over max in flight) "
        f"{q['not_sent_over_max_in_flight']}",
        f"- good {q['good']}: golden top-5 {q['good_ok']}, 5xx from a killed worker "
        f"{q['good_5xx_in_restart_window']}",
        f"- bad {q['bad']}: 400 {q['bad_400']}, 5xx from a killed worker "
        f"{q['bad_5xx_in_restart_window']}; by kind: "
        + ", ".join(f"{k} {v}" for k, v in r["bad_statuses_by_kind"].items()),
        f"- **other failures: {q['failures']}** (wrong answer, 4xx on a good request, "
        "5xx outside a restart window, non-400 for a bad request)",
        "- kills: "
        + ", ".join(
            f"{k['instance']} at {k['at_s']:.0f} s (restarted in {k['restart_s']} s, "
            f"{k['failed_5xx']} requests failed)"
            for k in r["kills"]
        ),
        "",
        "| minute | sent | golden | p50 ms | p99 ms | max ms | max in flight | server cores | "
        "CPU ms per answer | load avg | CPU pressure % | memory stall % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[
            f"| {m['minute']} | {m['sent']} | {m['ok']} | {m['p50_ms']} | {m['p99_ms']} | "
            f"{m['max_ms']} | {m['max_in_flight']} | {m['server_cores']} | "
            f"{m['cpu_ms_per_answer']} | {m['loadavg_1m']} | "
            f"{m['cpu_pressure_max']} | {m['memory_stall_max']} |"
            for m in r["minutes"]
        ],
        "",
        f"p99: highest minute / median minute = {r['p99_ms_max_over_median']}",
        "",
        "| resource (server + descendants) | first | last | min | max | slope /min | "
        "slope /min after minute 1 |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in r["resources"].items():
        lines.append(
            f"| {name} | {s['first']:.1f} | {s['last']:.1f} | {s['min']:.1f} | {s['max']:.1f} | "
            f"{s['slope_per_min']} | {s['slope_per_min_after_minute_1']} |"
        )
    orphans = r.get("orphans_after_stop")
    lines += ["", f"Processes of the server's tree alive after it stopped: {orphans}"]
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


async def run(args: argparse.Namespace, proc: subprocess.Popen[bytes], port: int, log: Path) -> Any:
    """The ramp, then the soak; returns the summary. SIGINT and SIGTERM cancel it."""
    main_task = asyncio.current_task()
    assert main_task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, main_task.cancel)
    url = f"http://127.0.0.1:{port}/v2/models/{MODEL}/infer"
    goldens = Goldens.load()
    good = [
        image_request([j], n, row)
        for row, (n, j) in enumerate(zip(goldens.names, goldens.jpegs, strict=True))
    ]
    bad = bad_requests(goldens.jpegs[goldens.names.index("coffee")])
    async with new_session(4) as session:  # every request answers as expected before the load
        for req in good + bad:
            o = await send(session, url, req, goldens, time.monotonic(), 60)
            if o.verdict not in ("ok", "bad_400"):
                raise RuntimeError(f"{req.kind}: {o.verdict} {o.status} {o.message}")
    ramp = []
    for c in args.ramp:
        ramp.append(await closed_loop(url, good, goldens, c, args.ramp_secs))
        print(f"ramp c={c}: {ramp[-1]}", flush=True)
    capacity = max(x["rps"] for x in ramp)
    rate = args.load * capacity
    print(f"capacity {capacity} img/s; soak at {rate:.1f} req/s for {args.minutes} min", flush=True)
    soak = await run_soak(args, url, proc.pid, port, log, good, bad, goldens, rate)
    return summarize(soak, ramp, capacity, args)


def main(argv: list[str] | None = None) -> int:
    """Run the soak and print its summary."""
    p = cli_parser(__doc__, __file__)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--load", type=float, default=0.8, help="share of the measured capacity")
    p.add_argument("--bad-every", type=int, default=100, help="one bad request in N")
    p.add_argument("--kill-every", type=float, default=60.0, help="seconds between two kills")
    p.add_argument("--sample-secs", type=float, default=5.0)
    p.add_argument(
        "--ramp", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32]
    )
    p.add_argument("--ramp-secs", type=float, default=6.0, help="measured seconds per ramp step")
    p.add_argument("--timeout", type=float, default=120.0, help="client timeout per request (s)")
    p.add_argument("--connections", type=int, default=64, help="HTTP connections at most")
    p.add_argument(
        "--max-in-flight", type=int, default=1024, help="requests sent and not answered, at most"
    )
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "out" / "soak.json")
    args = p.parse_args(argv)
    interrupt_on_sigterm()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    log = args.out.with_suffix(".server.log")
    port = free_port()
    cmd = pdserve_command(REPO, port, free_port(), free_port(), "--host", "127.0.0.1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, port, log, "pdserve", interval=0.2, tail=3000)
        result = asyncio.run(run(args, proc, port, log))
    except asyncio.CancelledError:
        raise KeyboardInterrupt("interrupted") from None
    finally:  # also on Ctrl-C and errors
        orphans = stop_process(proc)
    result["orphans_after_stop"] = orphans
    result["server_exit_code"] = proc.returncode
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(markdown(result))
    print(f"\nJSON: {args.out}; server log: {log}")
    return (
        0
        if result["requests"]["lost_no_answer"] == 0 and result["requests"]["failures"] == 0
        else 1
    )


if __name__ == "__main__":
    raise SystemExit(main())
