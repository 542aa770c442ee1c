"""Authentication and authorisation in the server (issue 12, item 1): API keys, JWT,
Triton's restricted-API flags, the same rules over HTTP and gRPC, reload, and bad
input (missing/corrupt files, bad tokens) that never takes the server down.

A real pdserve serves ``tiny`` and ``tiny_specific`` (example models) with an auth
config: ``team-a`` may infer ``tiny`` only; ``ops`` may use every API; JWTs signed by
the test key (``tests/traffic_keys.py``) carry their models and APIs as claims.
Statistics are also restricted Triton's way (``admin-key: open-sesame``).
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ServerProcess, copy_models, start_server
from tests.traffic_keys import scrypt_hash, sha256_hash, token, write_jwks

KEY_A = "team-a-secret-4f9c2d"
KEY_OPS = "ops-secret-77aa01"
KEY_NEW = "added-later-secret-93bd"
RESTRICTED = "statistics:admin-key=open-sesame"


def config_text(extra_key: bool = False) -> str:
    text = f"""
keys:
  - name: team-a
    hash: {sha256_hash(KEY_A)}
    models: [tiny]
    apis: [inference, metadata]
  - name: ops
    hash: {scrypt_hash(KEY_OPS)}
    apis: ["*"]
jwt:
  jwks_file: jwks.json
  audience: pdserve
  issuer: https://idp.test/
  leeway_secs: 2
