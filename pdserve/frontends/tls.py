"""TLS for the listeners: the server-side ``ssl.SSLContext`` built from a listener's
certificate, key and root-certificate files (Triton's ``--grpc-use-ssl`` family and
pdserve's ``--http-use-ssl`` family), checked at start-up and reloaded while serving.

:class:`ServerTls` is one listener's TLS. Its :attr:`~ServerTls.context` is what the
transport listens with; at each new handshake it switches the connection to the newest
context loaded (the ``sni_callback``, which OpenSSL calls for every ClientHello), so a
reload reaches new connections while open ones carry on with the certificate they got.
The files are re-read on :func:`reload_all` (SIGHUP) and when they change: at a new
handshake, at most once per :data:`CHECK_INTERVAL_SECS`, their size and mtime are
compared. A reload that fails (a half-written file, a key that does not match) is
logged and the previous certificate stays in use.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("pdserve.tls")

__all__ = [
    "ALPN_GRPC",
    "ALPN_HTTP",
    "CHECK_INTERVAL_SECS",
    "ServerTls",
    "TlsError",
    "TlsFiles",
    "load_context",
    "reload_all",
]

#: ALPN protocols offered by a gRPC listener (grpc clients require ``h2``).
ALPN_GRPC = ("h2",)
#: ALPN protocols offered by an HTTP/1.1 listener.
ALPN_HTTP = ("http/1.1",)
#: Least seconds between two looks at the files' size and mtime (at a handshake).
CHECK_INTERVAL_SECS = 1.0


class TlsError(ValueError):
    """A listener's TLS files cannot be used (missing, unreadable, not PEM, or a key
    that does not match its certificate); the message names the file."""


@dataclass(frozen=True)
class TlsFiles:
    """The files of one TLS listener (PEM).

    Attributes:
        cert: the server certificate (chain: leaf first).
        key: the server's private key (unencrypted).
        root: the CA certificate(s) client certificates must chain to; None: none.
            Required with ``mutual``; read but unused without it (as Triton does).
        mutual: require and verify a client certificate (mutual TLS).
        flags: the flag prefix named in errors, e.g. ``--grpc``.
    """

    cert: Path
    key: Path
    root: Path | None = None
    mutual: bool = False
    flags: str = "--grpc"

    def paths(self) -> tuple[Path, ...]:
        """The files read, in the order cert, key, root."""
        return (self.cert, self.key) if self.root is None else (self.cert, self.key, self.root)


def _read(path: Path, flag: str, marker: bytes, what: str) -> bytes:
    """The bytes of a PEM file that holds a ``marker`` block (``what``, for the error)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TlsError(f"{flag} {path}: cannot read it ({e.strerror or e})") from None
    if b"-----BEGIN " not in data:
        raise TlsError(f"{flag} {path}: not a PEM file")
    if marker not in data:
        raise TlsError(f"{flag} {path}: holds no {what}")
    return data


