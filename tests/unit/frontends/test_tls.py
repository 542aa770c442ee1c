""":mod:`pdserve.frontends.tls`: contexts from the flag files (bad files fail clearly),
ALPN, mutual TLS, and reload (explicit, by file change, a failed one keeping the old
certificate) reaching new connections while open ones carry on; on asyncio's and
uvloop's event loops, against a real TLS listener on loopback."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trustme
import uvloop
from cryptography.hazmat.primitives import serialization

from pdserve.frontends import tls as tls_module
from pdserve.frontends.tls import (
    ALPN_GRPC,
    ALPN_HTTP,
    ServerTls,
    TlsError,
    TlsFiles,
    load_context,
    reload_all,
)
from tests.tls_certs import CertFiles, client_context, issue, replace_server_cert, served_cert


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def files(tmp_path: Path, ca: trustme.CA) -> CertFiles:
    return issue(ca, tmp_path / "certs")


def test_a_good_pair_loads_with_alpn_and_no_client_certificate(files: CertFiles) -> None:
    ctx = load_context(TlsFiles(files.cert, files.key), ALPN_GRPC)
    assert ctx.verify_mode == ssl.CERT_NONE
    assert ctx.minimum_version == ssl.TLSVersion.TLSv1_2
    mutual = load_context(TlsFiles(files.cert, files.key, files.ca, mutual=True), ALPN_HTTP)
    assert mutual.verify_mode == ssl.CERT_REQUIRED


def test_bad_files_are_refused_naming_the_flag(files: CertFiles, tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(TlsError, match=r"--grpc-server-cert .*nope.pem: cannot read it"):
        load_context(TlsFiles(missing, files.key), ALPN_GRPC)
    with pytest.raises(TlsError, match=r"--http-server-key .*nope.pem: cannot read it"):
        load_context(TlsFiles(files.cert, missing, flags="--http"), ALPN_HTTP)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(TlsError, match=r"--grpc-root-cert .*junk.pem: not a PEM file"):
        load_context(TlsFiles(files.cert, files.key, junk, mutual=True), ALPN_GRPC)
    with pytest.raises(TlsError, match=r"--grpc-server-cert .*server.key: holds no PEM cert"):
        load_context(TlsFiles(files.key, files.key), ALPN_GRPC)  # the two swapped
    with pytest.raises(TlsError, match=r"--grpc-server-key .*server.pem: holds no PEM private"):
        load_context(TlsFiles(files.cert, files.cert), ALPN_GRPC)
    other = issue(trustme.CA(), tmp_path / "other")
    with pytest.raises(TlsError, match=r"--grpc-server-key .* does not match --grpc-server-cert"):
        load_context(TlsFiles(files.cert, other.key), ALPN_GRPC)
    encrypted = tmp_path / "encrypted.key"
    key = serialization.load_pem_private_key(files.key.read_bytes(), None)
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    # refused at once, never a passphrase prompt on the terminal
    with pytest.raises(TlsError, match=r"--grpc-server-key .*encrypted.key: the key is encrypted"):
        load_context(TlsFiles(files.cert, encrypted), ALPN_GRPC)


def _serve(server_tls: ServerTls, body: Callable[[int], Awaitable[Any]], use_uvloop: bool) -> Any:
    """Run ``body(port)`` while a TLS echo listener with ``server_tls`` serves."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            writer.write(await reader.readline())
            await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def main() -> Any:
        srv = await asyncio.start_server(handle, "127.0.0.1", 0, ssl=server_tls.context)
        try:
            return await body(srv.sockets[0].getsockname()[1])
        finally:
            srv.close()

    return uvloop.run(main()) if use_uvloop else asyncio.run(main())


async def _echo(port: int, ctx: ssl.SSLContext) -> bytes:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=ctx, server_hostname="localhost"
    )
    try:
        writer.write(b"ping\n")
        return await reader.readline()
    finally:
        writer.close()


