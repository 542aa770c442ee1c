""":func:`pdserve.frontends.grpc.server.serve_grpc`: each kind of gRPC server, started
for a real :class:`~pdserve.server.InferenceServer`, answers a tritonclient over
loopback; a bad kind and a port in use fail clearly."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc.aio as grpcclient
import trustme
from tritonclient.utils import InferenceServerException

from pdserve.core.types import InferRequest
from pdserve.frontends.grpc.engine import GRPC_SERVERS
from pdserve.frontends.grpc.server import serve_grpc
from pdserve.frontends.tls import ALPN_GRPC, ServerTls, TlsFiles
from pdserve.server import InferenceServer
from tests.conftest import copy_models, free_port
from tests.tls_certs import CertFiles, client_context, issue, replace_server_cert, served_cert


def _with_server(tmp_path: Path, body: Callable[[InferenceServer], Awaitable[Any]]) -> Any:
    repo = copy_models(tmp_path / "models", "tiny")

    async def main() -> Any:
        server = InferenceServer(repo)
        await server.start()
        try:
            return await body(server)
        finally:
            await server.stop(5)

    return asyncio.run(main())


@pytest.mark.parametrize("kind", GRPC_SERVERS)
def test_each_kind_serves_the_v2_service(tmp_path: Path, kind: str) -> None:
    async def body(server: InferenceServer) -> None:
        port = free_port()
        srv = await serve_grpc(server, "127.0.0.1", port, kind=kind)
        client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
        try:
            assert await client.is_server_live()
            assert await client.is_model_ready("tiny")
            assert not await client.is_model_ready("nope")
            x = np.arange(2 * 64, dtype=np.float32).reshape(2, 64)
            inp = grpcclient.InferInput("INPUT0", [2, 64], "FP32")
            inp.set_data_from_numpy(x)
            result = await client.infer("tiny", [inp])
            out = result.as_numpy("OUTPUT0")
            assert out is not None and out.shape == (2, 64) and out.dtype == np.float32
            direct = await server.infer(InferRequest("tiny", inputs={"INPUT0": x}))
            np.testing.assert_allclose(out, direct.outputs["OUTPUT0"])
        finally:
            await client.close()
            await srv.stop(1)

    _with_server(tmp_path, body)


def test_an_unknown_kind_is_a_value_error(tmp_path: Path) -> None:
    async def body(server: InferenceServer) -> None:
        with pytest.raises(ValueError, match="unknown gRPC server 'h3'"):
            await serve_grpc(server, "127.0.0.1", free_port(), kind="h3")

    _with_server(tmp_path, body)


@pytest.mark.parametrize("kind", ["aio", "threads"])
def test_a_port_in_use_fails_naming_the_address(tmp_path: Path, kind: str) -> None:
    async def body(server: InferenceServer) -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            with pytest.raises(
                RuntimeError, match=f"could not listen for gRPC on 127.0.0.1:{port}"
            ):
                await serve_grpc(server, "127.0.0.1", port, kind=kind)

    _with_server(tmp_path, body)


@pytest.mark.parametrize("kind", GRPC_SERVERS)
def test_each_kind_serves_mutual_tls_and_reloads(tmp_path: Path, kind: str) -> None:
    """Triton's mutual TLS on every kind: a client with a certificate from the root is
    served, one without (or with a stranger's) is refused and the next good call still
    works; after a reload a new connection gets the new certificate."""
    ca = trustme.CA()
    files = issue(ca, tmp_path / "certs")
    stranger = issue(trustme.CA(), tmp_path / "stranger")
    tls = ServerTls(TlsFiles(files.cert, files.key, files.ca, mutual=True), ALPN_GRPC, "gRPC")

    def client(port: int, who: CertFiles | None) -> grpcclient.InferenceServerClient:
        return grpcclient.InferenceServerClient(
            f"127.0.0.1:{port}",
            ssl=True,
            root_certificates=str(files.ca),
            private_key=None if who is None else str(who.client_key),
            certificate_chain=None if who is None else str(who.client_cert),
        )

    async def body(server: InferenceServer) -> None:
        port = free_port()
        srv = await serve_grpc(server, "127.0.0.1", port, kind=kind, tls=tls)
        try:
            x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)
            direct = await server.infer(InferRequest("tiny", inputs={"INPUT0": x}))
            inp = grpcclient.InferInput("INPUT0", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            for who in (None, stranger):
                bad = client(port, who)
                with pytest.raises(InferenceServerException) as refused:
                    await bad.is_server_live(client_timeout=5)
                assert refused.value.status() in (
                    "StatusCode.UNAVAILABLE",
                    "StatusCode.DEADLINE_EXCEEDED",
                )
                await bad.close()
            good = client(port, files)
            out = (await good.infer("tiny", [inp])).as_numpy("OUTPUT0")
            np.testing.assert_allclose(out, direct.outputs["OUTPUT0"], rtol=1e-6)
            await good.close()
            before = files.fingerprint()
            replace_server_cert(ca, files)
            assert tls.reload("test")
            ctx = client_context(files.ca, files.client_cert, files.client_key, alpn="h2")
            fp, alpn = await asyncio.to_thread(served_cert, port, ctx)
            assert fp == files.fingerprint() != before and alpn == "h2"
            again = client(port, files)
            assert await again.is_model_ready("tiny")
            await again.close()
        finally:
            await srv.stop(1)

    _with_server(tmp_path, body)
