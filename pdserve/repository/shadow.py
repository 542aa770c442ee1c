"""Shadow traffic: mirror a share of a model's routed requests to a candidate version
after the caller's answer is ready, compare each output with the configured tolerance and
count divergences.

The caller's answer never waits for a mirror: a full queue, a caller's version with more
than the shadow's ``max_inflight`` requests in flight, or a shadow version that refuses
more work sheds it (``shed``); a shadow that fails counts ``error``. One worker runs a
model's mirrors, one at a time. Mirrors reach the shadow version through the core's
:class:`~pdserve.core.api.ModelRunner`, as ensemble steps do.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING

from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.types import InferRequest, InferResponse
from pdserve.repository.model_traffic import ModelTraffic
from pdserve.repository.traffic import ShadowSpec, outputs_agree, tolerance_for

if TYPE_CHECKING:
    from pdserve.core.api import ModelRunner
    from pdserve.repository.manager import ModelManager

log = logging.getLogger("pdserve.rollout")

#: At most one divergence log line per output per this many seconds.
DIVERGENCE_LOG_EVERY_S = 5.0
#: Worker tasks that run one model's shadow requests: one, so that a shadow never
#: has more than one request in flight per model (it costs the callers at most what
#: one more closed-loop client would).
SHADOW_WORKERS = 1


class ShadowMirror:
    """Runs the shadow mirrors of every model of one server.

    Args:
        runner: runs a mirror on the shadow version (``infer_on``).
        manager: the served versions.
    """

    def __init__(self, runner: ModelRunner, manager: ModelManager) -> None:
        self.runner = runner
        self.manager = manager
        #: set when the server stops: no more mirrors are queued.
        self.closing = False

    def offer(
        self, st: ModelTraffic, shadow: ShadowSpec, request: InferRequest, response: InferResponse
    ) -> None:
        """Queue a mirror of ``request`` (never waits; a full queue sheds it)."""
        if self.closing:
            return
        if st.queue is None or st.queue.maxsize != shadow.queue_size:
            self.stop(st)
            st.queue = asyncio.Queue(shadow.queue_size)
            loop = asyncio.get_running_loop()
            st.workers = [
                loop.create_task(self._worker(st, st.queue), name=f"pdserve-shadow-{st.name}")
                for _ in range(SHADOW_WORKERS)
            ]
        try:
            st.queue.put_nowait((shadow, request, response))
        except asyncio.QueueFull:
            st.shadow_results[(str(shadow.version), "shed")] += 1

    def stop(self, st: ModelTraffic) -> None:
        """Stop ``st``'s shadow workers (queued mirrors are dropped)."""
        for t in st.workers:
            t.cancel()
        st.workers = []
        st.queue = None

    async def _worker(
        self, st: ModelTraffic, queue: asyncio.Queue[tuple[ShadowSpec, InferRequest, InferResponse]]
    ) -> None:
        """Run one model's mirrors, one at a time, until cancelled."""
        while True:
            shadow, request, primary = await queue.get()
            try:
                await self._one(st, shadow, request, primary)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a shadow never stops the worker
                log.exception("model %s: shadow request failed unexpectedly", st.name)
                st.shadow_results[(str(shadow.version), "error")] += 1

    async def _one(
        self, st: ModelTraffic, shadow: ShadowSpec, request: InferRequest, primary: InferResponse
    ) -> None:
        """Run one mirror on the shadow version and compare its outputs with the
        caller's answer."""
        version = str(shadow.version)
        entry = self.manager.models.get(st.name)
        mv = entry.serving.get(shadow.version) if entry is not None else None
        if mv is None:
            st.shadow_results[(version, "missing")] += 1
            self._log_every(
                st, "missing", "shadow version %s of model %s is not served", version, st.name
            )
            return
        primary_mv = entry.serving.get(int(primary.model_version)) if entry is not None else None
        if primary_mv is not None and primary_mv.inflight > shadow.max_inflight:
            st.shadow_results[(version, "shed")] += 1  # the callers are busy: shadow goes first
            return
        mirror = InferRequest(
            request.model_name,
            version,
            request.inputs,
            request.outputs,
            request.id,
            dict(request.parameters),
        )
        try:
            result = await self.runner.infer_on(mv, mirror)
        except InferError as e:
            kind = "shed" if e.code is ErrorCode.UNAVAILABLE else "error"
            st.shadow_results[(version, kind)] += 1
            self._log_every(
                st, "error", "model %s shadow version %s failed: %s", st.name, version, e
            )
            return
        st.shadow_results[(version, "compared")] += 1
        differences = {}
        for output, value in primary.outputs.items():
            other = result.outputs.get(output)
            if other is None:
                agree, detail = False, "missing from the shadow's response"
            else:
                agree, detail = outputs_agree(value, other, tolerance_for(shadow, output))
            st.compared[output] += 1
            st.recent.add(("out", output, not agree))
            if not agree:
                st.divergence[output] += 1
                differences[output] = detail
        st.recent.add(("ver", shadow.version, bool(differences)))
        if differences:
            sample = {
                "time": time.time(),
                "request_id": request.id,
                "version": primary.model_version,
                "shadow_version": version,
                "outputs": differences,
            }
            st.samples.append(sample)
            for output, detail in differences.items():
                self._log_every(
                    st,
                    f"div:{output}",
                    "model %s: shadow version %s diverges from version %s on output %s "
                    "(request id %r): %s",
                    st.name,
                    version,
                    primary.model_version,
                    output,
                    request.id,
                    detail,
                )

    def _log_every(self, st: ModelTraffic, key: str, msg: str, *args: object) -> None:
        """Log a warning, at most once per :data:`DIVERGENCE_LOG_EVERY_S` per ``key``."""
        now = time.monotonic()
        if now - st.last_log.get(key, -math.inf) >= DIVERGENCE_LOG_EVERY_S:
            st.last_log[key] = now
            log.warning(msg, *args)
