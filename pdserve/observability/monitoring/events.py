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
import orjson

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


#: A queued record: an :class:`Entry` to encode from its tensors, or a request's JSON
#: Lines made on the request path from its bodies (:meth:`JsonLines.sent_lines`).
Record = Entry | bytes

#: the last second formatted, ``(epoch second, b"YYYY-MM-DDTHH:MM:SS.")``, replaced
#: whole: the request path and the writer thread both format times
_second: list[tuple[int, bytes]] = [(-1, b"")]


def _date_time(sec: int) -> bytes:
    """``b"2026-12-07T04:12:26."``: the date and time of an epoch second (cached)."""
    cached = _second[0]
    if cached[0] != sec:
        cached = (sec, time.strftime("%Y-%m-%dT%H:%M:%S.", time.gmtime(sec)).encode())
        _second[0] = cached
    return cached[1]


def _rfc3339(time_ns: int) -> bytes:
    """``b"2026-12-07T04:12:26.255185Z"`` (UTC, microseconds)."""
    sec, ns = divmod(time_ns, 1_000_000_000)
    return b"%s%06dZ" % (_date_time(sec), ns // 1000)


def events_of(entry: Entry, record: str, source: str, namespace: str = "") -> list[Event]:
    """The events of ``entry``: request and response (``record`` ``all``), one of them
    (``inputs`` / ``outputs``), or both without tensors (``metadata``)."""
    when = _rfc3339(entry.time_ns).decode()
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


def _datatype(dtype: np.dtype) -> str:
    """The V2 datatype of a tensor's numpy dtype (object / bytes / str: BYTES)."""
    if dtype.kind in "OSU":
        return "BYTES"
    datatype = _V2.get(dtype)
    if datatype is None:
        datatype = _V2[dtype] = numpy_to_v2(dtype)
    return datatype


def _json_data(array: np.ndarray) -> Any:
    """``array``'s V2 JSON ``data``: BYTES elements base64 (strings), else the flattened
    array, little-endian (serialise with ``orjson.OPT_SERIALIZE_NUMPY``)."""
    if array.dtype.kind in "OSU":
        return [
            base64.b64encode(x if isinstance(x, bytes) else str(x).encode()).decode()
            for x in array.reshape(-1)
        ]
    data = array.reshape(-1)  # a view when contiguous, else a contiguous copy
    if data.dtype.byteorder == ">":
        data = data.astype(data.dtype.newbyteorder("<"))
    return data


def tensor_json(name: str, array: np.ndarray) -> dict[str, Any]:
    """A V2 JSON tensor: numbers row-major, BYTES elements base64 (strings). Numeric
    ``data`` stays a numpy array: serialise with ``orjson.OPT_SERIALIZE_NUMPY``."""
    return {
        "name": name,
        "datatype": _datatype(array.dtype),
        "shape": list(array.shape),
        "data": _json_data(array),
    }


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


_NUMPY = orjson.OPT_SERIALIZE_NUMPY
_START = b'{"specversion":' + orjson.dumps(SPEC_VERSION) + b',"id":'
#: What comes between an event's id and its time, its time and its id in ``data``, then
#: the rest of ``data`` before the tensors; whether it is the request event; the key of
#: its tensors (``b""``: none recorded).
_Head = tuple[bytes, bytes, bytes, bool, bytes]
#: Tensor layouts (name, dtype, shape) whose JSON head is kept, at most.
MAX_TENSOR_HEADS = 1024


class JsonLines:
    """Encodes entries as JSON Lines: each event the line ``orjson.dumps(event_json(e))``
    gives for :func:`events_of`'s events, built from byte fragments cached per model,
    version and event type (and per tensor name, dtype and shape), so a record costs
    its ids, time and tensor data and no dictionaries.

    Args:
        record: ``all`` | ``inputs`` | ``outputs`` | ``metadata`` (as :func:`events_of`).
        source: the events' ``source`` attribute.
        namespace: the events' ``namespace`` attribute.
    """

    def __init__(self, record: str, source: str, namespace: str = "") -> None:
        self.record = record
        self.source = source
        self.namespace = namespace
        #: (model, version) -> one :data:`_Head` per event kind recorded
        self._heads: dict[tuple[str, str], list[_Head]] = {}
        #: (model, version) -> :meth:`sent_template`
        self._templates: dict[tuple[str, str], bytes] = {}
        #: (name, dtype, shape) -> the tensor's JSON up to its ``data`` value
        self._tensors: dict[tuple[str, np.dtype, tuple[int, ...]], bytes] = {}

    def _head(self, model: str, version: str) -> list[_Head]:
        d = orjson.dumps
        heads = []
        for kind, key in ((REQUEST_TYPE, b"inputs"), (RESPONSE_TYPE, b"outputs")):
            if self.record == ("outputs" if kind == REQUEST_TYPE else "inputs"):
                continue
            after_id = b',"source":' + d(self.source) + b',"type":' + d(kind) + b',"time":"'
            after_time = (
                b'","datacontenttype":' + d(CONTENT_TYPE)
                + b',"inferenceservicename":' + d(model) + b',"namespace":' + d(self.namespace)
                + b',"component":"predictor","endpoint":"","modelname":' + d(model)
                + b',"modelversion":' + d(version) + b',"data":{"id":'
            )  # fmt: skip
            body = b',"model_name":' + d(model) + b',"model_version":' + d(version)
            tensors = b"" if self.record == "metadata" else b',"' + key + b'":['
            heads.append((after_id, after_time, body, kind == REQUEST_TYPE, tensors))
        return heads

    def _tensor(self, name: str, array: np.ndarray) -> bytes:
        key = (name, array.dtype, array.shape)
        head = self._tensors.get(key)
        if head is None:
            head = (
                b'{"name":' + orjson.dumps(name)
                + b',"datatype":' + orjson.dumps(_datatype(array.dtype))
                + b',"shape":' + orjson.dumps(list(array.shape)) + b',"data":'
            )  # fmt: skip
            if len(self._tensors) < MAX_TENSOR_HEADS:
                self._tensors[key] = head
        return head + orjson.dumps(_json_data(array), option=_NUMPY) + b"}"

    def sent_template(self, model: str, version: str) -> bytes:
        """The ``%``-template of a request's lines made from its bodies (see
        :meth:`sent_lines`): per event recorded, the id, the time (second, then
        microseconds), the data's own id (or nothing) and the body less its brace."""
        template = self._templates.get((model, version))
        if template is None:
            template = b""
            for after_id, after_time, names, is_request, _ in self._head(model, version):
                template += (
                    _esc(_START) + b"%b" + _esc(after_id) + b"%b%06dZ"
                    + _esc(after_time.removesuffix(b'"id":')) + b"%b"
                    + (_esc(names[1:]) + b"," if is_request else b"") + b"%b}\n"
                )  # fmt: skip
            self._templates[(model, version)] = template
        return template

    def sent_lines(
        self, template: bytes, rid: str, made_up: bool, sent_in: Any, sent_out: Any
    ) -> bytes:
        """The JSON Lines of a request's events written from its body as received and
        its response as sent (each one V2 JSON document less its opening brace,
        bytes-like), in place of formatting its tensors.

        Args:
            template: :meth:`sent_template` of the request's model and version.
            rid: the request id.
            made_up: the logger made ``rid`` up (the bodies have no id).
        """
        jid = orjson.dumps(rid)
        own = b'"id":' + jid + b"," if made_up else b""  # the bodies have no id
        sec, ns = divmod(time.time_ns(), 1_000_000_000)
        day, us = _date_time(sec), ns // 1000  # the template adds the "Z"
        record = self.record
        if record == "all":
            args: tuple[Any, ...] = (jid, day, us, own, sent_in, jid, day, us, own, sent_out)
        else:
            args = (jid, day, us, own, sent_in if record == "inputs" else sent_out)
        return template % args

    def encode(self, entries: list[Record]) -> bytes:
        """The JSON Lines of ``entries``' events in order, each line ending in a newline.

        Raises:
            TypeError: a tensor orjson cannot serialise.
        """
        parts: list[bytes] = []
        add = parts.append
        dumps = orjson.dumps
        heads = self._heads
        tensor = self._tensor
        for e in entries:
            if type(e) is bytes:
                add(e)
                continue
            assert isinstance(e, Entry)
            head = heads.get((e.model, e.version))
            if head is None:
                head = heads[(e.model, e.version)] = self._head(e.model, e.version)
            jid = dumps(e.id)
            when = _rfc3339(e.time_ns)
            for after_id, after_time, body, request, key in head:
                add(_START)
                add(jid)
                add(after_id)
                add(when)
                add(after_time)
                add(jid)
                add(body)
                error = None if request else e.error
                tensors = e.inputs if request else e.outputs
                if error is not None:
                    add(b',"error":' + dumps(error))
                elif key and tensors is not None:
                    add(key)
                    add(b",".join([tensor(n, a) for n, a in tensors.items()]))
                    add(b"]")
                add(b"}}\n")
        return b"".join(parts)

    def lines(self, entries: list[Record]) -> list[bytes]:
        """``entries``' JSON Lines as pieces to write one after another, in order: lines
        made on the request path as they are, one piece per run of entries encoded from
        their tensors (:meth:`encode`).

        Raises:
            TypeError: a tensor orjson cannot serialise.
        """
        out: list[bytes] = []
        todo: list[Record] = []
        for e in entries:
            if type(e) is bytes:
                if todo:
                    out.append(self.encode(todo))
                    todo = []
                out.append(e)
            else:
                todo.append(e)
        if todo:
            out.append(self.encode(todo))
        return out


def _esc(fixed: bytes) -> bytes:
    """``fixed`` as literal text of a ``%``-template."""
    return fixed.replace(b"%", b"%%")


def json_rest(body: bytes | bytearray | None) -> bytes | bytearray | memoryview | None:
    """A V2 JSON request body less its opening brace (what follows the ``data``
    object's id and model names in a JSON Lines event), newlines made spaces
    (whitespace between tokens in valid JSON: one event per line); None without a body
    or when it is not a JSON object."""
    if body is None:
        return None
    if b"\n" in body or b"\r" in body:
        body = bytes(body).replace(b"\n", b" ").replace(b"\r", b" ")
    if body[:1] != b"{":
        body = body.lstrip()
        if body[:1] != b"{":
            return None
    return memoryview(body)[1:]


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
