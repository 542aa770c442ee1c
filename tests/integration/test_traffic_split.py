"""Traffic split between versions of one model (issue 12, item 4): weighted canary,
sticky routing by key, version pinning by header or metadata, the traffic file and
its admin endpoint, and the bad-input cases (weights that do not sum, versions that
are not served)."""

from __future__ import annotations

import collections
import shutil
import socket
import struct
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import unquote

import h2.config
import h2.connection
import h2.events
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

from tests.conftest import EXAMPLE_REPO, ServerProcess, require_examples, start_server
from tests.traffic_helpers import (
    X,
    base_output,
    http,
    infer_tiny,
    metric_value,
    offset_of,
    scrape,
    wait_for,
)

MODEL = "canary"


def _repo(tmp: Path) -> Path:
    require_examples()
    repo = tmp / "repo"
    repo.mkdir()
    shutil.copytree(EXAMPLE_REPO / "tiny_all_versions", repo / MODEL)
    cfg = (repo / MODEL / "config.pbtxt").read_text().replace("tiny_all_versions", MODEL)
    (repo / MODEL / "config.pbtxt").write_text(cfg)
    (repo / MODEL / "traffic.yaml").write_text("weights: {1: 70, 3: 30}\n")
    # weights that sum to 90: a clear load error for this model only
    shutil.copytree(repo / MODEL, repo / "badsum")
    (repo / "badsum" / "config.pbtxt").write_text(cfg.replace(MODEL, "badsum"))
    (repo / "badsum" / "traffic.yaml").write_text("weights: {1: 60, 2: 30}\n")
    # a version the policy does not load gets its share redistributed
    shutil.copytree(repo / MODEL, repo / "ghost")
    (repo / "ghost" / "config.pbtxt").write_text(cfg.replace(MODEL, "ghost"))
    (repo / "ghost" / "traffic.yaml").write_text("weights: {2: 50, 9: 50}\n")
    return repo


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("split")
    srv = start_server(
        _repo(tmp),
        tmp / "pdserve.log",
        "--model-control-mode=poll",
        "--repository-poll-secs=0.3",
    )
    yield srv
    srv.stop()


def _versions(
    server: ServerProcess, n: int, headers: dict[str, str] | None = None
) -> collections.Counter[str]:
    seen: collections.Counter[str] = collections.Counter()
    for _ in range(n):
        status, doc = infer_tiny(server, MODEL, headers)
        assert status == 200, doc
        # the version reported is the version that computed the answer
        assert offset_of(doc) == float(doc["model_version"])
        seen[doc["model_version"]] += 1
    return seen


def test_weighted_split_and_reported_version(server: ServerProcess) -> None:
    seen = _versions(server, 400)
    assert set(seen) == {"1", "3"}
    # 30 % canary; 400 draws: sd 2.3 points, the bound is 4 sd
    assert 0.20 <= seen["3"] / 400 <= 0.40, seen
    status, doc, _ = http(server, "GET", f"/v2/models/{MODEL}/traffic")
    assert status == 200
    assert doc["source"] == "file"
    assert doc["weights"] == {"1": 70.0, "3": 30.0}
    assert doc["routed"]["3"]["split"] >= seen["3"]
    text = scrape(server)
    assert metric_value(
        text, "pdserve_traffic_requests_total", model=MODEL, version="3", route="split"
    )
    assert metric_value(text, "pdserve_traffic_weight", model=MODEL, version="3") == 30.0


def test_sticky_key_sees_one_version(server: ServerProcess) -> None:
    per_key = {}
    for i in range(60):
        key = f"user-{i}"
        seen = _versions(server, 4, {"x-pdserve-route-key": key})
        assert len(seen) == 1, (key, seen)
        per_key[key] = next(iter(seen))
    share = sum(v == "3" for v in per_key.values()) / len(per_key)
    assert 0.1 <= share <= 0.55, per_key  # keys spread over both versions
    # gRPC metadata: the same key, the same version
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inp = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(X)
    for key in list(per_key)[:10]:
        r = client.infer(MODEL, [inp], headers={"x-pdserve-route-key": key})
        assert r.get_response().model_version == per_key[key]


def test_pin_header_and_explicit_version_are_never_split(server: ServerProcess) -> None:
    seen = _versions(server, 20, {"x-pdserve-model-version": "2"})
    assert seen == {"2": 20}
    for _ in range(20):
        status, doc = infer_tiny(server, MODEL, version="1")
        assert status == 200 and doc["model_version"] == "1"
    status, doc = infer_tiny(server, MODEL, {"x-pdserve-model-version": "8"})
    assert status == 404 and "version 8" in doc["error"]
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inp = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(X)
    r = client.infer(MODEL, [inp], headers={"x-pdserve-model-version": "2"})
    assert r.get_response().model_version == "2"
    assert np.allclose(r.as_numpy("OUTPUT0") - 2, base_output())


