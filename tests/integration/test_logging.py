"""Triton's logging extension and pdserve's log lines against a real pdserve (issue 17).

``GET/POST /v2/logging`` and gRPC ``LogSettings`` with tritonclient; ``--log-format
json`` lines carrying the request id and the W3C trace id; no payload or credential
in the log; bad settings (each a test) answered 400 / INVALID_ARGUMENT, changing nothing.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, copy_models, start_server

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
SECRET = "s3cr3t-T0KEN-must-not-be-logged"
PAYLOAD_MARK = 123456.75  # a value that would show in a logged JSON payload

DEFAULTS = {
    "log_file": "",
    "log_info": True,
    "log_warning": True,
    "log_error": True,
    "log_verbose_level": 1,
    "log_format": "json",
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = copy_models(tmp_path_factory.mktemp("logging") / "repo", "tiny")
    srv = start_server(
        repo, repo.parent / "pdserve.log", "--log-format", "json", "--log-verbose", "1"
    )
    yield srv
    srv.stop()


def _http(
    server: ServerProcess, method: str, body: Any = None, raw: bytes | None = None
) -> tuple[int, Any]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/logging", data=data, method=method,
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _json_lines(server: ServerProcess) -> list[dict[str, Any]]:
    out = []
    for line in server.log().splitlines():
        if line.startswith("{"):
            out.append(json.loads(line))
    return out


def test_get_reports_the_flags_and_the_extension_is_advertised(server: ServerProcess) -> None:
    status, doc = _http(server, "GET")
    assert status == 200
    assert doc == DEFAULTS
    client = httpclient.InferenceServerClient(server.http_url)
    assert "logging" in client.get_server_metadata()["extensions"]
    assert client.get_log_settings() == DEFAULTS


def test_every_line_is_json_after_startup(server: ServerProcess) -> None:
    lines = [ln for ln in server.log().splitlines() if ln.strip()]
    assert lines
    for line in lines:
        doc = json.loads(line)  # raises on a non-JSON line
        assert {"time", "level", "logger", "pid", "message"} <= set(doc)
        assert doc["time"].endswith("Z")


def test_post_changes_only_what_it_names_http_and_grpc(server: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    got = client.update_log_settings({"log_verbose_level": 0})
    assert got == {**DEFAULTS, "log_verbose_level": 0}
    g = grpcclient.InferenceServerClient(server.grpc_url)
    got_grpc = g.get_log_settings(as_json=True)["settings"]
    assert got_grpc["log_verbose_level"] == {"uint32_param": 0}
    assert got_grpc["log_info"] == {"bool_param": True}
    assert got_grpc["log_format"] == {"string_param": "json"}
    changed = g.update_log_settings({"log_warning": False, "log_verbose_level": 1}, as_json=True)
    assert changed["settings"]["log_warning"] == {"bool_param": False}
    assert changed["settings"]["log_verbose_level"] == {"uint32_param": 1}
    assert client.get_log_settings() == {**DEFAULTS, "log_warning": False}
    assert client.update_log_settings({"log_warning": True}) == DEFAULTS


def _infer_tiny(
    server: ServerProcess, request_id: str, headers: dict[str, str] | None = None
) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    x = np.full((1, 64), PAYLOAD_MARK, dtype=np.float32)
    inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(x, binary_data=False)
    client.infer("tiny", [inp], request_id=request_id, headers=headers)


def test_request_lines_carry_request_and_trace_ids_and_no_secrets(server: ServerProcess) -> None:
    """A traced request with an Authorization header and a marked payload, then a bad
    one (wrong shape, 400), at verbose level 1: neither the token nor a payload value
    is in the log, and every line with a request id has that request's trace id."""
    headers = {"traceparent": TRACEPARENT, "Authorization": f"Bearer {SECRET}"}
    _infer_tiny(server, "req-ok-1", headers)
    # a bad request (wrong shape) inside a traced request: answered 400, may log
    client = httpclient.InferenceServerClient(server.http_url)
    bad = httpclient.InferInput("INPUT0", [1, 3], "FP32")
    bad.set_data_from_numpy(np.full((1, 3), PAYLOAD_MARK, dtype=np.float32), binary_data=False)
    with pytest.raises(InferenceServerException):
        client.infer("tiny", [bad], request_id="req-bad-1", headers=headers)
    time.sleep(0.5)
    text = server.log()
    assert SECRET not in text
    assert str(PAYLOAD_MARK) not in text and "123456" not in text
    for doc in _json_lines(server):
        if "request_id" in doc:
            assert doc.get("trace_id") in (None, TRACE_ID)