"""
    if extra_key:
        text = text.replace(
            "keys:\n", f"keys:\n  - name: newcomer\n    hash: {sha256_hash(KEY_NEW)}\n", 1
        )
    return text


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Path]]:
    base = tmp_path_factory.mktemp("auth")
    repo = copy_models(base / "models", "tiny", "tiny_specific")
    write_jwks(base / "jwks.json")
    cfg = base / "auth.yaml"
    cfg.write_text(config_text())
    proc = start_server(
        repo,
        base / "pdserve.log",
        "--auth-config",
        str(cfg),
        "--http-restricted-api",
        RESTRICTED,
        "--grpc-restricted-protocol",
        RESTRICTED,
    )
    yield proc, cfg
    proc.stop()


@pytest.fixture(scope="module")
def server(setup: tuple[ServerProcess, Path]) -> ServerProcess:
    return setup[0]


def http_call(
    server: ServerProcess,
    path: str,
    headers: dict[str, str] | None = None,
    body: bytes | None = None,
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        f"http://{server.http_url}{path}",
        data=body,
        headers=headers or {},
        method="POST" if body is not None else "GET",
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


INFER_BODY = json.dumps(
    {"inputs": [{"name": "INPUT0", "shape": [1, 64], "datatype": "FP32", "data": [0.5] * 64}]}
).encode()


def infer_status(server: ServerProcess, model: str, headers: dict[str, str]) -> tuple[int, bytes]:
    status, _, body = http_call(
        server,
        f"/v2/models/{model}/infer",
        {**headers, "Content-Type": "application/json"},
        INFER_BODY,
    )
    return status, body


def bearer(tok: str) -> dict[str, str]:
    return {"authorization": f"Bearer {tok}"}


def test_health_stays_open_and_no_credential_is_401(server: ServerProcess) -> None:
    assert http_call(server, "/v2/health/ready")[0] == 200
    assert http_call(server, "/v2/health/live")[0] == 200
    assert http_call(server, "/v2/models/tiny/ready")[0] == 200
    status, headers, body = http_call(server, "/v2/models/tiny")
    assert status == 401
    assert headers["www-authenticate"] == 'Bearer realm="pdserve"'
    assert b"authentication required" in body
    assert infer_status(server, "tiny", {})[0] == 401


def test_api_keys_over_http(server: ServerProcess) -> None:
    status, body = infer_status(server, "tiny", bearer(KEY_A))
    assert status == 200 and json.loads(body)["outputs"][0]["name"] == "OUTPUT0"
    # Triton's access-token header carries the same key
    assert infer_status(server, "tiny", {"triton-access-token": KEY_A})[0] == 200
    assert infer_status(server, "tiny", bearer("wrong-key"))[0] == 401
    assert infer_status(server, "tiny", {"Authorization": "Basic abc"})[0] == 401
    status, body = infer_status(server, "tiny_specific", bearer(KEY_A))
    assert status == 403 and b"may not use model 'tiny_specific'" in body
    # admin APIs: team-a may not, ops may
    assert http_call(server, "/v2/repository/index", bearer(KEY_A), b"{}")[0] == 403
    assert http_call(server, "/v2/repository/index", bearer(KEY_OPS), b"{}")[0] == 200
    assert http_call(server, "/v2/models/tiny/config", bearer(KEY_A))[0] == 403
    assert http_call(server, "/v2/models/tiny/config", bearer(KEY_OPS))[0] == 200
    assert infer_status(server, "tiny_specific", bearer(KEY_OPS))[0] == 200


def test_tritonclient_http_with_headers(server: ServerProcess) -> None:
    client = httpclient.InferenceServerClient(server.http_url)
    x = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    out = client.infer("tiny", [x], headers=bearer(KEY_A)).as_numpy("OUTPUT0")
    assert out.shape == (1, 64)
    with pytest.raises(InferenceServerException) as e:
        client.infer("tiny", [x])
    assert e.value.status() == "401"
    assert client.is_server_live()  # health needs no header


def test_restricted_api_is_tritons_header_check(server: ServerProcess) -> None:
    status, _, body = http_call(server, "/v2/models/stats", bearer(KEY_OPS))
    assert status == 403
    assert json.loads(body)["error"] == "This API is restricted, expecting header 'admin-key'"
    ok = http_call(server, "/v2/models/stats", {**bearer(KEY_OPS), "admin-key": "open-sesame"})
    assert ok[0] == 200
    wrong = http_call(server, "/v2/models/stats", {**bearer(KEY_OPS), "admin-key": "open"})
    assert wrong[0] == 403


def test_jwt_over_http(server: ServerProcess) -> None:
    assert infer_status(server, "tiny", bearer(token(models=["tiny*"])))[0] == 200
    assert infer_status(server, "tiny_specific", bearer(token(models=["tiny*"])))[0] == 200
    assert infer_status(server, "tiny", bearer(token(models=["other"])))[0] == 403
    for bad in (
        token(exp_in=-60),
        token(aud="not-pdserve"),
        token(iss="https://other/"),
        token(other_key=True),
        "eyJhbGciOiJSUzI1NiJ9.bm90IGpzb24.c2ln",
        "a.b.c",
    ):
        status, body = infer_status(server, "tiny", bearer(bad))
        assert status == 401, body
    assert http_call(server, "/v2/repository/index", bearer(token()), b"{}")[0] == 403


def grpc_input() -> list[grpcclient.InferInput]:
    x = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
    x.set_data_from_numpy(np.ones((1, 64), np.float32))
    return [x]


def test_same_rules_over_grpc(server: ServerProcess) -> None:
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        assert client.is_server_live() and client.is_server_ready()  # health: open
        assert client.is_model_ready("tiny")
        with pytest.raises(InferenceServerException) as e:
            client.infer("tiny", grpc_input())
        assert e.value.status() == "StatusCode.UNAUTHENTICATED"
        out = client.infer("tiny", grpc_input(), headers=bearer(KEY_A))
        assert out.as_numpy("OUTPUT0").shape == (1, 64)
        out = client.infer("tiny", grpc_input(), headers={"triton-access-token": KEY_A})
        assert out.as_numpy("OUTPUT0").shape == (1, 64)
        with pytest.raises(InferenceServerException) as e:
            client.infer("tiny_specific", grpc_input(), headers=bearer(KEY_A))
        assert e.value.status() == "StatusCode.PERMISSION_DENIED"
        with pytest.raises(InferenceServerException) as e:
            client.infer("tiny", grpc_input(), headers=bearer(token(exp_in=-60)))
        assert e.value.status() == "StatusCode.UNAUTHENTICATED"
        with pytest.raises(InferenceServerException) as e:
            client.get_model_repository_index(headers=bearer(KEY_A))
        assert e.value.status() == "StatusCode.PERMISSION_DENIED"
        assert client.get_model_repository_index(headers=bearer(KEY_OPS)).models
        # restricted statistics: Triton's gRPC header form
        with pytest.raises(InferenceServerException) as e:
            client.get_inference_statistics(headers=bearer(KEY_OPS))
        assert "expecting header 'triton-grpc-protocol-admin-key'" in e.value.message()
        headers = {**bearer(KEY_OPS), "triton-grpc-protocol-admin-key": "open-sesame"}
        assert client.get_inference_statistics(headers=headers).model_stats
    finally:
        client.close()


def test_grpc_stream_checks_the_stream_and_each_request(server: ServerProcess) -> None:
    results: list[tuple[object, object]] = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    try:
        client.start_stream(
            lambda result, error: results.append((result, error)), headers=bearer(KEY_A)
        )
        client.async_stream_infer("tiny", grpc_input(), request_id="ok")
        client.async_stream_infer("tiny_specific", grpc_input(), request_id="no")
        deadline = time.monotonic() + 30
        while len(results) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        client.stop_stream()
    finally:
        client.close()
    oks = [r for r, e in results if e is None]
    errors = [e for r, e in results if e is not None]
    assert len(oks) == 1 and oks[0].get_response().id == "ok"  # type: ignore[attr-defined]
    assert len(errors) == 1 and "may not use model 'tiny_specific'" in str(errors[0])
    # a stream without credential is refused when it opens
    client = grpcclient.InferenceServerClient(server.grpc_url)
    refused: list[object] = []
    try:
        client.start_stream(lambda result, error: refused.append(error))
        with contextlib.suppress(InferenceServerException):  # the stream may be gone already
            client.async_stream_infer("tiny", grpc_input())
        deadline = time.monotonic() + 30
        while not refused and time.monotonic() < deadline:
            time.sleep(0.05)
        client.stop_stream()
    finally:
        client.close()
    assert refused and "authentication required" in str(refused[0])


def metrics_text(server: ServerProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_reload_on_change_and_sighup_keeps_last_good(setup: tuple[ServerProcess, Path]) -> None:
    server, cfg = setup
    assert infer_status(server, "tiny", bearer(KEY_NEW))[0] == 401
    cfg.write_text(config_text(extra_key=True))
    deadline = time.monotonic() + 20
    while infer_status(server, "tiny", bearer(KEY_NEW))[0] != 200:
        assert time.monotonic() < deadline, "the changed auth config was not picked up"
        time.sleep(0.3)
    # a corrupt JWKS file at reload: logged, the last good config stays (JWT included)
    jwks = cfg.parent / "jwks.json"
    good = jwks.read_text()
    jwks.write_text("{corrupt")
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while "not reloaded" not in server.log():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert infer_status(server, "tiny", bearer(KEY_NEW))[0] == 200
    assert infer_status(server, "tiny", bearer(token()))[0] == 200
    # a config file that is no YAML at all: same
    cfg.write_text("keys: [\n")
    server.proc.send_signal(signal.SIGHUP)
    time.sleep(1.0)
    assert infer_status(server, "tiny", bearer(KEY_A))[0] == 200
    jwks.write_text(good)
    cfg.write_text(config_text())
    server.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 20
    while infer_status(server, "tiny", bearer(KEY_NEW))[0] != 401:
        assert time.monotonic() < deadline
        time.sleep(0.3)
    assert server.proc.poll() is None
    text = metrics_text(server)
    assert 'pdserve_auth_config_reloads_total{result="failed"}' in text


def test_no_key_or_token_in_logs_or_metrics(server: ServerProcess) -> None:
    tok = token()
    infer_status(server, "tiny", bearer(tok))
    infer_status(server, "tiny", bearer("some-wrong-key-123"))
    text = metrics_text(server)
    assert 'pdserve_auth_failures_total{protocol="http",reason="missing"}' in text
    assert 'pdserve_auth_failures_total{protocol="http",reason="unknown_key"}' in text
    assert 'pdserve_auth_failures_total{protocol="grpc",reason="forbidden_model"}' in text
    log = server.log()
    for secret in (KEY_A, KEY_OPS, KEY_NEW, tok, "some-wrong-key-123", "open-sesame"):
        assert secret not in text
        assert secret not in log
    assert server.proc.poll() is None


@pytest.mark.parametrize("broken", ["missing_jwks", "corrupt_jwks", "corrupt_config"])
def test_bad_files_at_start_refuse_to_start(tmp_path: Path, broken: str) -> None:
    repo = copy_models(tmp_path / "models", "tiny")
    cfg = tmp_path / "auth.yaml"
    cfg.write_text(config_text())
    if broken == "corrupt_jwks":
        (tmp_path / "jwks.json").write_text('{"keys": [{"kty": "RSA"}]}')
    elif broken == "corrupt_config":
        write_jwks(tmp_path / "jwks.json")
        cfg.write_text("keys:\n  - name: x\n    hash: sha256:zz\n")
    with pytest.raises(RuntimeError) as e:
        start_server(repo, tmp_path / "pdserve.log", "--auth-config", str(cfg), ready_timeout=60)
    message = str(e.value)
    assert "pdserve exited with 1" in message
    assert "--auth-config" in message
    expected = {
        "missing_jwks": "JWKS file",
        "corrupt_jwks": "not a usable JWK set",
        "corrupt_config": "'hash' must be sha256",
    }[broken]
    assert expected in message
