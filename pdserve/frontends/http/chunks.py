"""The declared size of a chunked request body's chunks, for both HTTP transports.

llhttp (httptools) parses a chunk-size line but does not say the size, so a chunk that
declares more than the body limit would be waited for until the body timeout.
:class:`ChunkWatch` finds the size line in the bytes the transport fed and reads it, so
such a chunk is refused with 413 as soon as its size line (or its first digits) arrives;
llhttp itself refuses a size past 64 bits or a malformed line (400).

Finding the line without a parser of its own: llhttp calls ``on_chunk_header`` once a
size line's LF is parsed, then reports the chunk's bytes with ``on_body``; so a feed
that ends inside a chunk whose header it held ends with that chunk's body bytes, right
after the size line, and a feed that ends between chunks ends with the start of the
next size line (kept, up to :data:`_KEEP` bytes). The last chunk stays open until its
trailers end, so trailer fields are never read as sizes.
"""

from __future__ import annotations

import re

_HEX = re.compile(rb"[0-9A-Fa-f]*")
#: Bytes of an unfinished size line kept across feeds: more hex digits than this
#: overflow 64 bits in any case (after leading zeros, which llhttp allows, a line whose
#: start is longer is not checked: llhttp's overflow check and the body limit apply).
_KEEP = 64


class ChunkWatch:
    """Follows one chunked request body's size lines (see the module docstring).

    The transport calls :meth:`start` when a request with ``Transfer-Encoding:
    chunked`` has its headers, :meth:`chunk_header` / :meth:`chunk_complete` from
    httptools' callbacks of the same names, and :meth:`declared` after each feed of
    bytes past that request's headers.
    """

    __slots__ = ("open", "new", "base", "line")

    def __init__(self) -> None:
        self.start()

    def start(self) -> None:
        """A new chunked body begins (its first size line is next)."""
        self.open = False  # a chunk's header was parsed and the chunk is not complete
        self.new = False  # that header came in the current feed
        self.base = 0  # the body's size when that header came
        self.line = b""  # the beginning of an unfinished size line (between chunks)

    def chunk_header(self, body_size: int) -> None:
        """httptools' ``on_chunk_header``; ``body_size``: body bytes received so far."""
        self.open = True
        self.new = True
        self.base = body_size

    def chunk_complete(self) -> None:
        """httptools' ``on_chunk_complete``."""
        self.open = False

    def declared(self, data: bytes, body_size: int) -> int:
        """The body's size once the chunk of the newest chunk-size line in ``data``
        (the bytes just fed, all of them parsed) is in: by a complete line's size, or by
        the size its digits so far already say (more digits only make it larger). -1:
        no size line to read (none in ``data``, or the current chunk's was read before).

        Args:
            data: the bytes of the feed that just ended.
            body_size: body bytes received so far (``on_body``'s lengths summed).
        """
        if self.open:
            if not self.new:
                return -1
            self.new = False
            kept = self.line
            self.line = b""
            # the chunk's bytes in this feed are the last ones of data
            end = len(data) - (body_size - self.base)
            start = data.rfind(b"\n", 0, end - 1) + 1 if end > 0 else 0
            line = data[start:end] if start else kept + data[:end]
            if not line.endswith(b"\r\n"):
                # (the chunk is complete but for its CRLF: its size fitted; the line is
                # not the one before its bytes)
                return -1
            size = _size(line, True)
            return self.base + size if size >= 0 else -1
        self.new = False
        nl = data.rfind(b"\n")
        part = data[nl + 1 :] if nl >= 0 else self.line + data
        self.line = part[:_KEEP]
        size = _size(part, False) if part else -1
        return body_size + size if size >= 0 else -1


def _size(line: bytes, complete: bool) -> int:
    digits = _HEX.match(line)
    assert digits is not None  # (the pattern matches the empty string)
    end = digits.end()
    if not end:
        return -1
    if end < len(line):
        if line[end : end + 1] not in (b";", b"\r", b" ", b"\t"):
            return -1  # not a size line (a trailer field, say)
    elif complete:
        return -1
    return int(line[:end], 16)
