"""The worker threads both frontends use to decode, decompress and encode large
bodies off the event loop (a multi-megabyte parse would otherwise stall every
other request, health probes included)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import Any

_codec_pool: concurrent.futures.ThreadPoolExecutor | None = None


def codec_pool() -> concurrent.futures.ThreadPoolExecutor:
    """The shared two-thread pool, created on first use."""
    global _codec_pool
    if _codec_pool is None:
        _codec_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix="pdserve-codec"
        )
    return _codec_pool


async def off_loop(func: Callable[..., Any], *args: Any) -> Any:
    """Run ``func(*args)`` on :func:`codec_pool` and wait for its result."""
    return await asyncio.get_running_loop().run_in_executor(codec_pool(), func, *args)