def _raw_grpc_infer(
    server: ServerProcess, metadata: list[tuple[bytes, bytes]]
) -> tuple[dict[bytes, bytes], service_pb2.ModelInferResponse | None]:
    """A ModelInfer of X sent with raw HTTP/2 (grpcio clients refuse metadata values
    that are not printable ASCII; the bytes on the wire are what the server reads):
    the response headers and trailers merged, and the response message (None on an
    error)."""
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="INPUT0", datatype="FP32", shape=[1, 64])
    request.raw_input_contents.append(X.tobytes())
    msg = request.SerializeToString()
    conn = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding=None))
    conn.initiate_connection()
    sock = socket.create_connection(("127.0.0.1", server.grpc_port), timeout=10)
    try:
        sid = conn.get_next_available_stream_id()
        head = [
            (b":method", b"POST"),
            (b":scheme", b"http"),
            (b":path", b"/inference.GRPCInferenceService/ModelInfer"),
            (b":authority", b"localhost"),
            (b"content-type", b"application/grpc"),
            (b"te", b"trailers"),
            *metadata,
        ]
        conn.send_headers(sid, head)
        conn.send_data(sid, struct.pack(">BI", 0, len(msg)) + msg, end_stream=True)
        sock.sendall(conn.data_to_send())
        got: dict[bytes, bytes] = {}
        body = b""
        while True:
            data = sock.recv(65536)
            assert data, "connection closed"
            for ev in conn.receive_data(data):
                if isinstance(ev, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    got.update(dict(ev.headers))  # type: ignore[arg-type]  # bytes pairs
                elif isinstance(ev, h2.events.DataReceived):
                    body += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, sid)
                elif isinstance(ev, h2.events.StreamEnded):
                    if not body:
                        return got, None
                    return got, service_pb2.ModelInferResponse.FromString(body[5:])
            sock.sendall(conn.data_to_send())
    finally:
        sock.close()


def _http_client_infer(server: ServerProcess, headers: dict[str, str]) -> str:
    """The version that answered a tritonclient HTTP inference of X with ``headers``
    (tritonclient sends a header value as its latin-1 bytes)."""
    client = httpclient.InferenceServerClient(server.http_url)
    inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(X)
    return str(client.infer(MODEL, [inp], headers=headers).get_response()["model_version"])


def _as_utf8_on_the_wire(text: str) -> str:
    """The header value a latin-1-encoding client (tritonclient HTTP) must be given to
    put ``text``'s UTF-8 bytes on the wire (as curl or a Go client sends it)."""
    return text.encode().decode("latin-1")


def test_a_pinned_version_reads_the_same_on_http_and_grpc(server: ServerProcess) -> None:
    """Header values are bytes on the wire; both protocols read them as grpcio reads
    metadata (UTF-8, else latin-1), so a pinned version that is not a number is named
    as the client wrote it, whatever the protocol or the client's encoding."""
    for value in (_as_utf8_on_the_wire("v\u00fc"), "v\u00fc"):  # UTF-8, then latin-1 bytes
        with pytest.raises(InferenceServerException, match="model version 'v\u00fc' is not"):
            _http_client_infer(server, {"x-pdserve-model-version": value})
    for raw in ("v\u00fc".encode(), "v\u00fc".encode("latin-1")):
        got, response = _raw_grpc_infer(server, [(b"x-pdserve-model-version", raw)])
        assert response is None
        assert got[b"grpc-status"] == b"3"  # INVALID_ARGUMENT
        assert "model version 'v\u00fc' is not" in unquote(got[b"grpc-message"].decode())
    # a version that is served: the same over both
    assert _http_client_infer(server, {"x-pdserve-model-version": "2"}) == "2"
    got, response = _raw_grpc_infer(server, [(b"x-pdserve-model-version", b"2")])
    assert response is not None and response.model_version == "2", got


def test_a_route_key_routes_the_same_however_it_is_sent(server: ServerProcess) -> None:
    """One sticky key, one version: over HTTP as UTF-8 or latin-1 bytes, and as the
    UTF-8 bytes of gRPC metadata."""
    for i in range(16):
        key = f"k\u00e4y-{i}"
        latin1 = _http_client_infer(server, {"x-pdserve-route-key": key})
        utf8 = _http_client_infer(server, {"x-pdserve-route-key": _as_utf8_on_the_wire(key)})
        _, response = _raw_grpc_infer(server, [(b"x-pdserve-route-key", key.encode())])
        assert response is not None
        assert latin1 == utf8 == response.model_version, (key, latin1, utf8)


