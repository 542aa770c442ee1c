"""In-process cost of the wedge watchdog per batch and of answering Server-Timing per
request, for one or more checkouts, alternated: steadier than a wrk run on a busy machine.

Each checkout's figures come from a child process with ``PYTHONPATH`` set to it:

``watch``
    ``run_batch`` of a no-op instance (4 requests a batch), unwatched and watched by a
    :class:`~pdserve.scheduling.watchdog.Watchdog` (300 s bound, its sweep running):
    µs per batch and their difference (the watch's own cost).
``timing``
    the native HTTP transport's answer to a one-row ``tiny`` JSON response written to a
    stub transport: the untimed fast path against the timed one (``asked``, one entry,
    ``server_timing``, the ``_write_timed`` answer); µs per request and the difference.

Usage::

    .venv/bin/python benchmarks/bench_health_inproc.py --roots . /work/main --rounds 3

Minimums over many short repeats (µs); rounds alternate which checkout goes first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from common import ROOT, cli_parser

CHILD = r"""
import asyncio, collections, inspect, json, sys, time, timeit, types
import numpy as np
import uvloop
from pdserve.backends.base import ExecRequest, ModelInstance
from pdserve.core import timing as timing_mod
from pdserve.core.stats import ModelStats
from pdserve.core.types import InferRequest
from pdserve.frontends.http import native_reply as nr
from pdserve.frontends.http.wire import OK_JSON
from pdserve.scheduling.base import run_batch
from pdserve.scheduling.watchdog import Watchdog

def best(fn, number=2000, repeat=200):
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6

class Quick(ModelInstance):
    name = "q_0"
    async def execute(self, batch):
        return [{} for _ in batch]

async def watch_costs(n):
    inst, stats = Quick(), ModelStats("q", "1")
    batch = [ExecRequest({"IN": np.ones(1)}, ["OUT"], InferRequest("q", id="r")) for _ in range(4)]
    dog, out = Watchdog("q", "1", 300.0), {"plain": [], "watched": []}
    dog.attach([inst])
    watch = inst.watch
    for rep in range(200):  # short samples, interleaved; the minimum of each
        for mode in ("plain", "watched") if rep % 2 == 0 else ("watched", "plain"):
            inst.watch = watch if mode == "watched" else None
            t0 = time.perf_counter()
            for _ in range(n):
                await run_batch(inst, batch, stats)
            out[mode].append((time.perf_counter() - t0) / n * 1e6)
    await dog.stop()
    return min(out["plain"]), min(out["watched"])

class Transport:
    def write(self, data): pass
    def is_closing(self): return False

class Stub(nr.Replies):
    def __init__(self):
        self.transport, self._queue = Transport(), collections.deque()
        self.server = types.SimpleNamespace(closing=False, draining=lambda: False)
        self.limits = types.SimpleNamespace(idle_timeout=0)
        self._gone = self._head_only = self._broken = self._message_begun = False
        self._busy, self._token, self._pending_error, self._rejection = True, None, None, None
    def _linger_close(self): pass

r = Stub()
req = nr.ParsedRequest(b"POST", b"/v2/models/tiny/infer", [], b"", True, False, b"")
body = (b'{"model_name":"tiny","model_version":"1","outputs":[{"name":"OUTPUT0",'
        b'"datatype":"FP32","shape":[1,64],"data":[' + b"0.123456," * 63 + b"0.5]}]}")
parts, total = [body], len(body)
with_total = "total" in inspect.signature(nr.Replies._write_timed).parameters

def untimed():
    r._finish(req, b"%s%d%s%s" % (OK_JSON, total, r._end(req), parts[0]))

def timed():
    timing = []
    timing_mod.asked(b"1", {})
    timing.append(("tiny", 123456, 0, 1534567, 0, 2345678))
    if with_total:
        r._write_timed(req, parts, None, total, timing)
    else:
        r._write_timed(req, parts, None, timing)

plain, watched = uvloop.run(watch_costs(int(sys.argv[1])))
print(json.dumps({"watch_plain": plain, "watch_watched": watched,
                  "untimed": best(untimed), "timed": best(timed)}))
"""


def measure(root: Path, batches: int) -> dict[str, float]:
    """One child's figures (µs) for checkout ``root``."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(batches)],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main(argv: list[str] | None = None) -> int:
    """Alternate the checkouts over rounds; print each round and the medians."""
    p = cli_parser(__doc__, __file__)
    p.add_argument("--roots", nargs="+", type=Path, default=[ROOT], help="checkouts")
    p.add_argument("--rounds", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--batches", type=int, default=1000, help="batches per watch sample")
    args = p.parse_args(argv)
    rows: dict[str, list[dict[str, float]]] = {str(r): [] for r in args.roots}
    for rep in range(args.rounds):
        for root in args.roots if rep % 2 == 0 else args.roots[::-1]:
            m = measure(root.resolve(), args.batches)
            rows[str(root)].append(m)
            print(
                f"round {rep} {root}: watch {m['watch_watched'] - m['watch_plain']:+.3f} us/batch "
                f"({m['watch_plain']:.3f} -> {m['watch_watched']:.3f}); Server-Timing "
                f"{m['timed'] - m['untimed']:+.3f} us/request ({m['untimed']:.3f} -> "
                f"{m['timed']:.3f})",
                flush=True,
            )
    for root, ms in rows.items():
        watch = sorted(m["watch_watched"] - m["watch_plain"] for m in ms)
        timed = sorted(m["timed"] - m["untimed"] for m in ms)
        print(
            f"{root}: watch median {watch[len(watch) // 2]:+.3f} us/batch, Server-Timing "
            f"median {timed[len(timed) // 2]:+.3f} us/request"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
