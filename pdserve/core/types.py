"""Protocol-neutral request, response and error types.

Frontends translate the wire (V2 REST JSON / binary, V2 gRPC) into these and back;
everything below the frontends (server, scheduling, backends) only sees these.
Tensors are numpy arrays; BYTES tensors are numpy object arrays of ``bytes``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass(slots=True)
class RequestedOutput:
    """One entry of a request's ``outputs`` list.

    Attributes:
        name: output tensor name.
        binary_data: HTTP only: return this output in the binary tensor extension.
        classification: top-K classification extension (0 = off): the output is
            returned as BYTES ``"score:index[:label]"`` strings, K per batch row.
        parameters: any other per-output parameters, unchanged.
    """

    name: str
    binary_data: bool | None = None
    classification: int = 0
    parameters: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class InferRequest:
    """One inference request, protocol-neutral.

    Attributes:
        model_name: target model.
        model_version: version string; ``""`` lets the version policy pick.
        inputs: input name -> numpy array (full shape, batch dim included when
            the model batches). BYTES inputs are object arrays of ``bytes``.
        outputs: requested outputs; ``None`` means every output of the model.
        id: the client's request id, echoed in the response.
        parameters: request-level parameters (``priority``, ``timeout`` in µs,
            ``binary_data_output``...).
        arrival_ns: ``time.monotonic_ns()`` when the frontend received it.
        cancelled: a callable returning True once the client has gone away.
        route_key: makes a traffic split sticky (``x-pdserve-route-key`` header or
            gRPC metadata; see :mod:`pdserve.repository.traffic`); ``""``: none.
        pinned_version: the version a request without ``model_version`` asks for
            (``x-pdserve-model-version``); ``""``: the traffic split picks.
        traceparent: the W3C ``traceparent`` the client sent (HTTP header or gRPC
            metadata), unparsed; None when it sent none.
        trace: set by the server when the request is traced
            (:class:`pdserve.core.tracing.TraceRef`); None otherwise.
        shm_inputs: inputs sent through the system shared-memory extension, as the
            codec read them (name -> ``pdserve.frontends.shared_memory.ShmInput``);
            the frontend copies them into ``inputs`` before the request goes on.
            ``None``: none.
        stream: the :class:`~pdserve.core.streaming.ResponseStream` of a request to a
            decoupled model (set by ``InferenceServer.infer_stream``); None: one response.
        timing: the request asked for its server timing: the core appends one
            :data:`pdserve.core.timing.Entry` per model it ran on; None: not asked.
        json_body: the request body as the client sent it when it is one V2 JSON
            document (HTTP, no binary or shared-memory inputs); None otherwise. The
            payload log may keep it as the record of the inputs.
        answered: set by the core's observer when it wants the response as sent: the
            front end calls it once the response is encoded, with the request, the
            outputs sent and the response body when that is one V2 JSON document (no
            binary or shared-memory outputs; else None). None: nobody asks.
    """

    model_name: str
    model_version: str = ""
    inputs: dict[str, np.ndarray] = field(default_factory=dict)
    outputs: list[RequestedOutput] | None = None
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
    arrival_ns: int = field(default_factory=time.monotonic_ns)
    cancelled: Any = None
    route_key: str = ""
    pinned_version: str = ""
    traceparent: str | bytes | None = None
    trace: Any = None
    shm_inputs: dict[str, Any] | None = None
    stream: Any = None
    timing: list[Any] | None = None
    json_body: bytes | bytearray | None = None
    answered: Callable[[InferRequest, dict[str, np.ndarray], bytes | None], None] | None = None


@dataclass(slots=True)
class InferResponse:
    """The result of one :class:`InferRequest`.

    Attributes:
        model_name / model_version: the model and the version that answered.
        outputs: output name -> numpy array, in the order they should be sent.
        id: the request id echoed.
        parameters: response-level parameters.
    """

    model_name: str
    model_version: str
    outputs: dict[str, np.ndarray]
    id: str = ""
    parameters: dict[str, Any] = field(default_factory=dict)
