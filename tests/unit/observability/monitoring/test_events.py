"""pdserve.observability.monitoring.events: CloudEvents with KServe's attributes, and
tensors that come back exactly (dtype, shape, values) from JSON and Parquet rows for
every V2 datatype, BYTES included."""

from __future__ import annotations

import numpy as np
import orjson
import pytest

from pdserve.core.datatypes import bytes_array
from pdserve.observability.monitoring.events import (
    REQUEST_TYPE,
    RESPONSE_TYPE,
    Entry,
    JsonLines,
    event_json,
    events_of,
    kafka_headers,
    tensor_from_json,
    tensor_from_row,
    tensor_json,
    tensor_row,
)

ARRAYS = {
    "BOOL": np.array([[True, False, True]]),
    "UINT8": np.array([[0, 255]], dtype=np.uint8),
    "UINT16": np.array([[1, 65535]], dtype=np.uint16),
    "UINT32": np.array([[1, 2**32 - 1]], dtype=np.uint32),
    "UINT64": np.array([[1, 2**64 - 1]], dtype=np.uint64),
    "INT8": np.array([[-128, 127]], dtype=np.int8),
    "INT16": np.array([[-32768, 7]], dtype=np.int16),
    "INT32": np.array([[-(2**31), 5]], dtype=np.int32),
    "INT64": np.array([[-(2**63), 2**63 - 1]], dtype=np.int64),
    "FP16": np.array([[0.1, -65504.0, 1e-3]], dtype=np.float16),
    "FP32": np.array([[0.1, np.pi, -1e-30]], dtype=np.float32),
    "FP64": np.array([[0.1, np.e, 1e300]], dtype=np.float64),
    "BYTES": bytes_array([b"\x00\xff binary", "text ☃".encode(), b""]).reshape(1, 3),
}


@pytest.mark.parametrize("datatype", sorted(ARRAYS))
def test_every_dtype_round_trips(datatype: str) -> None:
    a = ARRAYS[datatype]
    doc = orjson.loads(orjson.dumps(tensor_json("t", a), option=orjson.OPT_SERIALIZE_NUMPY))
    assert doc["datatype"] == datatype and doc["shape"] == list(a.shape)
    for back in (tensor_from_json(doc), tensor_from_row(tensor_row("t", a))):
        assert back.shape == a.shape
        if datatype == "BYTES":
            assert back.dtype == object and list(back.reshape(-1)) == list(a.reshape(-1))
        else:
            assert back.dtype == a.dtype
            np.testing.assert_array_equal(back, a)
    if datatype == "BYTES":  # base64 in JSON
        assert doc["data"][0] == "AP8gYmluYXJ5"


def _entry(error: str | None = None) -> Entry:
    return Entry(
        "req-1",
        "m",
        "2",
        1_700_000_000_123_456_000,
        {"IN": ARRAYS["FP32"]},
        None if error else {"OUT": ARRAYS["INT64"]},
        error,
        {},
    )


def test_request_and_response_events() -> None:
    req, resp = events_of(_entry(), "all", "pdserve://host")
    assert req.attributes["type"] == REQUEST_TYPE and resp.attributes["type"] == RESPONSE_TYPE
    for e in (req, resp):
        a = e.attributes
        assert (a["id"], a["source"], a["specversion"]) == ("req-1", "pdserve://host", "1.0")
        assert (a["inferenceservicename"], a["modelname"], a["modelversion"]) == ("m", "m", "2")
        assert a["time"] == "2023-11-14T22:13:20.123456Z"
    body = event_json(req)["data"]
    assert body["model_name"] == "m" and [t["name"] for t in body["inputs"]] == ["IN"]
    assert [t["name"] for t in event_json(resp)["data"]["outputs"]] == ["OUT"]


def test_record_modes_and_errors() -> None:
    assert [e.attributes["type"] for e in events_of(_entry(), "inputs", "s")] == [REQUEST_TYPE]
    assert [e.attributes["type"] for e in events_of(_entry(), "outputs", "s")] == [RESPONSE_TYPE]
    meta = events_of(_entry(), "metadata", "s")
    assert len(meta) == 2 and all(e.tensors is None for e in meta)
    assert "inputs" not in event_json(meta[0])["data"]
    failed = events_of(_entry("boom"), "outputs", "s")[0]
    assert event_json(failed)["data"]["error"] == "boom"


def test_kafka_headers_binary_mode() -> None:
    e = events_of(_entry(), "inputs", "s")[0]
    headers = dict(kafka_headers(e))
    assert headers["ce_id"] == b"req-1" and headers["ce_type"] == REQUEST_TYPE.encode()
    assert headers["ce_specversion"] == b"1.0" and headers["content-type"] == b"application/json"
    assert headers["ce_inferenceservicename"] == b"m"


@pytest.mark.parametrize("record", ["all", "inputs", "outputs", "metadata"])
def test_json_lines_are_the_events_json(record: str) -> None:
    """JsonLines' bytes equal each event's ``event_json`` serialised, for every dtype,
    a non-contiguous big-endian output, errors and ids that need escaping."""
    outputs = {**ARRAYS, "strided": np.arange(12, dtype=">f4").reshape(3, 4)[:, ::2]}
    inputs = {f"IN_{k}": v for k, v in ARRAYS.items()}
    encoder = JsonLines(record, "pdserve://host")
    for error in (None, 'bad "input"\n☃'):
        entry = Entry('id"\\1', 'm"', "2", 1_700_000_000_123_456_000, inputs, outputs, error, {})
        events = events_of(entry, record, "pdserve://host")
        want = b"".join(
            orjson.dumps(event_json(e), option=orjson.OPT_SERIALIZE_NUMPY) + b"\n" for e in events
        )
        got = encoder.encode([entry, entry])
        assert got == want * 2
        doc = orjson.loads(got.split(b"\n")[-2])
        assert doc["id"] == 'id"\\1' and doc["data"]["model_name"] == 'm"'
