"""Per-request server timing: the W3C ``Server-Timing`` of one inference request.

Off unless the server enables it (``--server-timing``: :data:`state`) *and* the request
asks: the :data:`HEADER` header / gRPC metadata key with a true value, or the request
parameter :data:`PARAMETER` true. A frontend then gives the request a list
(``InferRequest.timing``); the core appends one :data:`Entry` per model the request ran
on (each step of an ensemble, then the ensemble), from the same numbers the statistics
extension records, and the frontend answers :func:`server_timing` as the HTTP
``Server-Timing`` header or the gRPC trailing metadata ``server-timing``. Durations are
milliseconds (W3C ``dur``); names are ``queue``, ``compute_input``, ``compute_infer``,
``compute_output`` and ``total``, prefixed ``<step model>.`` for an ensemble's steps.
When off, no request carries a list and nothing is recorded.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

#: HTTP header / gRPC metadata key with which a request asks for its timing.
HEADER = "x-pdserve-server-timing"
#: Request parameter with which a request asks for its timing (removed from the request).
PARAMETER = "server_timing"
#: The HTTP response header / gRPC trailing metadata key of the answer.
RESPONSE_KEY = "server-timing"

#: ``(model, queue_ns, compute_input_ns, compute_infer_ns, compute_output_ns, total_ns)``.
Entry = tuple[str, int, int, int, int, int]

_NOT_TOKEN = re.compile(r"[^!#$%&'*+\-.^_`|~0-9A-Za-z]")
_TRUE = frozenset(("1", "true", "on", "yes"))
#: The true values as they usually arrive (no normalizing needed): bytes and str.
_TRUE_RAW = frozenset((*_TRUE, *(v.encode() for v in _TRUE)))


@dataclass
class TimingState:
    """Whether the server answers timing at all (``--server-timing``)."""

    enabled: bool = False


#: The process's setting, set once by the app at start.
state = TimingState()


def asked(header: bytes | str | None, parameters: dict[str, Any]) -> bool:
    """Whether a request asks for its timing: ``header`` (the :data:`HEADER` value, or
    None) reads true (``1``, ``true``, ``on``, ``yes``; case and surrounding blanks
    ignored), or the request parameter :data:`PARAMETER` is true; the parameter is
    removed either way."""
    wanted = header in _TRUE_RAW  # the usual exact value: one set lookup
    if parameters and PARAMETER in parameters:
        wanted = parameters.pop(PARAMETER) is True or wanted
    if header and not wanted:
        text = header.decode("latin-1") if isinstance(header, bytes) else header
        wanted = text.strip().lower() in _TRUE
    return wanted


#: One model's entries (a ``%s`` prefix, then five durations in ms, 3 decimals).
_ENTRY = (
    "%squeue;dur=%.3f, %scompute_input;dur=%.3f, %scompute_infer;dur=%.3f, "
    "%scompute_output;dur=%.3f, %stotal;dur=%.3f"
)
#: The value for a request that ran on one model whose compute_input / compute_output
#: are not split out (zero): the three durations :func:`one_model` gives fill it. A
#: frontend may format it inside its response head, in one go with the rest.
ONE_MODEL = (
    b"queue;dur=%.3f, compute_input;dur=0.000, compute_infer;dur=%.3f, "
    b"compute_output;dur=0.000, total;dur=%.3f"
)


def one_model(entries: list[Entry]) -> tuple[float, float, float] | None:
    """The durations of :data:`ONE_MODEL` for ``entries`` (queue, compute_infer and
    total, ms), or None where the value needs the general form."""
    if len(entries) != 1:
        return None
    _, queue, c_in, c_infer, c_out, total = entries[0]
    if c_in or c_out:
        return None
    return queue / 1e6, c_infer / 1e6, total / 1e6


def server_timing(entries: list[Entry]) -> str:
    """The ``Server-Timing`` value of a request's entries (W3C syntax:
    ``name;dur=ms`` joined by ``, ``, ms with 3 decimals). The last entry is the model the
    request named; entries before it are an ensemble's steps, named ``<model>.<name>``."""
    durations = one_model(entries)
    if durations is not None:  # the usual request: 3 numbers to format, not 5
        return (ONE_MODEL % durations).decode()
    last = len(entries) - 1
    parts = []
    for i, (model, queue, c_in, c_infer, c_out, total) in enumerate(entries):
        p = "" if i == last else _NOT_TOKEN.sub("_", model) + "."
        parts.append(
            _ENTRY
            % (p, queue / 1e6, p, c_in / 1e6, p, c_infer / 1e6, p, c_out / 1e6, p, total / 1e6)
        )
    return ", ".join(parts)


def parse_server_timing(value: str) -> dict[str, float]:
    """A ``Server-Timing`` value as name -> ``dur`` in ms (entries without ``dur``: 0)."""
    out: dict[str, float] = {}
    for entry in value.split(","):
        name, _, params = entry.strip().partition(";")
        dur = 0.0
        for param in params.split(";"):
            key, _, val = param.strip().partition("=")
            if key == "dur":
                dur = float(val)
        if name:
            out[name] = dur
    return out
