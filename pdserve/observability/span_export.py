"""The export of finished traces: a bounded span queue and one daemon thread that posts
batches of spans over OTLP/HTTP (:mod:`pdserve.observability.otlp`, the ``tracing``
extra). A request never waits for the export; a full queue or a failed export drops
spans, and the drops are counted (:class:`ExportCounts`) and logged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from types import ModuleType
from typing import Protocol

from pdserve.core.errors import unavailable
from pdserve.core.tracing import Trace
from pdserve.observability.trace_config import TraceConfig

log = logging.getLogger("pdserve.tracing")


def import_otel() -> ModuleType:
    """Import the OTLP export (:mod:`pdserve.observability.otlp`, the ``tracing`` extra).

    Raises:
        InferError(UNAVAILABLE): not installed.
    """
    try:
        from pdserve.observability import otlp
    except ImportError as e:
        raise unavailable(
            "tracing needs the 'tracing' extra (opentelemetry-proto, opentelemetry-api, "
            f"requests), which cannot be imported ({e}): install it with pip install "
            "'pdserve[tracing]', or leave --trace-config level at OFF"
        ) from None
    return otlp


@dataclass
class ExportCounts:
    """What the export did since it started (spans).

    Attributes:
        exported: spans the endpoint accepted.
        dropped_queue_full: spans dropped because the export queue was full (the
            endpoint is down or slower than the traffic), or still queued when the
            export stopped.
        dropped_failed: spans of exports that failed (refused, timed out, an error status).
        exports: posts made (successful or not).
        failures: why the last (at most 10) failed posts failed.
    """

    exported: int = 0
    dropped_queue_full: int = 0
    dropped_failed: int = 0
    exports: int = 0
    failures: list[str] = field(default_factory=list)

    @property
    def dropped(self) -> int:
        """Every span dropped."""
        return self.dropped_queue_full + self.dropped_failed


class OtlpSender(Protocol):
    """Posts serialized export requests (:class:`pdserve.observability.otlp.OtlpHttpSender`)."""

    def post(self, data: bytes) -> str:
        """ "" when the endpoint accepted the request, else why not."""
        ...

    def close(self) -> None: ...


class SpanExport:
    """A bounded span queue and one daemon thread exporting it over OTLP/HTTP.

    :meth:`submit` (event loop) appends a finished trace's spans and returns at once.
    The thread wakes every ``bsp_schedule_delay`` ms, or as soon as
    ``bsp_max_export_batch_size`` spans wait, encodes up to that many as one OTLP
    ``ExportTraceServiceRequest`` and posts it (one post, no retry; ``export_timeout``
    ms to connect and to each read). Spans beyond ``bsp_max_queue_size`` are dropped, as
    are those of a failed export; both are counted in :attr:`counts`.

    Args:
        config: the trace configuration (endpoint, resource, batch settings).
        sender: what posts the serialized requests
            (:class:`~pdserve.observability.otlp.OtlpHttpSender`: ``post(bytes) -> str``,
            "" on success, and ``close()``); None: one to ``config.url``.

    Raises:
        InferError(UNAVAILABLE): OpenTelemetry (``pdserve[tracing]``) is not installed,
            or an ``OTEL_EXPORTER_OTLP_*`` setting is invalid.
    """

    def __init__(self, config: TraceConfig, sender: OtlpSender | None = None) -> None:
        self._otlp = import_otel()
        self.config = config
        self._converter = self._otlp.SpanConverter(config.resource_attributes())
        if sender is None:
            try:
                sender = self._otlp.OtlpHttpSender(config.url, config.export_timeout_ms / 1000)
            except ValueError as e:
                raise unavailable(f"tracing: {e}") from None
        self._sender = sender
        self.counts = ExportCounts()
        self._queue: deque[tuple[Trace, int]] = deque()
        self._queued = 0  # spans in _queue (under _lock: the loop adds, the thread takes)
        self._lock = threading.Lock()
        self._max_queue = config.bsp_max_queue_size
        self._batch = config.bsp_max_export_batch_size
        self._delay = config.bsp_schedule_delay_ms / 1000
        self._wake = threading.Event()
        self._stopping = False
        self._flushing = False  # flush(): export what is queued, full batch or not
        self._busy = False  # the thread holds taken spans not yet counted
        self._last_drop_log = 0.0
        self._logged_dropped = 0
        self._thread = threading.Thread(target=self._run, name="pdserve-trace-export", daemon=True)
        self._thread.start()
        log.info(
            "tracing: exporting OpenTelemetry spans to %s (queue %d spans, every %d ms)",
            config.url,
            config.bsp_max_queue_size,
            config.bsp_schedule_delay_ms,
        )

    def submit(self, trace: Trace) -> None:
        """Queue a finished trace's spans (all of them, or none when they do not fit)."""
        n = len(trace.spans)
        with self._lock:
            full = self._stopping or self._queued + n > self._max_queue
            if not full:
                self._queue.append((trace, time.time_ns() - time.monotonic_ns()))
                self._queued += n
                wake = self._queued >= self._batch
        if full:
            self.counts.dropped_queue_full += n
            self._note_drops()
        elif wake:
            self._wake.set()

    def _note_drops(self) -> None:
        now = time.monotonic()
        if now - self._last_drop_log >= 10.0:
            self._last_drop_log = now
            new = self.counts.dropped - self._logged_dropped
            self._logged_dropped = self.counts.dropped
            failures = self.counts.failures
            log.warning(
                "tracing: %d spans dropped so far (%d queue full, %d failed exports; +%d "
                "since the last report)%s",
                self.counts.dropped,
                self.counts.dropped_queue_full,
                self.counts.dropped_failed,
                new,
                f"; an export failed: {failures[-1]}" if failures else "",
            )

    def _take(self) -> list[tuple[Trace, int]]:
        """Up to one batch of traces (whole traces: a batch may run over)."""
        taken: list[tuple[Trace, int]] = []
        count = 0
        with self._lock:
            while self._queue and count < self._batch:
                item = self._queue.popleft()
                taken.append(item)
                count += len(item[0].spans)
            self._queued -= count
            self._busy = bool(taken)
        return taken

    def _export_some(self, full_batches_only: bool = False) -> None:
        """Export the queue (with ``full_batches_only``: while a whole batch waits)."""
        while self._queue and (not full_batches_only or self._queued >= self._batch):
            taken = self._take()
            if taken:
                self._post(taken)
            self._busy = False

    def _post(self, taken: list[tuple[Trace, int]]) -> None:
        """Encode ``taken`` as one export request, post it, count the outcome."""
        n = 0
        try:
            message, n = self._converter.request(taken)
            if not n:
                return
            reason = self._sender.post(message.SerializeToString())
        except Exception as e:  # noqa: BLE001 - the export thread must live on
            reason = f"{type(e).__name__}: {e}"
            n = n or sum(len(trace.spans) for trace, _ in taken)
        self.counts.exports += 1
        if not reason:
            self.counts.exported += n
        else:
            self.counts.dropped_failed += n
            failures = self.counts.failures
            failures.append(reason)
            del failures[:-10]  # the last 10
            self._note_drops()

    def _run(self) -> None:
        # As the batch span processor: woken by a full batch, export full batches;
        # when the delay has passed, export everything queued.
        while not self._stopping:
            woken = self._wake.wait(self._delay)
            self._wake.clear()
            flushing, self._flushing = self._flushing, False
            self._export_some(full_batches_only=woken and not self._stopping and not flushing)
        self._export_some()

    def flush(self, timeout: float = 5.0) -> None:
        """Export what is queued now, and wait (at most ``timeout`` s) until it was
        posted (or dropped)."""
        self._flushing = True
        self._wake.set()
        deadline = time.monotonic() + timeout
        while (self._queue or self._busy or self._flushing) and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self, timeout: float = 5.0) -> None:
        """Export what is queued (at most ``timeout`` s), stop the thread, log the counts."""
        with self._lock:
            self._stopping = True
        self._wake.set()
        self._thread.join(timeout)
        with self._lock:  # what the thread could not export in time is lost
            self.counts.dropped_queue_full += self._queued
            self._queue.clear()
            self._queued = 0
        c = self.counts
        log.info(
            "tracing: %d spans exported in %d exports, %d dropped (%d queue full, %d failed "
            "exports)",
            c.exported,
            c.exports,
            c.dropped,
            c.dropped_queue_full,
            c.dropped_failed,
        )
        try:
            self._sender.close()
        except Exception:  # noqa: BLE001 - shutting down regardless
            log.debug("OTLP sender close failed", exc_info=True)
