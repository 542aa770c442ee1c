"""What served requests leave for Python's cyclic garbage collector.

pdserve raises the collector's thresholds while serving
(:func:`pdserve.core.procmem.settle_gc`): that is cheap only while finished requests
are freed by reference counting. An object kept alive by a reference cycle waits for a
collection, and a generation-0 collection of ~50,000 such objects (tasks, coroutines,
contexts, tokens...) took 75-90 ms on this machine kind (~1.5 µs per object). These
helpers run a real :class:`~pdserve.server.InferenceServer` with a real front end in
this process, drive it from threads with a real client, and return the objects the
traffic left in cycles.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gc
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import uvloop

from pdserve.server import InferenceServer

#: Objects of these modules (and asyncio tasks/futures/coroutines) count: the client
#: threads' own garbage (urllib, grpcio) does not.
WATCHED = ("pdserve", "uvicorn", "_asyncio", "asyncio", "builtins.coroutine")

#: ``start(server) -> (port, stop)``: start a front end on a free loopback port.
FrontEnd = Callable[[InferenceServer], Awaitable[tuple[int, Callable[[], Awaitable[None]]]]]


def _collect() -> list[object]:
    gc.collect()
    return list(gc.garbage)


@contextlib.contextmanager
def collector_off() -> Iterator[Callable[[], list[object]]]:
    """The cyclic collector off and ``gc.DEBUG_SAVEALL`` on for the body (after one
    collection of what was there before); the yielded function collects and returns
    every object found in a cycle since. Restores the collector and empties
    ``gc.garbage`` on the way out."""
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield _collect
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def tiny_batched(dst: Path) -> Path:
    """A repository with the example ``tiny`` model (64 -> 64 FP32) behind a dynamic
    batcher (2 ms queue delay), as issue 11's benchmarks serve it."""
    from tests.conftest import copy_models

    repo = copy_models(dst, "tiny")
    config = repo / "tiny" / "config.pbtxt"
    config.write_text(
        config.read_text() + "\ndynamic_batching { max_queue_delay_microseconds: 2000 }\n"
    )
    return repo


def cyclic_garbage(
    repo: Path,
    start: FrontEnd,
    call: Callable[[int, int], None],
    threads: int = 8,
    calls: int = 8,
) -> collections.Counter[str]:
    """Serve ``repo`` with the front end ``start`` makes; ``threads`` client threads each
    make ``calls`` calls (``call(port, i)``, which asserts the answer), once to warm up
    and once with the collector off; the watched objects left in cycles by the second
    round, as ``"module.qualname" -> count``."""

    async def main() -> collections.Counter[str]:
        server = InferenceServer(str(repo))
        await server.start()
        port, stop = await start(server)

        def drive() -> None:
            with ThreadPoolExecutor(threads) as pool:
                for f in [pool.submit(call, port, i) for i in range(threads * calls)]:
                    f.result()

        try:
            await asyncio.to_thread(drive)
            with collector_off() as collect:
                await asyncio.to_thread(drive)
                await asyncio.sleep(0.1)  # the last answers' tasks end
                return collections.Counter(
                    name
                    for o in collect()
                    if (name := f"{type(o).__module__}.{type(o).__qualname__}").startswith(WATCHED)
                )
        finally:
            await stop()
            await server.stop()

    return uvloop.run(main())
