"""One logged request as CloudEvents, as KServe's inference logger writes them.

A request gives a ``org.kubeflow.serving.inference.request`` event (its inputs) and a
``org.kubeflow.serving.inference.response`` event (its outputs, or its error), both with
the request id as ``id`` and KServe's extension attributes (``inferenceservicename``,
``namespace``, ``component``, ``endpoint``) plus ``modelname`` / ``modelversion``. The
``data`` of an event is a KServe V2 body: tensors with ``name``, ``datatype``, ``shape``
and ``data`` (JSON: numbers row-major, BOOL as booleans, BYTES base64). Parquet rows keep
each tensor's ``data`` as the V2 binary tensor encoding (little-endian, BYTES
length-prefixed), which :func:`tensor_from_row` decodes.
"""

from __future__ import annotations

import base64
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.core.datatypes import array_from_raw, numpy_to_v2, raw_tensor, v2_to_numpy

REQUEST_TYPE = "org.kubeflow.serving.inference.request"
RESPONSE_TYPE = "org.kubeflow.serving.inference.response"
SPEC_VERSION = "1.0"
CONTENT_TYPE = "application/json"


@dataclass(slots=True)
class Entry:
    """What the request path hands the logger for one sampled request: references,
    encoded later on the logger's thread."""

    id: str
    model: str
    version: str
    time_ns: int
    inputs: dict[str, np.ndarray] | None
    outputs: dict[str, np.ndarray] | None
    error: str | None
    parameters: dict[str, Any]
    size: int = 0  #: tensor bytes held (the queue's byte bound)


@dataclass(slots=True)
class Event:
    """One CloudEvent: its attributes (``type``, ``id``... as in structured mode) and
    its ``data`` tensors (name -> array) or error."""

    attributes: dict[str, str]
    tensors: dict[str, np.ndarray] | None
    error: str | None = None


_second: list[object] = [None, ""]  #: the last second formatted: [epoch second, text]


def _rfc3339(time_ns: int) -> str:
    """``2026-12-07T04:12:26.255185Z`` (the date and time part cached per second)."""
    sec, ns = divmod(time_ns, 1_000_000_000)
    if _second[0] != sec:
        _second[1] = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(sec))
        _second[0] = sec
    return f"{_second[1]}.{ns // 1000:06d}Z"


def events_of(entry: Entry, record: str, source: str, namespace: str = "") -> list[Event]:
    """The events of ``entry``: request and response (``record`` ``all``), one of them
    (``inputs`` / ``outputs``), or both without tensors (``metadata``)."""
    when = _rfc3339(entry.time_ns)
    events = []
    for kind, tensors, error in (
        (REQUEST_TYPE, entry.inputs, None),
        (RESPONSE_TYPE, entry.outputs, entry.error),
    ):
        if record == ("outputs" if kind == REQUEST_TYPE else "inputs"):
            continue
        attributes = {
            "specversion": SPEC_VERSION,
            "id": entry.id,
            "source": source,
            "type": kind,
            "time": when,
            "datacontenttype": CONTENT_TYPE,
            "inferenceservicename": entry.model,
            "namespace": namespace,
            "component": "predictor",
            "endpoint": "",
            "modelname": entry.model,
            "modelversion": entry.version,
        }
        events.append(Event(attributes, None if record == "metadata" else tensors, error))
    return events


def tensor_json(name: str, array: np.ndarray) -> dict[str, Any]:
    """A V2 JSON tensor: numbers row-major, BYTES elements base64 (strings). Numeric
    ``data`` stays a numpy array: serialise with ``orjson.OPT_SERIALIZE_NUMPY``."""
    if array.dtype.kind in "OSU":
        data: Any = [
            base64.b64encode(x if isinstance(x, bytes) else str(x).encode()).decode()
            for x in array.reshape(-1)
        ]
        return {"name": name, "datatype": "BYTES", "shape": list(array.shape), "data": data}
    datatype = _V2.get(array.dtype)
    if datatype is None:
        datatype = _V2[array.dtype] = numpy_to_v2(array.dtype)
    data = array.reshape(-1)  # a view when contiguous, else a contiguous copy
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": data}


#: numpy dtype -> V2 datatype, filled as dtypes are met.
_V2: dict[np.dtype, str] = {}


def event_json(event: Event) -> dict[str, Any]:
    """A structured-mode CloudEvent (JSON object) with its V2 body as ``data`` (the
    event's own attribute dict, ``data`` added: encode an event once)."""
    attrs = event.attributes
    body: dict[str, Any] = {
        "id": attrs["id"],
        "model_name": attrs["modelname"],
        "model_version": attrs["modelversion"],
    }
    if event.error is not None:
        body["error"] = event.error
    elif event.tensors is not None:
        key = "inputs" if attrs["type"] == REQUEST_TYPE else "outputs"
        body[key] = [tensor_json(n, a) for n, a in event.tensors.items()]
    doc: dict[str, Any] = attrs  # an event is encoded once: its attributes become the document
    doc["data"] = body
    return doc


def tensor_from_json(doc: dict[str, Any]) -> np.ndarray:
    """The array of a :func:`tensor_json` tensor (BYTES: an object array of bytes)."""
    shape = tuple(doc["shape"])
    if doc["datatype"] == "BYTES":
        out = np.empty(len(doc["data"]), dtype=object)
        out[:] = [base64.b64decode(x) for x in doc["data"]]
        return out.reshape(shape)
    return np.asarray(doc["data"], dtype=v2_to_numpy(doc["datatype"])).reshape(shape)


def tensor_row(name: str, array: np.ndarray) -> dict[str, Any]:
    """A Parquet tensor struct: name, datatype, shape, V2 binary data."""
    datatype, raw = raw_tensor(array)
    return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": raw}


def tensor_from_row(row: dict[str, Any]) -> np.ndarray:
    """The array of a :func:`tensor_row` struct (BYTES: an object array of bytes)."""
    shape = [int(d) for d in row["shape"]]
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    return array_from_raw(row["data"], row["datatype"], shape, count, f"tensor {row['name']!r}")


def kafka_headers(event: Event) -> list[tuple[str, bytes]]:
    """The CloudEvents Kafka binding's binary-mode headers: ``ce_<attribute>`` and
    ``content-type``."""
    headers = [
        ("ce_" + k, v.encode())
        for k, v in event.attributes.items()
        if k not in ("datacontenttype", "data")
    ]
    headers.append(("content-type", CONTENT_TYPE.encode()))
    return headers
