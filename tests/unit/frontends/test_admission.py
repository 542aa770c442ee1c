"""pdserve.frontends.admission: the request setup HTTP and gRPC share."""

from __future__ import annotations

import contextvars

import pytest

from pdserve.core import context
from pdserve.core.types import InferRequest
from pdserve.frontends.admission import (
    PIN_HEADER,
    ROUTE_KEY_HEADER,
    admit,
    header_text,
    metadata_admission,
)
from pdserve.frontends.traffic.gate import principal_name

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (b"user-1", "user-1"),
        ("user-1", "user-1"),
        ("\u00fc".encode(), "\u00fc"),  # UTF-8 bytes
        ("\u00fc".encode("latin-1"), "\u00fc"),  # not UTF-8: latin-1
        ("\u00fc", "\u00fc"),  # already text (grpcio)
    ],
)
def test_header_text(value: bytes | str, text: str) -> None:
    assert header_text(value) == text


def _admitted(route_key: bytes | str, pinned: bytes | str, principal: str | None) -> InferRequest:
    def run() -> InferRequest:
        if principal is not None:
            principal_name.set(principal)
        request = InferRequest(model_name="m", id="r1")
        admit(request, "HTTP", "token", TRACEPARENT.encode(), route_key, pinned)
        assert context.request_id.get() == "r1"
        return request

    return contextvars.copy_context().run(run)


def test_admit_sets_what_both_protocols_carry() -> None:
    request = _admitted(b"key", b" 2 ", None)
    assert request.cancelled == "token"
    assert request.route_key == "key"
    assert request.pinned_version == "2"
    assert request.traceparent == TRACEPARENT.encode()


def test_the_principal_is_the_route_key_only_without_a_header() -> None:
    assert _admitted(b"", b"", "alice").route_key == "alice"
    assert _admitted(b"key", b"", "alice").route_key == "key"
    assert _admitted(b"", b"", None).route_key == ""


def test_metadata_admission_reads_the_last_value_of_each_key() -> None:
    metadata = [
        ("traceparent", TRACEPARENT),
        (ROUTE_KEY_HEADER, "a"),
        (ROUTE_KEY_HEADER, "b"),
        (PIN_HEADER, "3"),
        ("other", "x"),
    ]
    assert metadata_admission(metadata) == (TRACEPARENT, "b", "3")
    assert metadata_admission(None) == (None, "", "")