def load_context(files: TlsFiles, alpn: Sequence[str]) -> ssl.SSLContext:
    """A server ``SSLContext`` from ``files``: TLS 1.2 or newer, ``alpn`` offered,
    client certificates required and verified against ``files.root`` when
    ``files.mutual`` (otherwise none is asked for).

    Raises:
        TlsError: a file is missing, unreadable or not PEM, the key does not match the
            certificate, or the root certificates cannot be loaded.
    """
    p = files.flags
    _read(files.cert, f"{p}-server-cert", b"CERTIFICATE-----", "PEM certificate")
    _read(files.key, f"{p}-server-key", b"PRIVATE KEY-----", "PEM private key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2

    def encrypted() -> bytes:  # never prompt on a terminal for a passphrase
        raise TlsError(f"{p}-server-key {files.key}: the key is encrypted; give it unencrypted")

    try:
        ctx.load_cert_chain(files.cert, files.key, password=encrypted)
    except ssl.SSLError as e:
        what = "does not match" if "mismatch" in str(e).lower() else "cannot be used with"
        raise TlsError(
            f"{p}-server-key {files.key} {what} {p}-server-cert {files.cert} ({e.reason or e})"
        ) from None
    if files.root is not None:
        root = _read(files.root, f"{p}-root-cert", b"CERTIFICATE-----", "PEM certificate")
        try:
            ctx.load_verify_locations(cadata=root.decode("ascii", "replace"))
        except ssl.SSLError as e:
            raise TlsError(f"{p}-root-cert {files.root}: {e.reason or e}") from None
    ctx.verify_mode = ssl.CERT_REQUIRED if files.mutual else ssl.CERT_NONE
    ctx.set_alpn_protocols(list(alpn))
    return ctx


#: (inode, size, mtime ns) of each file of a :class:`TlsFiles`.
Signature = tuple[tuple[int, int, int], ...]


def _signature(files: TlsFiles) -> Signature:
    """(inode, size, mtime ns) of each file; (0, 0, 0) for one that cannot be read."""
    out = []
    for path in files.paths():
        try:
            st = os.stat(path)
        except OSError:
            out.append((0, 0, 0))
        else:
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


#: Every :class:`ServerTls` of this process (for :func:`reload_all`).
_LIVE: weakref.WeakSet[ServerTls] = weakref.WeakSet()


class ServerTls:
    """One listener's TLS, reloadable (see the module docstring).

    Args:
        files: the listener's files.
        alpn: the ALPN protocols offered (:data:`ALPN_GRPC` or :data:`ALPN_HTTP`).
        name: the listener, for log lines (``gRPC``, ``HTTP``...).

    Attributes:
        context: the context to listen with.
        pem: the loaded files' bytes: (key, certificate chain, root or None).
        generation: counts successful loads (1 after construction).

    Raises:
        TlsError: the files cannot be used (see :func:`load_context`).
    """

    def __init__(self, files: TlsFiles, alpn: Sequence[str], name: str) -> None:
        self.files = files
        self.alpn = tuple(alpn)
        self.name = name
        self._lock = threading.Lock()  # grpcio calls check() from its own threads
        self._signature = _signature(files)
        self.current = load_context(files, self.alpn)
        self.pem = self._pem()
        self.generation = 1
        self._checked = time.monotonic()
        self.context = self.current
        self.context.sni_callback = self._on_client_hello
        _LIVE.add(self)

    def _on_client_hello(
        self, conn: ssl.SSLObject | ssl.SSLSocket, server_name: str | None, ctx: ssl.SSLContext
    ) -> None:
        """OpenSSL's servername callback (every ClientHello): move the connection to
        the newest context. Never raises (an exception would fail the handshake)."""
        try:
            self.check()
            current = self.current
            if current is not ctx:
                conn.context = current
        except Exception:  # noqa: BLE001 - keep serving with the context it has
            log.exception("%s TLS: switching a new connection's certificate failed", self.name)

    def check(self) -> None:
        """Reload when the files changed since the last load (looked at once per
        :data:`CHECK_INTERVAL_SECS` at most)."""
        now = time.monotonic()
        if now - self._checked < CHECK_INTERVAL_SECS:
            return
        self._checked = now
        signature = _signature(self.files)
        if signature != self._signature:
            self.reload("the files changed", signature)

    def reload(self, reason: str, signature: Signature | None = None) -> bool:
        """Re-read the files now; new handshakes use them once they load.

        Returns:
            True when they loaded; False (logged) when they cannot be used: the
            previous certificate stays in use.
        """
        with self._lock:
            self._signature = signature or _signature(self.files)
            try:
                ctx = load_context(self.files, self.alpn)
                pem = self._pem()
            except (TlsError, OSError) as e:
                log.error(
                    "%s TLS: not reloaded (%s): %s; still serving the previous certificate",
                    self.name,
                    reason,
                    e,
                )
                return False
            self.current, self.pem = ctx, pem
            self.generation += 1
        log.info("%s TLS: certificate reloaded (%s): %s", self.name, reason, self.files.cert)
        return True

    def _pem(self) -> tuple[bytes, bytes, bytes | None]:
        """The files' bytes (key, certificate chain, root or None): :attr:`pem`, for
        grpcio's certificate configuration.

        Raises:
            OSError: a file cannot be read.
        """
        root = self.files.root.read_bytes() if self.files.root is not None else None
        return self.files.key.read_bytes(), self.files.cert.read_bytes(), root


def reload_all(reason: str) -> int:
    """Reload every listener's TLS in this process (SIGHUP); the number that loaded."""
    return sum(tls.reload(reason) for tls in list(_LIVE))
