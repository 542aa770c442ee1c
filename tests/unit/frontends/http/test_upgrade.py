"""pdserve.frontends.http.upgrade: the body framing of a request asking to upgrade, and
the parser that reads its body and the requests after it."""

from __future__ import annotations

import httptools
import pytest

from pdserve.frontends.http.upgrade import (
    InvalidFramingError,
    body_framing,
    continue_after_upgrade,
    parser_after_upgrade,
)


def test_body_framing() -> None:
    assert body_framing([(b"content-length", b"12")]) == b"content-length: 12"
    assert body_framing([(b"content-length", b"0")]) == b""
    assert body_framing([(b"content-length", b"000")]) == b""
    assert body_framing([(b"upgrade", b"h2c")]) == b""
    assert body_framing([(b"transfer-encoding", b"gzip, Chunked")]) == (
        b"transfer-encoding: chunked"
    )
    with pytest.raises(InvalidFramingError, match="Transfer-Encoding"):
        body_framing([(b"transfer-encoding", b"gzip")])


class _Recorder:
    def __init__(self) -> None:
        self.events: list[object] = []

    def on_message_begin(self) -> None:
        self.events.append("begin")

    def on_url(self, url: bytes) -> None:
        self.events.append(("url", url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.events.append(("header", name))

    def on_headers_complete(self) -> None:
        self.events.append("headers")

    def on_body(self, body: bytes) -> None:
        self.events.append(("body", body))

    def on_message_complete(self) -> None:
        self.events.append("complete")


@pytest.mark.parametrize(
    ("framing", "wire"),
    [
        (b"content-length: 5", b"hel" + b"lo"),
        (b"transfer-encoding: chunked", b"3\r\nhel\r\n2\r\nlo\r\n0\r\n\r\n"),
    ],
)
def test_parser_after_upgrade_reads_the_body_then_the_next_request(
    framing: bytes, wire: bytes
) -> None:
    head = b"POST /x HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n%s\r\n\r\n" % framing
    rec = _Recorder()
    with pytest.raises(httptools.HttpParserUpgrade) as info:
        httptools.HttpRequestParser(rec).feed_data(head + wire[:3])
    assert rec.events[-1] == "complete"  # llhttp skipped the body
    assert info.value.args[0] == len(head)
    rec.events.clear()
    name, _, value = framing.partition(b": ")
    parser = parser_after_upgrade(rec, body_framing([(name, value)]))
    assert rec.events == []  # the synthetic head is swallowed
    parser.feed_data(wire[:3])
    parser.feed_data(wire[3:] + b"GET /next HTTP/1.1\r\n\r\n")
    body = b"".join(e[1] for e in rec.events if isinstance(e, tuple) and e[0] == "body")
    assert body == b"hello"
    assert rec.events[-5:] == ["complete", "begin", ("url", b"/next"), "headers", "complete"]
    assert parser.get_method() == b"GET"


def test_continue_after_upgrade_takes_the_kept_framing() -> None:
    head = b"POST /x HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\ncontent-length: 2\r\n\r\n"
    rec = _Recorder()
    data = head + b"hi"
    with pytest.raises(httptools.HttpParserUpgrade) as info:
        httptools.HttpRequestParser(rec).feed_data(data)
    rec.events.clear()
    rec._upgrade_framing = b"content-length: 2"
    rest = continue_after_upgrade(rec, data, info.value)
    assert rest == b"hi" and rec._upgrade_framing == b""
    rec.parser.feed_data(rest)
    assert rec.events == [("body", b"hi"), "complete"]