@pytest.mark.parametrize("use_uvloop", [True, False], ids=["uvloop", "asyncio"])
def test_reload_reaches_new_connections_and_open_ones_carry_on(
    ca: trustme.CA, files: CertFiles, use_uvloop: bool
) -> None:
    server_tls = ServerTls(TlsFiles(files.cert, files.key), ALPN_GRPC, "gRPC")
    trusting = client_context(files.ca, alpn="h2")
    first = files.fingerprint()

    async def body(port: int) -> None:
        loop = asyncio.get_running_loop()
        fp, alpn = await loop.run_in_executor(None, served_cert, port, trusting)
        assert (fp, alpn) == (first, "h2")
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=trusting, server_hostname="localhost"
        )
        replace_server_cert(ca, files)
        assert server_tls.reload("test") and server_tls.generation == 2
        fp, _ = await loop.run_in_executor(None, served_cert, port, trusting)
        assert fp == files.fingerprint() != first
        writer.write(b"still here\n")  # the connection opened before the reload
        assert await reader.readline() == b"still here\n"
        writer.close()

    _serve(server_tls, body, use_uvloop)


def test_a_failed_reload_keeps_the_certificate_in_use(
    files: CertFiles, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server_tls = ServerTls(TlsFiles(files.cert, files.key), ALPN_HTTP, "HTTP")
    before = files.fingerprint()
    files.key.write_bytes(issue(trustme.CA(), tmp_path / "other").key.read_bytes())
    assert not server_tls.reload("SIGHUP")
    assert "HTTP TLS: not reloaded (SIGHUP)" in caplog.text
    assert "does not match" in caplog.text

    async def body(port: int) -> None:
        loop = asyncio.get_running_loop()
        fp, alpn = await loop.run_in_executor(None, served_cert, port, client_context(files.ca))
        assert fp == before and alpn is None

    _serve(server_tls, body, True)


def test_changed_files_are_picked_up_at_the_next_handshake(
    ca: trustme.CA, files: CertFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tls_module, "CHECK_INTERVAL_SECS", 0.0)
    server_tls = ServerTls(TlsFiles(files.cert, files.key), ALPN_HTTP, "HTTP")
    ctx = client_context(files.ca)

    async def body(port: int) -> None:
        loop = asyncio.get_running_loop()
        replace_server_cert(ca, files)
        fp, _ = await loop.run_in_executor(None, served_cert, port, ctx)
        assert fp == files.fingerprint()
        assert server_tls.generation == 2
        assert await _echo(port, ctx) == b"ping\n"

    _serve(server_tls, body, True)


def test_reload_all_reloads_every_listener(files: CertFiles) -> None:
    a = ServerTls(TlsFiles(files.cert, files.key), ALPN_HTTP, "HTTP")
    b = ServerTls(TlsFiles(files.cert, files.key), ALPN_GRPC, "gRPC")
    assert reload_all("SIGHUP") >= 2
    assert a.generation == b.generation == 2


def test_mutual_tls_requires_a_certificate_from_the_root(files: CertFiles, tmp_path: Path) -> None:
    server_tls = ServerTls(
        TlsFiles(files.cert, files.key, files.ca, mutual=True), ALPN_HTTP, "HTTP"
    )
    stranger = issue(trustme.CA(), tmp_path / "stranger")

    async def body(port: int) -> None:
        good = client_context(files.ca, files.client_cert, files.client_key)
        assert await _echo(port, good) == b"ping\n"
        for ctx in (
            client_context(files.ca),  # no client certificate
            client_context(files.ca, stranger.client_cert, stranger.client_key),  # untrusted
        ):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                got = await _echo(port, ctx)
                assert got == b"", got  # TLS 1.3: refused after the client's handshake
                raise ConnectionError("closed")
        assert await _echo(port, good) == b"ping\n"  # and it carries on

    _serve(server_tls, body, True)
