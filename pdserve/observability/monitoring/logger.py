"""The payload logger: a bounded queue between the request path and a sink, drained
by one thread.

The request path (the monitor's countdown: an unsampled request touches nothing here)
does the filters and a non-blocking append: references to the request's tensors
(:meth:`PayloadLogger.record`), or a plain JSON request's lines made from its bodies
(:meth:`PayloadLogger.sent`). The countdown's gaps come from :meth:`PayloadLogger.gap`
(geometric): each request is sampled with probability ``rate`` independently. A full queue drops the request, counted (``queue_full``). The
writer thread encodes whole batches and hands them to the sink in one call; a sink
failure drops its requests, counted (``sink_error``), logs a line at most every
:data:`LOG_EVERY_S` seconds and backs off (:data:`BACKOFF_S`, doubling up to
:data:`BACKOFF_MAX_S`) while the queue fills. So ``sampled = written + dropped +
queued`` at any time.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import threading
import time
import uuid
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.observability.monitoring.events import Entry, JsonLines, Record, json_rest
from pdserve.observability.monitoring.sinks import Sink, SinkError, make_sink
from pdserve.observability.monitoring.spec import LogSpec

if TYPE_CHECKING:
    from pdserve.core.types import InferRequest

log = logging.getLogger("pdserve.monitoring")

#: At most one log line per logger and failure kind this often (seconds).
LOG_EVERY_S = 30.0
#: Requests the thread encodes and hands the sink at once, at most. Large batches mean
#: few GIL hand-overs between this thread and the request path, which cost more than
#: the encoding saved by anything finer.
BATCH = 256
#: The writer thread drains the queue this often (seconds), or sooner when it is half
#: full: waking once per round rather than per request keeps thread switches (and GIL
#: hand-overs) off the request path.
ROUND_S = 0.05
#: After a sink failure the thread waits this long before the next try (seconds),
#: doubling with each further failure up to :data:`BACKOFF_MAX_S`.
BACKOFF_S = 0.5
BACKOFF_MAX_S = 8.0


class PayloadLogger:
    """One model's payload log: sampling, filters, the queue and the writer thread.

    Args:
        model: the model name (the file sink's folder, ``inferenceservicename``).
        spec: the model's :class:`~pdserve.observability.monitoring.spec.LogSpec`.
        source: the events' ``source`` attribute.
        sink: the sink (default: the one ``spec`` names).

    Raises:
        ImportError: the sink's package is missing.
    """

    def __init__(self, model: str, spec: LogSpec, source: str, sink: Sink | None = None) -> None:
        self.model = model
        self.spec = spec
        self.source = source
        self.sink = sink if sink is not None else make_sink(spec, model, source)
        #: makes a JSON request's lines on the request path from the bodies as received
        #: and sent (:meth:`sent`); None: the sink has no use for them, or filters apply
        self.encoder: JsonLines | None = None
        self._filtered = spec.status != "all" or bool(spec.versions) or spec.parameter is not None
        encoder = getattr(self.sink, "encoder", None)
        if isinstance(encoder, JsonLines) and spec.record != "metadata" and not self._filtered:
            if getattr(self.sink, "format", "jsonl") == "jsonl":
                self.encoder = encoder
        #: log(1 - rate) for the sampling gaps; None: every request (no draw)
        self._log_keep = math.log1p(-spec.rate) if spec.rate < 1.0 else None
        #: the bounded queue: a deque the request path appends to (``len`` checked first)
        #: and the writer thread pops from; ``_wake`` rouses a writer that waits idle.
        self._queue: deque[Record] = deque()
        self._limit = spec.queue
        self._max_bytes = spec.queue_bytes
        #: tensor bytes queued = _bytes_in (request path only) - _bytes_out (writer only)
        self._bytes_in = 0
        self._bytes_out = 0
        self._wake = threading.Event()
        self._idle = False
        self.sampled = 0
        self.written = 0
        self.dropped: Counter[str] = Counter()
        self._pending = 0  #: taken from the queue, not yet written or dropped
        self._last_log: dict[str, float] = {}
        self._backoff = 0.0  #: seconds to wait after the last failure (0: none failed)
        self._ids = f"{uuid.uuid4().hex[:12]}-"  #: ids of requests without one: prefix-N
        #: numbers of the ids made up: request path and writer thread alike (``next`` on
        #: a count is atomic)
        self._id_numbers = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name=f"payload-log-{model}", daemon=True)
        self._closing = False
        self._thread.start()

    # -- the request path --------------------------------------------------------------

    def gap(self) -> int:
        """Requests up to and including the next sampled one (1: the next), drawn from
        the geometric distribution of ``rate``: the gaps of sampling each request with
        probability ``rate`` independently."""
        log_keep = self._log_keep
        if log_keep is None:
            return 1
        return int(math.log(1.0 - random.random()) / log_keep) + 1

    def record(
        self,
        version: str,
        request_id: str,
        inputs: dict[str, np.ndarray],
        outputs: dict[str, np.ndarray] | None,
        error: str | None,
        parameters: dict[str, Any],
    ) -> None:
        """Record one sampled request (the draw is the caller's: :meth:`gap`): the
        filters, then the queue; never blocks (a full queue drops it, counted)."""
        if self._filtered and not self._passes(version, error, parameters):
            return
        self.sampled += 1
        size = 0
        if self.spec.record != "metadata":
            for a in inputs.values():
                size += a.nbytes
            if outputs is not None:
                for a in outputs.values():
                    size += a.nbytes
        if self._room(size):
            entry = Entry(
                request_id,
                self.model,
                version,
                time.time_ns(),
                inputs,
                outputs,
                error,
                parameters,
                size,
            )
            self._push(entry, size)

    def _room(self, size: int) -> bool:
        """Whether the queue takes one more request holding ``size`` bytes; when not, it
        is dropped and counted (``queue_full``)."""
        if (
            len(self._queue) >= self._limit
            or self._bytes_in + size - self._bytes_out > self._max_bytes
        ):
            self.dropped["queue_full"] += 1
            return False
        return True

    def _push(self, item: Record, size: int) -> None:
        """Queue ``item`` (``size`` bytes) and wake an idle writer once the queue is
        half full (else the writer's next round takes it)."""
        self._bytes_in += size
        queue = self._queue
        queue.append(item)
        if self._idle and len(queue) > self._limit // 2:
            self._idle = False
            self._wake.set()

    def sent(
        self,
        version: str,
        request: InferRequest,
        outputs: dict[str, np.ndarray],
        response: bytes | None,
    ) -> None:
        """Record a sampled JSON request once the front end has encoded its response
        (``InferRequest.answered``, set by the monitor for a request with a
        ``json_body`` and no BYTES outputs): its lines made now, from the bodies as
        received and sent while they are in the cache, and queued; or, where the
        response is not one JSON document (``None``) or holds ``NaN`` / ``Infinity``
        tokens (not JSON), :meth:`record`. Never blocks."""
        encoder = self.encoder
        sent_in = None
        if (
            response is not None
            and encoder is not None
            and not (b"N" in response and b"NaN" in response)
            and not (b"I" in response and b"Infinity" in response)
        ):
            sent_in = json_rest(request.json_body)
        rid = request.id
        if not rid:  # the client sent none: prefix-N
            rid = f"{self._ids}{next(self._id_numbers)}"
        if sent_in is None or response is None or encoder is None:
            self.record(version, rid, request.inputs, outputs, None, request.parameters)
            return
        self.sampled += 1
        template = encoder.sent_template(self.model, version)
        if self._room(len(template) + len(sent_in) + len(response)):
            lines = encoder.sent_lines(
                template, rid, not request.id, sent_in, memoryview(response)[1:]
            )
            self._push(lines, len(lines))

    def _passes(self, version: str, error: str | None, parameters: dict[str, Any]) -> bool:
        """Whether a request passes the status, version and parameter filters."""
        spec = self.spec
        if spec.status != "all" and (spec.status == "error") != (error is not None):
            return False
        if spec.versions and version not in spec.versions:
            return False
        if spec.parameter is not None:
            key, value = spec.parameter
            if str(parameters.get(key, "")) != value:
                return False
        return True

    # -- the writer thread -------------------------------------------------------------

    def _run(self) -> None:
        q = self._queue
        while True:
            if self._backoff and not self._closing:  # the sink failed: wait, then retry
                self._wake.wait(self._backoff)
                self._wake.clear()
            if len(q) < BATCH:  # drain in rounds: one wake-up per round, not per request
                self._idle = True
                if not self._closing:
                    self._wake.wait(ROUND_S)
                self._wake.clear()
                self._idle = False
            batch: list[Record] = []
            while q and len(batch) < BATCH:
                entry = q.popleft()
                self._bytes_out += entry.size if isinstance(entry, Entry) else len(entry)
                batch.append(entry)
            self._write(batch)
            self._sink_call(self.sink.tick, 0)
            if self._closing and not q:
                self._sink_call(self.sink.close, 0)
                return

    def _write(self, entries: list[Record]) -> None:
        if not entries:
            return
        self._pending += len(entries)
        for e in entries:
            if type(e) is Entry and not e.id:
                e.id = f"{self._ids}{next(self._id_numbers)}"
        self._sink_call(lambda: self.sink.write(entries), len(entries))

    def _sink_call(self, call: Callable[[], int], given: int) -> None:
        """Run a sink call handed ``given`` requests; count what it wrote or lost, and
        back off after a sink failure."""
        try:
            done = call()
        except SinkError as e:
            self._pending -= e.lost
            self.dropped[e.reason] += e.lost
            if e.reason == "sink_error":
                self._backoff = min(max(self._backoff * 2, BACKOFF_S), BACKOFF_MAX_S)
            self._warn(
                e.reason, f"payload log of model '{self.model}' lost {e.lost} request(s): {e}"
            )
            return
        except Exception as e:  # a sink bug must not end the thread
            self._warn(
                "sink_error", f"payload log of model '{self.model}': {type(e).__name__}: {e}"
            )
            return
        if given:  # the sink took a batch: no more waiting
            self._backoff = 0.0
        self._pending -= done
        self.written += done

    def _warn(self, kind: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last_log.get(kind, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._last_log[kind] = now
            log.warning("%s", message)

    # -- control -----------------------------------------------------------------------

    @property
    def queued(self) -> int:
        """Requests sampled and neither written nor dropped yet (queued or buffered)."""
        return len(self._queue) + self._pending

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued and buffered, then stop the thread (at most ``timeout``
        seconds; what is left then is counted as dropped, ``shutdown``)."""
        if self._closing:
            return
        self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        left = self.sampled - self.written - sum(self.dropped.values())
        if left > 0:
            self.dropped["shutdown"] += left