def test_a_log_line_inside_a_request_has_both_ids(server: ServerProcess) -> None:
    """The python model ``tiny`` does not log; a request line is made with the
    ``pdserve.request`` debug line the HTTP frontend writes at verbose level >= 1."""
    _infer_tiny(server, "req-ids-7", {"traceparent": TRACEPARENT})
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        mine = [d for d in _json_lines(server) if d.get("request_id") == "req-ids-7"]
        if mine:
            break
        time.sleep(0.1)
    assert mine, server.log()[-2000:]
    assert all(d["trace_id"] == TRACE_ID for d in mine)
    # a request without traceparent: request id only; no id given: a generated one
    _infer_tiny(server, "")
    time.sleep(0.3)
    lines = [d for d in _json_lines(server) if d["logger"] == "pdserve.request"]
    last = lines[-1]
    assert len(last["request_id"]) == 32 and last["request_id"] != "req-ids-7"
    assert "trace_id" not in last


def test_a_future_version_traceparent_names_the_log_lines_http_and_grpc(
    server: ServerProcess,
) -> None:
    """A ``traceparent`` of a later version with more fields (W3C: read the first four)
    joins the client's trace, and the request's log lines carry that trace id: one
    parser decides both (HTTP and gRPC)."""
    future = f"01-{TRACE_ID}-00f067aa0ba902b7-01-more"
    _infer_tiny(server, "req-future-http", {"traceparent": future})
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inp = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 64), dtype=np.float32))
    client.infer("tiny", [inp], request_id="req-future-grpc", headers={"traceparent": future})
    for rid in ("req-future-http", "req-future-grpc"):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            mine = [d for d in _json_lines(server) if d.get("request_id") == rid]
            if mine:
                break
            time.sleep(0.1)
        assert mine, server.log()[-2000:]
        assert all(d.get("trace_id") == TRACE_ID for d in mine), mine


BAD = [
    ({"log_info": "true"}, "log_info", "boolean"),
    ({"log_warning": 1}, "log_warning", "boolean"),
    ({"log_error": None}, "log_error", "boolean"),
    ({"log_verbose_level": -1}, "log_verbose_level", "unsigned integer"),
    ({"log_verbose_level": 1.5}, "log_verbose_level", "unsigned integer"),
    ({"log_verbose_level": True}, "log_verbose_level", "unsigned integer"),
    ({"log_verbose_level": 2**32}, "log_verbose_level", "unsigned integer"),
    ({"log_verbose_level": "2"}, "log_verbose_level", "unsigned integer"),
    ({"log_format": "xml"}, "log_format", "default, ISO8601, json"),
    ({"log_format": 3}, "log_format", "string"),
    ({"log_file": "/tmp/x.log"}, "log_file", "cannot be changed"),
    ({"log_file": 3}, "log_file", "string"),
    ({"log_levels": True}, "log_levels", "unknown log setting"),
    ({"log_info": False, "log_format": "nope"}, "log_format", "must be one of"),
]


@pytest.mark.parametrize(("body", "name", "words"), BAD, ids=[str(b) for b, _, _ in BAD])
def test_bad_setting_is_400_and_changes_nothing(
    server: ServerProcess, body: dict[str, Any], name: str, words: str
) -> None:
    status, doc = _http(server, "POST", body)
    assert status == 400, doc
    assert name in doc["error"] and words in doc["error"], doc
    assert _http(server, "GET") == (200, DEFAULTS)  # all or nothing: log_info unchanged


@pytest.mark.parametrize("raw", [b"[1]", b"not json", b'"log_info"'])
def test_body_that_is_not_an_object_is_400(server: ServerProcess, raw: bytes) -> None:
    status, doc = _http(server, "POST", raw=raw)
    assert status == 400 and "error" in doc


def test_wrong_method_is_405(server: ServerProcess) -> None:
    status, _ = _http(server, "PUT", {})
    assert status == 405


@pytest.mark.parametrize(
    ("name", "slot", "value", "words"),
    [
        ("log_info", "string_param", "yes", "boolean"),
        ("log_error", "uint32_param", 1, "boolean"),
        ("log_verbose_level", "bool_param", True, "unsigned integer"),
        ("log_verbose_level", "string_param", "2", "unsigned integer"),
        ("log_format", "uint32_param", 2, "string"),
        ("log_format", "string_param", "xml", "must be one of"),
        ("log_info", None, None, "boolean"),  # a value with no oneof set
        ("nope", "bool_param", True, "unknown log setting"),
    ],
)
def test_grpc_bad_setting_is_invalid_argument(
    server: ServerProcess, name: str, slot: str | None, value: Any, words: str
) -> None:
    """Raw ``LogSettingsRequest`` messages (tritonclient picks the slot by name, so it
    cannot send a wrong type): INVALID_ARGUMENT naming the setting, nothing changed."""
    request = service_pb2.LogSettingsRequest()
    entry = request.settings[name]
    if slot is not None:
        setattr(entry, slot, value)
    with grpc.insecure_channel(server.grpc_url) as channel:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.LogSettings(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert name in info.value.details() and words in info.value.details()
    assert httpclient.InferenceServerClient(server.http_url).get_log_settings() == DEFAULTS


def test_server_still_serves_after_the_bad_settings(server: ServerProcess) -> None:
    _infer_tiny(server, "after")
    assert server.proc.poll() is None
