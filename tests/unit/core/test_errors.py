"""ErrorCode, InferError and the one status table of each frontend (issue 9)."""

from __future__ import annotations

import grpc
import pytest

from pdserve.backends.python import triton_python_backend_utils as pb
from pdserve.core import errors
from pdserve.core.errors import ErrorCode, InferError
from pdserve.frontends.grpc.service import GRPC_STATUS, grpc_status
from pdserve.frontends.http.status import (
    HTTP_STATUS,
    BodyTimeoutError,
    BodyTooLargeError,
    HttpError,
    MethodNotAllowedError,
    UnsupportedMediaTypeError,
    http_status,
)

#: TRITONSERVER_Error_Code, in its order (triton-inference-server/core tritonserver.h).
TRITON_CODES = [
    "UNKNOWN",
    "INTERNAL",
    "NOT_FOUND",
    "INVALID_ARG",
    "UNAVAILABLE",
    "UNSUPPORTED",
    "ALREADY_EXISTS",
    "CANCELLED",
]


def test_triton_codes_keep_tritons_names_and_values() -> None:
    for value, name in enumerate(TRITON_CODES):
        assert ErrorCode[name].value == value
    extensions = [c for c in ErrorCode if c.name not in TRITON_CODES]
    assert extensions == [
        ErrorCode.CLIENT_GONE,
        ErrorCode.UNAUTHENTICATED,
        ErrorCode.PERMISSION_DENIED,
        ErrorCode.RESOURCE_EXHAUSTED,
    ]
    assert all(c.value >= 100 for c in extensions)


def test_pb_utils_codes_are_the_error_codes_one_to_one() -> None:
    for name in TRITON_CODES:
        code = getattr(pb.TritonError, name)
        assert code == ErrorCode[name].value
        assert ErrorCode.from_triton(code) is ErrorCode[name]
        assert ErrorCode[name].triton_code is ErrorCode[name]
    assert pb.TritonError("x").code() == ErrorCode.INTERNAL.value  # Triton's default


def test_from_triton_makes_an_unknown_value_internal() -> None:
    assert ErrorCode.from_triton(42) is ErrorCode.INTERNAL
    assert ErrorCode.from_triton(-1) is ErrorCode.INTERNAL
    # an extension's value is not a Triton code: a model cannot send it
    assert ErrorCode.from_triton(ErrorCode.CLIENT_GONE.value) is ErrorCode.INTERNAL
    assert ErrorCode.CLIENT_GONE.triton_code is ErrorCode.CANCELLED


def test_http_table_covers_every_code_as_triton_does() -> None:
    assert set(HTTP_STATUS) == set(ErrorCode)
    assert {c.name: http_status(c) for c in ErrorCode} == {
        "UNKNOWN": 400,
        "INTERNAL": 500,
        "NOT_FOUND": 404,
        "INVALID_ARG": 400,
        "UNAVAILABLE": 503,
        "UNSUPPORTED": 501,
        "ALREADY_EXISTS": 400,
        "CANCELLED": 400,
        "CLIENT_GONE": 499,
        "UNAUTHENTICATED": 401,
        "PERMISSION_DENIED": 403,
        "RESOURCE_EXHAUSTED": 429,
    }


def test_grpc_table_covers_every_code_as_triton_does() -> None:
    assert set(GRPC_STATUS) == set(ErrorCode)
    assert {c.name: grpc_status(InferError("x", c)) for c in ErrorCode} == {
        "UNKNOWN": grpc.StatusCode.UNKNOWN,
        "INTERNAL": grpc.StatusCode.INTERNAL,
        "NOT_FOUND": grpc.StatusCode.NOT_FOUND,
        "INVALID_ARG": grpc.StatusCode.INVALID_ARGUMENT,
        "UNAVAILABLE": grpc.StatusCode.UNAVAILABLE,
        "UNSUPPORTED": grpc.StatusCode.UNIMPLEMENTED,
        "ALREADY_EXISTS": grpc.StatusCode.ALREADY_EXISTS,
        "CANCELLED": grpc.StatusCode.CANCELLED,
        "CLIENT_GONE": grpc.StatusCode.CANCELLED,
        "UNAUTHENTICATED": grpc.StatusCode.UNAUTHENTICATED,
        "PERMISSION_DENIED": grpc.StatusCode.PERMISSION_DENIED,
        "RESOURCE_EXHAUSTED": grpc.StatusCode.RESOURCE_EXHAUSTED,
    }


