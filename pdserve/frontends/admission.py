"""The admission step HTTP and gRPC share: a decoded request's setup from what both carry.

Each frontend reads the same things from its own wire (HTTP headers, gRPC metadata):
the cancellation token of the call, the W3C ``traceparent``, the traffic-control
headers (:data:`ROUTE_KEY_HEADER`, :data:`PIN_HEADER`) and, through the traffic gate,
the authenticated principal. :func:`admit` puts them on the
:class:`~pdserve.core.types.InferRequest`, with one rule for both protocols, and names
the request in the log lines written while it is handled (:func:`begin_request`).
"""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Iterable

from pdserve.core import context
from pdserve.core.tracing import parse_traceparent
from pdserve.core.types import InferRequest
from pdserve.frontends.traffic.gate import principal_name

#: HTTP header / gRPC metadata key whose value makes a traffic split sticky.
ROUTE_KEY_HEADER = "x-pdserve-route-key"
#: HTTP header / gRPC metadata key that pins a request to one version.
PIN_HEADER = "x-pdserve-model-version"

#: One DEBUG line per inference request (``--log-verbose 1``): model and version only.
request_log = logging.getLogger("pdserve.request")

_ID_PREFIX = uuid.uuid4().hex[:16]
_ID_COUNTER = itertools.count(1)


def new_request_id() -> str:
    """A fresh request id for a request that brought none: 32 hex digits, a random
    per-process prefix and a counter (unique within the process and, with high
    probability, across processes; no system call per request)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER):016x}"


def begin_request(request_id: str | None, traceparent: str | bytes | None = None) -> str:
    """Mark the current context as handling one request (the ids every log line written
    meanwhile carries, :mod:`pdserve.observability.logs`); returns its request id.

    Args:
        request_id: the V2 request ``id`` the client gave, or None/"" (one is generated).
        traceparent: the request's W3C ``traceparent`` header / metadata, if any; its
            trace id becomes :data:`pdserve.core.context.trace_id` unless tracing set
            one already.
    """
    rid = request_id or new_request_id()
    context.request_id.set(rid)
    if traceparent is not None and context.trace_id.get() is None:
        parsed = parse_traceparent(traceparent)
        if parsed is not None:
            context.trace_id.set(parsed[0])
    return rid


def header_text(value: bytes | str) -> str:
    """A header or metadata value as text. Bytes (an HTTP header as it came) are read
    as UTF-8, and as latin-1 when they are not valid UTF-8: grpcio's rule for the
    metadata it hands over as ``str``, so a value reads the same on both protocols."""
    if isinstance(value, str):
        return value
    try:
        return value.decode()
    except UnicodeDecodeError:
        return value.decode("latin-1")


def admit(
    request: InferRequest,
    protocol: str,
    cancelled: object,
    traceparent: bytes | str | None,
    route_key: bytes | str,
    pinned: bytes | str,
) -> None:
    """Set up a decoded ``request`` for the core.

    Args:
        request: the decoded request (its ``id`` names its log lines).
        protocol: ``HTTP`` | ``gRPC``, for the request's DEBUG log line.
        cancelled: the request's cancellation token (``InferRequest.cancelled``).
        traceparent: the client's W3C ``traceparent``, unparsed; None: none sent.
        route_key: the :data:`ROUTE_KEY_HEADER` value (empty: none); without one the
            authenticated principal's name (set by the traffic gate) makes the split
            sticky.
        pinned: the :data:`PIN_HEADER` value (empty: none).
    """
    request.cancelled = cancelled
    begin_request(request.id, traceparent)  # ids on this request's log lines
    if request_log.isEnabledFor(logging.DEBUG):
        request_log.debug(
            "%s infer model=%s version=%s",
            protocol,
            request.model_name,
            request.model_version or "-",
        )
    request.route_key = header_text(route_key) if route_key else (principal_name.get() or "")
    if pinned:
        request.pinned_version = header_text(pinned).strip()
    if traceparent is not None:
        request.traceparent = traceparent


def metadata_admission(
    metadata: Iterable[tuple[str, str | bytes]] | None,
) -> tuple[str | None, str, str]:
    """``(traceparent, route_key, pinned)`` from gRPC invocation metadata (``(key,
    value)`` pairs; None / "" when absent; a repeated key: its last value, as HTTP)."""
    traceparent: str | None = None
    route_key = pinned = ""
    for key, value in metadata or ():
        if key == ROUTE_KEY_HEADER:
            route_key = header_text(value)
        elif key == PIN_HEADER:
            pinned = header_text(value)
        elif key == "traceparent":
            traceparent = header_text(value)
    return traceparent, route_key, pinned
