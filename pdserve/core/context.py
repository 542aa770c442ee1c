"""Per-request context for log lines and traces.

Two :class:`contextvars.ContextVar` values that a frontend sets when it starts
handling a request and that log formatting, tracing and error paths read (they live
in ``core`` so that every layer may read them):

- ``request_id``: the V2 request ``id`` when the client gave one, otherwise an id
  the frontend generated; ``None`` outside a request.
- ``trace_id``: the W3C trace id (32 lowercase hex digits) of the request's trace
  when it is traced or the client sent a valid ``traceparent``; ``None`` otherwise.

Context variables follow asyncio tasks, so a value set in a request handler is seen
by the coroutines it awaits, but not by a batch that joins several requests nor by a
python-backend worker process.
"""

from __future__ import annotations

from contextvars import ContextVar

request_id: ContextVar[str | None] = ContextVar("pdserve_request_id", default=None)
trace_id: ContextVar[str | None] = ContextVar("pdserve_trace_id", default=None)