#: Traffic-control codes (issue 12): gRPC has a status of their own, which they use.
OWN_GRPC_STATUS = {
    ErrorCode.UNAUTHENTICATED,
    ErrorCode.PERMISSION_DENIED,
    ErrorCode.RESOURCE_EXHAUSTED,
}


def test_an_extension_maps_like_its_triton_code_over_grpc() -> None:
    for code in ErrorCode:
        if code not in OWN_GRPC_STATUS:
            assert GRPC_STATUS[code] == GRPC_STATUS[code.triton_code]


def test_infer_error_carries_a_code_and_no_http_number() -> None:
    e = InferError("bad input")
    assert (e.message, e.code, e.reason, str(e)) == (
        "bad input",
        ErrorCode.INVALID_ARG,
        "REJECTED",
        "bad input",
    )
    assert not hasattr(e, "status")
    assert InferError("boom", ErrorCode.INTERNAL).reason == "BACKEND"
    assert InferError("x", ErrorCode.UNAVAILABLE, reason="QUEUE").reason == "QUEUE"
    with pytest.raises(TypeError, match="must be an ErrorCode"):
        InferError("x", 503)  # type: ignore[arg-type]


def test_helper_constructors_return_the_right_codes() -> None:
    cases = [
        (errors.invalid_arg("m"), ErrorCode.INVALID_ARG, "REJECTED"),
        (errors.not_found("m"), ErrorCode.NOT_FOUND, "REJECTED"),
        (errors.unavailable("m"), ErrorCode.UNAVAILABLE, "REJECTED"),
        (errors.internal("m"), ErrorCode.INTERNAL, "BACKEND"),
        (errors.unsupported("m"), ErrorCode.UNSUPPORTED, "REJECTED"),
        (errors.client_gone("m"), ErrorCode.CLIENT_GONE, "CANCELED"),
    ]
    for err, code, reason in cases:
        assert (err.message, err.code, err.reason) == ("m", code, reason)
    assert errors.unavailable("m", reason="REJECTED").reason == "REJECTED"
    assert errors.client_gone().message == "request was cancelled: the client went away"


def test_fresh_keeps_code_reason_and_attributes_but_no_traceback() -> None:
    try:
        raise InferError("gone", ErrorCode.CLIENT_GONE, reason="CANCELED")
    except InferError as caught:
        original = caught
    original.extra = 1  # type: ignore[attr-defined]
    copy = original.fresh()
    assert copy is not original and original.__traceback__ is not None
    assert copy.__traceback__ is None and copy.__context__ is None
    assert (copy.message, copy.code, copy.reason) == ("gone", ErrorCode.CLIENT_GONE, "CANCELED")
    assert copy.extra == 1  # type: ignore[attr-defined]


def test_http_only_errors_carry_their_status() -> None:
    assert (MethodNotAllowedError("m").status, MethodNotAllowedError("m").close) == (405, False)
    assert UnsupportedMediaTypeError("m").status == 415
    assert (BodyTooLargeError("m").status, BodyTooLargeError("m").close) == (413, True)
    assert (BodyTimeoutError("m").status, BodyTimeoutError("m").close) == (408, True)
    e = HttpError("teapot", 418)
    assert (e.status, e.message, str(e)) == (418, "teapot", "teapot")
    assert not isinstance(e, InferError)
