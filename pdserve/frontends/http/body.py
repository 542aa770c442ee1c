"""A request body's limits (size, JSON size, timeout) and its ``Content-Encoding``,
shared by both transports; small JSON-object bodies of the admin routes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from pdserve.core.errors import InferError
from pdserve.frontends.http.answer import Exchange, Headers
from pdserve.frontends.http.compression import decompress, parse_encoding
from pdserve.frontends.http.status import BodyTooLargeError
from pdserve.frontends.offload import off_loop, off_process

#: Compressed bodies over this many bytes are decompressed on a worker thread (zlib
#: expands up to ~1000:1, so 8 KiB may become 8 MiB).
_INLINE_DECOMPRESS_BYTES = 8 * 1024

#: Request JSON (an inference request's, or a repository request's body) over this
#: many bytes is parsed in a decode process (:func:`~pdserve.frontends.offload.off_process`):
#: the parser holds the GIL for the whole parse, so a worker thread would stall the
#: event loop as much as parsing on it.
PROCESS_JSON_BYTES = 256 * 1024


def header_past_body(header_length: int, body_size: int) -> InferError:
    """INVALID_ARG for an ``Inference-Header-Content-Length`` larger than the body, in
    Triton's words (``GetInferenceHeaderLength``)."""
    return InferError(
        f"inference header size should be in range (0, {body_size}), got: {header_length}"
    )


@dataclass(frozen=True)
class BodyLimits:
    """How large a request body may be and how long its pieces may take.

    Attributes:
        max_request_bytes: the whole body, before and after decompression (413 above).
        max_json_bytes: the JSON part of an inference request (413 above); binary tensor
            data counts only against ``max_request_bytes``.
        timeout: seconds to wait for the next piece of a body (408 after); None: forever.
    """

    max_request_bytes: int
    max_json_bytes: int
    timeout: float | None
    #: the most bytes a body that is all JSON may hold (the smaller limit)
    json_limit: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "json_limit", min(self.max_json_bytes, self.max_request_bytes))

    def limit(self, json: bool) -> int:
        """The most bytes a request body may hold (``json``: all of it is JSON)."""
        return self.json_limit if json else self.max_request_bytes

    def json_too_large(self, size: int, qualifier: str = "of") -> BodyTooLargeError:
        """The 413 for JSON of ``size`` bytes over ``max_json_bytes``."""
        return BodyTooLargeError(
            f"request JSON {qualifier} {size} bytes exceeds the limit of {self.max_json_bytes} "
            "bytes for JSON; send large tensors as binary data (the binary tensor data "
            "extension: Inference-Header-Content-Length)"
        )

    def check_header_length(self, header_length: int, body_size: int) -> None:
        """Check an inference request's ``Inference-Header-Content-Length`` before its
        JSON is read.

        Args:
            header_length: the header's value (a non-negative integer).
            body_size: the body's byte count as sent; -1 when not known (no
                ``Content-Length`` yet) or not comparable (a compressed body: the header
                counts decompressed bytes); the decoder checks it against the body then.

        Raises:
            InferError(INVALID_ARG): ``header_length`` past the body, as Triton
                (``http_server.cc`` ``GetInferenceHeaderLength``: "inference header size
                should be in range (0, <content length>), got: <value>", 400) -- checked
                before the JSON limit, so an announced size the body cannot hold is a
                bad request, not a 413.
            BodyTooLargeError: ``header_length`` over :attr:`max_json_bytes` (413).
        """
        if 0 <= body_size < header_length:
            raise header_past_body(header_length, body_size)
        if header_length > self.max_json_bytes:
            raise self.json_too_large(header_length)

    def too_large(self, size: int, json: bool, qualifier: str = "of") -> BodyTooLargeError:
        """The 413 for a body of ``size`` bytes over :meth:`limit`."""
        if json and self.max_json_bytes < self.max_request_bytes:
            return self.json_too_large(size, qualifier)
        return BodyTooLargeError(
            f"request body {qualifier} {size} bytes exceeds the limit of "
            f"{self.max_request_bytes} bytes"
        )

    async def finish(self, body: bytes, encoding: bytes, json: bool = False) -> bytes:
        """Check a whole received ``body`` against :meth:`limit` and undo its
        ``Content-Encoding`` (``encoding``: the header's value, b"" for none).

        Raises:
            BodyTooLargeError: over the limit, before or after decompression.
            InferError(INVALID_ARG): a corrupt or truncated compressed body.
            UnsupportedMediaTypeError: an unsupported ``Content-Encoding``.
        """
        limit = self.limit(json)
        if len(body) > limit:
            raise self.too_large(len(body), json)
        if encoding:
            codings = parse_encoding(encoding)
            if codings:
                if len(body) <= _INLINE_DECOMPRESS_BYTES:
                    body = decompress(body, codings, limit)
                else:
                    body = await off_loop(decompress, body, codings, limit)
        return body


_D = TypeVar("_D", int, None)  # int_header's default: an int, or None


def int_header(value: bytes, default: _D) -> int | _D:
    """A header's integer value; ``default`` when it is not one."""
    try:
        return int(value)
    except ValueError:
        return default


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Parse a request body that must be a JSON object (repository requests).

    Raises:
        InferError(INVALID_ARG): not JSON, or not an object.
    """
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InferError(f"failed to parse the request JSON: {exc}") from None
    if type(doc) is not dict:
        raise InferError("the request body must be a JSON object")
    return doc


async def read_json_object(exchange: Exchange, headers: Headers) -> dict[str, Any]:
    """Read a small JSON-object body; an empty body is ``{}``."""
    content_length = -1
    encoding = b""
    for key, value in headers:
        if key == b"content-length":
            content_length = int_header(value, -1)
        elif key == b"content-encoding":
            encoding = value if not encoding else encoding + b"," + value
    body = await exchange.read_body(content_length, encoding, False)
    if not body.strip():
        return {}
    if len(body) <= PROCESS_JSON_BYTES:
        return parse_json_object(body)
    doc: dict[str, Any] = await off_process(parse_json_object, body)
    return doc
