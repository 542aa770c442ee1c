"""HTTP content codings: request bodies (gzip, deflate, identity), decompressed within a
limit, and gzip responses for clients that accept them (both transports)."""

from __future__ import annotations

import logging
import zlib

from pdserve.core.errors import InferError
from pdserve.frontends.http.status import BodyTooLargeError, UnsupportedMediaTypeError

logger = logging.getLogger("pdserve.http")

#: Most gzip members one body may hold (a bgzip file of the largest default body has
#: about 1024); more is answered 400.
MAX_GZIP_MEMBERS = 4096

#: Compressed input is fed to zlib this many bytes at a time, so that what is left
#: after each gzip member (``unused_data``) is a small copy, not the rest of the body.
_FEED_BYTES = 16 * 1024

_GZIP_WBITS = 16 + zlib.MAX_WBITS

#: Responses at least this large are gzip-compressed for a client that accepts gzip
#: (smaller ones gain little and cost a compressor); they also say ``Vary:
#: Accept-Encoding`` when sent uncompressed.
GZIP_MIN_BYTES = 1024
#: zlib level of gzip responses (fast; JSON tensors still shrink 3-5x).
GZIP_LEVEL = 1
_ZLIB_WBITS = zlib.MAX_WBITS


def parse_encoding(encoding: bytes) -> list[str]:
    """The codings of a ``Content-Encoding`` value (a comma-separated list, RFC 9110
    8.4), in the order to undo them (the reverse of the order applied), without
    ``identity``.

    Raises:
        UnsupportedMediaTypeError: a coding other than gzip, x-gzip, deflate or identity
            (answered 415).
    """
    names = [n.strip().lower() for n in encoding.decode("latin-1").split(",")]
    codings: list[str] = []
    for name in reversed(names):
        if name in ("", "identity"):
            continue
        if name not in ("gzip", "x-gzip", "deflate"):
            raise UnsupportedMediaTypeError(
                f"unsupported Content-Encoding '{name}'; expected gzip, deflate or identity"
            )
        codings.append(name)
    return codings


def decompress(body: bytes, codings: list[str], limit: int) -> bytes:
    """Undo ``Content-Encoding`` codings (from :func:`parse_encoding`: gzip, x-gzip,
    deflate; RFC 9110 8.4.1) one after another, keeping each output within ``limit``
    bytes.

    ``deflate`` is the zlib format (what ``tritonclient`` sends); raw deflate streams are
    accepted too. gzip bodies may hold several members, at most :data:`MAX_GZIP_MEMBERS`.
    Time is linear in the body size, however many members it holds.

    Raises:
        InferError(INVALID_ARG): corrupt or truncated data, or too many gzip members.
        BodyTooLargeError: the decompressed size goes over ``limit``.
    """
    for name in codings:
        body = _inflate(body, name, limit)
    return body


def _inflate(body: bytes, name: str, limit: int) -> bytes:
    """Undo one coding (see :func:`decompress`)."""
    if name == "deflate":
        # zlib-wrapped (RFC 1950 header: CM=8, header checksum) or raw deflate (RFC 1951).
        zlib_header = len(body) >= 2 and body[0] & 0x0F == 8 and (body[0] << 8 | body[1]) % 31 == 0
        wbits = _ZLIB_WBITS if zlib_header else -zlib.MAX_WBITS
    else:
        wbits = _GZIP_WBITS
    view = memoryview(body)
    size = len(view)
    out: list[bytes] = []
    produced = 0
    pos = 0
    members = 0
    while True:
        members += 1
        if members > MAX_GZIP_MEMBERS:
            raise InferError(
                f"the {name} request body holds more than {MAX_GZIP_MEMBERS} gzip members"
            )
        decoder = zlib.decompressobj(wbits)
        # Feed the member in pieces that start small and double, so that the copy zlib
        # makes of the input left over at the member's end (``unused_data``) stays
        # within a constant factor of the member's own size.
        feed = 64
        while True:
            piece = view[pos : pos + feed]
            try:
                chunk = decoder.decompress(piece, limit + 1 - produced)
            except zlib.error as exc:
                raise InferError(f"the {name} request body is corrupt: {exc}") from None
            produced += len(chunk)
            if produced > limit:
                raise BodyTooLargeError(
                    f"decompressed request body exceeds the limit of {limit} bytes"
                )
            if chunk:
                out.append(chunk)
            if decoder.eof:
                pos += len(piece) - len(decoder.unused_data)
                break
            pos += len(piece)
            if pos >= size:
                raise InferError(f"the {name} request body is truncated")
            if feed < _FEED_BYTES:
                feed *= 2
        if wbits != _GZIP_WBITS or pos >= size:
            break
    if pos < size and wbits != _GZIP_WBITS:
        raise InferError(f"the {name} request body is corrupt: data after the end of the stream")
    return out[0] if len(out) == 1 else b"".join(out)


def accepts_gzip(value: bytes) -> bool:
    """An ``Accept-Encoding`` value allows gzip (``gzip``, ``x-gzip`` or ``*``, with
    no ``q=0``; RFC 9110 12.5.3)."""
    for item in value.lower().split(b","):
        name, _, params = item.partition(b";")
        name = name.strip()
        if name not in (b"gzip", b"x-gzip", b"*"):
            continue
        q = params.strip()
        if q.startswith(b"q="):
            try:
                if float(q[2:]) <= 0:
                    return False
            except ValueError:
                return False
        return True
    return False


def gzip_bytes(data: bytes) -> bytes:
    """``data`` as one gzip member at :data:`GZIP_LEVEL`."""
    compressor = zlib.compressobj(GZIP_LEVEL, zlib.DEFLATED, _GZIP_WBITS)
    return compressor.compress(data) + compressor.flush()
