"""Test helpers for TLS: a CA, server and client certificates written as PEM files
(``trustme``), and a client handshake that reports the certificate the server sent."""

from __future__ import annotations

import hashlib
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass(frozen=True)
class CertFiles:
    """PEM files of one CA and of a server and a client certificate it issued."""

    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path

    def fingerprint(self) -> str:
        """SHA-256 of the server certificate file's first certificate (DER)."""
        pem = self.cert.read_text().split("-----END CERTIFICATE-----")[0] + (
            "-----END CERTIFICATE-----\n"
        )
        return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()


def issue(ca: trustme.CA, folder: Path, name: str = "") -> CertFiles:
    """Write ``ca``'s certificate, a server certificate for localhost / 127.0.0.1 and a
    client certificate into ``folder`` (file names prefixed by ``name``); the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    files = CertFiles(
        folder / f"{name}ca.pem",
        folder / f"{name}server.pem",
        folder / f"{name}server.key",
        folder / f"{name}client.pem",
        folder / f"{name}client.key",
    )
    ca.cert_pem.write_to_path(str(files.ca))
    server = ca.issue_cert("localhost", "127.0.0.1")
    server.cert_chain_pems[0].write_to_path(str(files.cert))
    server.private_key_pem.write_to_path(str(files.key))
    client = ca.issue_cert("client@pdserve.test")
    client.cert_chain_pems[0].write_to_path(str(files.client_cert))
    client.private_key_pem.write_to_path(str(files.client_key))
    return files


def replace_server_cert(ca: trustme.CA, files: CertFiles) -> None:
    """Issue a new server certificate from ``ca`` and write it over ``files``' server
    certificate and key (each file replaced at once, as a secret mount does)."""
    server = ca.issue_cert("localhost", "127.0.0.1")
    for path, blob in (
        (files.key, server.private_key_pem),
        (files.cert, server.cert_chain_pems[0]),
    ):
        tmp = path.with_suffix(".tmp")
        blob.write_to_path(str(tmp))
        tmp.replace(path)


def client_context(
    ca: Path | None, cert: Path | None = None, key: Path | None = None, alpn: str = ""
) -> ssl.SSLContext:
    """A client context trusting ``ca`` (None: verifying nothing), presenting
    ``cert``/``key`` when given, offering ``alpn`` when given."""
    ctx = ssl.create_default_context(cafile=None if ca is None else str(ca))
    if ca is None:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert is not None and key is not None:
        ctx.load_cert_chain(cert, key)
    if alpn:
        ctx.set_alpn_protocols([alpn])
    return ctx


def served_cert(port: int, ctx: ssl.SSLContext, host: str = "127.0.0.1") -> tuple[str, str | None]:
    """Handshake with ``host:port``: (SHA-256 of the certificate the server sent,
    the ALPN protocol it chose).

    Raises:
        ssl.SSLError / OSError: the handshake failed.
    """
    with socket.create_connection((host, port), timeout=10) as raw:
        with ctx.wrap_socket(raw, server_hostname="localhost") as tls:
            der = tls.getpeercert(binary_form=True)
            assert der is not None
            # TLS 1.3: a refused client certificate shows at the first read
            tls.settimeout(0.5)
            try:
                tls.recv(1)
            except TimeoutError:
                pass
            return hashlib.sha256(der).hexdigest(), tls.selected_alpn_protocol()