def test_weights_that_do_not_sum_are_a_clear_load_error(server: ServerProcess) -> None:
    status, rows, _ = http(server, "POST", "/v2/repository/index", {})
    row = next(r for r in rows if r["name"] == "badsum")
    assert row.get("state") == "UNAVAILABLE"
    assert "weights sum to 90" in row["reason"] and "traffic.yaml" in row["reason"]
    status, doc = infer_tiny(server, "badsum")
    assert status == 503
    assert infer_tiny(server, MODEL)[0] == 200  # the server and other models carry on


def test_unserved_version_share_goes_to_the_served_ones(server: ServerProcess) -> None:
    status, doc, _ = http(server, "GET", "/v2/models/ghost/traffic")
    assert status == 200
    for _ in range(20):
        status, body = infer_tiny(server, "ghost")
        assert status == 200 and body["model_version"] == "2"
    status, doc, _ = http(server, "GET", "/v2/models/ghost/traffic")
    assert doc["unserved"] == ["9"]


def test_admin_endpoint_changes_traffic_and_refuses_bad_weights(server: ServerProcess) -> None:
    status, doc, _ = http(server, "POST", f"/v2/models/{MODEL}/traffic", {"weights": {"1": 50}})
    assert status == 400 and "sum to 50" in doc["error"]
    status, doc, _ = http(
        server, "POST", f"/v2/models/{MODEL}/traffic", {"weights": {"1": -5, "2": 105}}
    )
    assert status == 400
    status, doc, _ = http(server, "POST", f"/v2/models/{MODEL}/traffic", {"bogus": 1})
    assert status == 400 and "unknown key" in doc["error"]
    status, doc, _ = http(server, "POST", f"/v2/models/{MODEL}/traffic", {})
    assert status == 400 and "empty" in doc["error"]
    status, doc, _ = http(server, "POST", f"/v2/models/{MODEL}/traffic", {"reset": "yes"})
    assert status == 400 and "'reset' must be true" in doc["error"]
    status, doc, _ = http(server, "GET", f"/v2/models/{MODEL}/traffic")
    assert doc["weights"] == {"1": 70.0, "3": 30.0}  # nothing changed
    status, doc, _ = http(server, "POST", f"/v2/models/{MODEL}/traffic", {"weights": {"2": 100}})
    assert status == 200 and doc["source"] == "admin"
    assert _versions(server, 30) == {"2": 30}
    status, doc, _ = http(server, "DELETE", f"/v2/models/{MODEL}/traffic")
    assert status == 405
    status, doc, _ = http(server, "POST", f"/v2/models/{MODEL}/traffic", {"reset": True})
    assert status == 200 and doc["source"] == "file"
    assert set(_versions(server, 60)) == {"1", "3"}


def test_traffic_file_change_is_picked_up_without_reloading_versions(
    server: ServerProcess,
) -> None:
    status, before, _ = http(server, "GET", f"/v2/models/{MODEL}/stats")
    args = list(map(str, server.proc.args))  # the command line start_server built
    repo = Path(args[args.index("--model-repository") + 1])
    (repo / MODEL / "traffic.yaml").write_text("weights: {3: 100}\n")

    def switched() -> bool:
        return http(server, "GET", f"/v2/models/{MODEL}/traffic")[1]["weights"] == {"3": 100.0}

    wait_for(switched, 30, "the new traffic file")
    assert _versions(server, 20) == {"3": 20}
    # a bad edit keeps the traffic that served
    (repo / MODEL / "traffic.yaml").write_text("weights: {3: 10}\n")
    time_limit = 30
    wait_for(
        lambda: any(
            "weights sum to 10" in r.get("reason", "")
            for r in http(server, "POST", "/v2/repository/index", {})[1]
            if r["name"] == MODEL
        ),
        time_limit,
        "the reload failure in the index",
    )
    assert _versions(server, 10) == {"3": 10}
    status, after, _ = http(server, "GET", f"/v2/models/{MODEL}/stats")
    # same version objects: their statistics kept counting (nothing was reloaded)
    succ = {s["version"]: s["inference_stats"]["success"]["count"] for s in after["model_stats"]}
    prev = {s["version"]: s["inference_stats"]["success"]["count"] for s in before["model_stats"]}
    assert succ["3"] >= prev["3"] + 30
    assert "Traceback" not in server.log()
