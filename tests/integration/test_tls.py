"""TLS and mutual TLS on real pdserve processes, with real clients (tritonclient.grpc,
tritonclient.http, ssl sockets) and the example model ``tiny`` (``relu(X @ W)``).

Two servers, certificates made by ``trustme`` for the module:

- ``kserve``: started with KServe's stock Triton ``ServingRuntime`` flags plus
  Triton's ``--grpc-use-ssl`` ones: plain HTTP and TLS gRPC (native transports), no
  client certificate asked for.
- ``mutual``: ``--http-workers 2`` (two front-end processes on the HTTP transport
  ``PDSERVE_HTTP_SERVER`` names: ``make test`` runs this module on both), grpcio's
  server (``--grpc-server threads``), mutual TLS on both, ``--metrics-use-ssl`` and an
  auth config: a client needs a certificate from the CA *and* an API key.

A client with a wrong certificate (untrusted CA, none under mutual TLS, plaintext) is
refused and the next good request is served; replaced certificate files reach new
connections after SIGHUP (and without it, by their change, in the HTTP workers).
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import trustme
from tritonclient.utils import InferenceServerException

from tests.conftest import GOLDENS, ROOT, ServerProcess, copy_models, free_port
from tests.tls_certs import CertFiles, client_context, issue, replace_server_cert, served_cert
from tests.traffic_keys import sha256_hash

API_KEY = "tls-team-secret-5e1f"
X = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)


def expected() -> np.ndarray:
    """What ``tiny`` (its latest version, 2: weights 2 W) answers for :data:`X`."""
    return np.maximum(X @ (2 * np.load(GOLDENS / "tiny.npz")["W"]), 0)


def launch(
    args: list[str], log_path: Path, ready: Callable[[ServerProcess], bool], ports: tuple[int, ...]
) -> ServerProcess:
    """Start ``python -m pdserve serve ARGS`` and wait until ``ready(server)``."""
    logf = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "serve", *args],
        stdout=logf,
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )
    server = ServerProcess(proc, *ports, log_path)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve exited with {proc.returncode}:\n{server.log()}")
        try:
            if ready(server):
                return server
        except (OSError, InferenceServerException):
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"pdserve not ready:\n{server.log()}")


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tls")


@pytest.fixture(scope="module")
def certs(ca: trustme.CA, base: Path) -> CertFiles:
    return issue(ca, base / "certs")


@pytest.fixture(scope="module")
def kserve(base: Path, certs: CertFiles) -> Iterator[ServerProcess]:
    repo = copy_models(base / "kserve-models", "tiny")
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    # KServe's stock Triton runtime: tritonserver --model-store=/mnt/models
    # --grpc-port=9000 --http-port=8080 --allow-grpc=true --allow-http=true
    args = [
        f"--model-store={repo}",
        f"--grpc-port={grpc_port}",
        f"--http-port={http_port}",
        "--allow-grpc=true",
        "--allow-http=true",
        "--grpc-use-ssl=true",
        f"--grpc-server-cert={certs.cert}",
        f"--grpc-server-key={certs.key}",
        f"--grpc-root-cert={certs.ca}",
        "--host=127.0.0.1",
        f"--metrics-port={metrics_port}",
    ]

    def ready(s: ServerProcess) -> bool:
        with urllib.request.urlopen(f"http://{s.http_url}/v2/health/ready", timeout=2) as r:
            return r.status == 200

    server = launch(args, base / "kserve.log", ready, (http_port, grpc_port, metrics_port))
    yield server
    assert server.stop() == 0, server.log()


@pytest.fixture(scope="module")
def mutual(base: Path, certs: CertFiles) -> Iterator[ServerProcess]:
    repo = copy_models(base / "mutual-models", "tiny")
    auth = base / "auth.yaml"
    auth.write_text(f"keys:\n  - name: team\n    hash: {sha256_hash(API_KEY)}\n    apis: ['*']\n")
    http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    args = [
        f"--model-repository={repo}",
        "--host=127.0.0.1",
        f"--http-port={http_port}",
        f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        "--http-workers=2",  # on the transport PDSERVE_HTTP_SERVER names (native or asgi)
        "--grpc-server=threads",
        "--grpc-use-ssl-mutual=true",
        f"--grpc-server-cert={certs.cert}",
        f"--grpc-server-key={certs.key}",
        f"--grpc-root-cert={certs.ca}",
        "--http-use-ssl-mutual=true",
        f"--http-server-cert={certs.cert}",
        f"--http-server-key={certs.key}",
        f"--http-root-cert={certs.ca}",
        "--metrics-use-ssl=true",
        f"--auth-config={auth}",
    ]
    good = client_context(certs.ca, certs.client_cert, certs.client_key)

    def ready(s: ServerProcess) -> bool:
        url = f"https://{s.http_url}/v2/health/ready"
        with urllib.request.urlopen(url, timeout=2, context=good) as r:
            return r.status == 200

    server = launch(args, base / "mutual.log", ready, (http_port, grpc_port, metrics_port))
    yield server
    assert server.stop() == 0, server.log()


def grpc_client(
    server: ServerProcess, ca: Path | None, who: CertFiles | None = None
) -> grpcclient.InferenceServerClient:
    return grpcclient.InferenceServerClient(
        server.grpc_url,
        ssl=True,
        root_certificates=None if ca is None else str(ca),
        private_key=None if who is None else str(who.client_key),
        certificate_chain=None if who is None else str(who.client_cert),
    )


def grpc_infer(client: Any, headers: dict[str, str] | None = None) -> np.ndarray:
    inp = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(X)
    out = client.infer("tiny", [inp], headers=headers, client_timeout=30).as_numpy("OUTPUT0")
    assert out is not None
    return np.asarray(out)


def http_infer(client: Any, headers: dict[str, str] | None = None) -> np.ndarray:
    inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
    inp.set_data_from_numpy(X)
    out = client.infer("tiny", [inp], headers=headers).as_numpy("OUTPUT0")
    assert out is not None
    return np.asarray(out)


def refused_grpc(client: Any) -> str:
    """The status of a call the server must refuse at the TLS handshake."""
    with pytest.raises(InferenceServerException) as e:
        client.is_server_live(client_timeout=5)
    return str(e.value.status())


# -- KServe's start-up command, TLS gRPC without client certificates ----------------------


def test_kserve_stock_flags_serve_http_and_tls_grpc(
    kserve: ServerProcess, certs: CertFiles
) -> None:
    plain = httpclient.InferenceServerClient(kserve.http_url)
    np.testing.assert_allclose(http_infer(plain), expected(), rtol=1e-5, atol=1e-6)
    plain.close()
    for who in (None, certs):  # no client certificate is asked for; one given is unused
        client = grpc_client(kserve, certs.ca, who)
        assert client.is_server_live()
        np.testing.assert_allclose(grpc_infer(client), expected(), rtol=1e-5, atol=1e-6)
        client.close()
    _, alpn = served_cert(kserve.grpc_port, client_context(certs.ca, alpn="h2"))
    assert alpn == "h2"
    assert f"gRPC (KServe V2) listening on 127.0.0.1:{kserve.grpc_port} (TLS)" in kserve.log()


def test_wrong_clients_are_refused_and_the_server_carries_on(
    kserve: ServerProcess, certs: CertFiles, base: Path
) -> None:
    stranger = issue(trustme.CA(), base / "stranger")
    untrusting = grpc_client(kserve, stranger.ca)  # the server's CA is not trusted
    assert refused_grpc(untrusting) == "StatusCode.UNAVAILABLE"
    untrusting.close()
    plaintext = grpcclient.InferenceServerClient(kserve.grpc_url)  # h2c to a TLS port
    assert refused_grpc(plaintext) == "StatusCode.UNAVAILABLE"
    plaintext.close()
    client = grpc_client(kserve, certs.ca)
    np.testing.assert_allclose(grpc_infer(client), expected(), rtol=1e-5, atol=1e-6)
    client.close()


# -- mutual TLS on grpcio's server, HTTP workers and metrics; with auth ------------------


def test_mutual_grpc_needs_a_client_certificate_and_the_api_key(
    mutual: ServerProcess, certs: CertFiles, base: Path
) -> None:
    key = {"authorization": f"Bearer {API_KEY}"}
    anonymous = grpc_client(mutual, certs.ca)  # no client certificate
    assert refused_grpc(anonymous) in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
    anonymous.close()
    stranger = issue(trustme.CA(), base / "stranger-client")
    wrong = grpc_client(mutual, certs.ca, stranger)  # a certificate from another CA
    assert refused_grpc(wrong) in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")
    wrong.close()
    client = grpc_client(mutual, certs.ca, certs)
    np.testing.assert_allclose(grpc_infer(client, key), expected(), rtol=1e-5, atol=1e-6)
    with pytest.raises(InferenceServerException) as e:  # TLS alone is not authentication
        grpc_infer(client)
    assert e.value.status() == "StatusCode.UNAUTHENTICATED"
    client.close()


def _https_client(server: ServerProcess, certs: CertFiles, who: CertFiles | None) -> Any:
    options = {"ca_certs": str(certs.ca)}
    if who is not None:
        options |= {"certfile": str(who.client_cert), "keyfile": str(who.client_key)}
    return httpclient.InferenceServerClient(server.http_url, ssl=True, ssl_options=options)


def test_mutual_https_on_http_workers_with_auth(mutual: ServerProcess, certs: CertFiles) -> None:
    key = {"authorization": f"Bearer {API_KEY}"}
    client = _https_client(mutual, certs, certs)
    for _ in range(4):  # connections spread over both workers
        np.testing.assert_allclose(http_infer(client, key), expected(), rtol=1e-5, atol=1e-6)
    with pytest.raises(InferenceServerException) as e:
        http_infer(client)
    assert e.value.status() == "401"
    client.close()
    anonymous = client_context(certs.ca)  # no client certificate
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"https://{mutual.http_url}/v2/health/live", context=anonymous)
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext to HTTPS
        urllib.request.urlopen(f"http://{mutual.http_url}/v2/health/live", timeout=5)
    again = _https_client(mutual, certs, certs)
    assert again.is_server_live()
    np.testing.assert_allclose(http_infer(again, key), expected(), rtol=1e-5, atol=1e-6)
    again.close()
    _, alpn = served_cert(
        mutual.http_port, client_context(certs.ca, certs.client_cert, certs.client_key, "http/1.1")
    )
    assert alpn == "http/1.1"


def test_metrics_over_https(mutual: ServerProcess, certs: CertFiles) -> None:
    good = client_context(certs.ca, certs.client_cert, certs.client_key)
    url = f"https://127.0.0.1:{mutual.metrics_port}/metrics"
    with urllib.request.urlopen(url, context=good, timeout=10) as r:
        text = r.read().decode()
    assert 'nv_inference_request_success{model="tiny",version="2"}' in text


# -- reload -----------------------------------------------------------------------------


def test_sighup_reloads_the_certificate_for_new_connections(
    kserve: ServerProcess, mutual: ServerProcess, ca: trustme.CA, certs: CertFiles
) -> None:
    grpc_ctx = client_context(certs.ca, certs.client_cert, certs.client_key, alpn="h2")
    http_ctx = client_context(certs.ca, certs.client_cert, certs.client_key)
    before = certs.fingerprint()
    assert served_cert(kserve.grpc_port, grpc_ctx)[0] == before
    open_client = grpc_client(kserve, certs.ca)  # a connection opened before the reload
    assert open_client.is_server_live()
    replace_server_cert(ca, certs)
    after = certs.fingerprint()
    assert after != before
    # HTTP workers: the changed files are re-read at the next handshake, no signal
    deadline = time.monotonic() + 15
    while served_cert(mutual.http_port, http_ctx)[0] != after:
        assert time.monotonic() < deadline, "the HTTP workers kept the old certificate"
        time.sleep(0.3)
    kserve.proc.send_signal(signal.SIGHUP)
    mutual.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 15
    for server in (kserve, mutual):
        while served_cert(server.grpc_port, grpc_ctx)[0] != after:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        assert "gRPC TLS: certificate reloaded (SIGHUP)" in server.log()
    assert open_client.is_server_live()
    np.testing.assert_allclose(grpc_infer(open_client), expected(), rtol=1e-5, atol=1e-6)
    open_client.close()
    fresh = grpc_client(mutual, certs.ca, certs)
    key = {"authorization": f"Bearer {API_KEY}"}
    np.testing.assert_allclose(grpc_infer(fresh, key), expected(), rtol=1e-5, atol=1e-6)
    fresh.close()


# -- start-up checks --------------------------------------------------------------------


def test_a_key_that_does_not_match_refuses_to_start(certs: CertFiles, base: Path) -> None:
    other = issue(trustme.CA(), base / "mismatch")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "serve",
            f"--model-repository={base / 'kserve-models'}",
            "--grpc-use-ssl=true",
            f"--grpc-server-cert={certs.cert}",
            f"--grpc-server-key={other.key}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "argument --grpc-use-ssl: --grpc-server-key" in run.stderr
    assert "does not match --grpc-server-cert" in run.stderr
