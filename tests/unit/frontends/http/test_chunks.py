"""ChunkWatch (frontends/http/chunks.py): the declared sizes of a chunked body's chunks,
read from the bytes fed to httptools, however the bytes are cut into feeds."""

from __future__ import annotations

import random

import httptools

from pdserve.frontends.http.chunks import ChunkWatch

HEAD = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"


class _Protocol:
    def __init__(self) -> None:
        self.watch = ChunkWatch()
        self.body = 0
        self.chunked = False
        self.complete = False

    def on_headers_complete(self) -> None:
        self.chunked = True
        self.watch.start()

    def on_body(self, body: bytes) -> None:
        self.body += len(body)

    def on_chunk_header(self) -> None:
        self.watch.chunk_header(self.body)

    def on_chunk_complete(self) -> None:
        self.watch.chunk_complete()

    def on_message_complete(self) -> None:
        self.complete = True


def _declared(wire: bytes, cuts: list[int]) -> list[int]:
    """Feed ``HEAD + wire`` cut at ``cuts``; the sizes ChunkWatch says after each feed."""
    proto = _Protocol()
    parser = httptools.HttpRequestParser(proto)
    data = HEAD + wire
    out = []
    for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
        piece = data[a:b]
        parser.feed_data(piece)
        if proto.chunked and not proto.complete:
            out.append(proto.watch.declared(piece, proto.body))
    return out


def test_valid_bodies_never_declare_more_than_they_hold() -> None:
    rng = random.Random(7)
    for _ in range(500):
        sizes = [rng.choice([1, 2, 15, 16, 255, 300]) for _ in range(rng.randint(1, 5))]
        wire = b""
        for n in sizes:
            ext = b";a=FFFFFFFF" if rng.random() < 0.3 else b""
            fill = bytes(rng.choice(b"\r\nF0;") for _ in range(n))  # (looks like framing)
            wire += b"%s%x%s\r\n%s\r\n" % (b"0" * rng.randint(0, 3), n, ext, fill)
        wire += b"0\r\nABCDEF0123456789: 1\r\n\r\n"
        data_len = len(HEAD) + len(wire)
        cuts = sorted(rng.sample(range(1, data_len), min(data_len - 1, rng.randint(1, 40))))
        declared = _declared(wire, cuts)
        assert max(declared, default=-1) <= sum(sizes), (wire, cuts, declared)


def test_a_large_size_is_seen_complete_or_in_part() -> None:
    big = 0x7FFFFFFFFFFFFFFF
    wire = b"5\r\nhello\r\n7FFFFFFFFFFFFFFF;x=1\r\n"
    head = len(HEAD)
    for cut in range(head + 1, head + len(wire)):
        declared = _declared(wire, [cut])
        assert declared[-1] == 5 + big, (cut, declared)
    # digits so far: "7FFF" says at least 0x7FFF more bytes
    assert _declared(b"5\r\nhello\r\n7FFF", [head + 4])[-1] == 5 + 0x7FFF
