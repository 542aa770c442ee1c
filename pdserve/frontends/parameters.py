"""The request-level ``parameters`` rules both frontends apply.

Values are a string, a number or a boolean ([V2] REST ``$parameters``; gRPC's
``InferParameter`` oneof). As Triton's frontends (``src/http_server.cc``
``ParseJsonTritonParams``, ``src/grpc/infer_handler.cc``), these keys are checked and a
value of the wrong type is an error naming the key: ``priority`` and ``timeout`` (µs)
unsigned integers, ``sequence_id`` an unsigned integer or a string, ``sequence_start`` /
``sequence_end`` booleans, ``binary_data_output`` a boolean (HTTP); keys starting with
``triton_`` are reserved (gRPC allows ``triton_enable_empty_final_response``, a
boolean). The checks run only when a request has parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pdserve.core.errors import InferError

__all__ = ["check_request_parameters", "check_scalar_parameters"]

#: The largest unsigned 64-bit value (``priority``, ``timeout``, ``sequence_id``).
_U64_MAX = (1 << 64) - 1

#: What a reserved key's value must be, for HTTP (JSON) and for gRPC (``InferParameter``).
_UINT = ("a non-negative integer", "an int64_param >= 0 or a uint64_param")
_BOOL = ("true or false", "a bool_param")
_TIMEOUT = ("a non-negative integer (microseconds)", "an int64_param >= 0 (microseconds)")
_SEQ_ID = ("a non-negative integer or a string", "an int64_param >= 0 or a string_param")


def _is_uint(value: object) -> bool:
    return type(value) is int and 0 <= value <= _U64_MAX


def _is_bool(value: object) -> bool:
    return type(value) is bool


def _is_seq_id(value: object) -> bool:
    return type(value) is str or _is_uint(value)


#: Reserved keys -> (checker returning True for an acceptable value, what it must be).
_RESERVED: dict[str, tuple[Callable[[object], bool], tuple[str, str]]] = {
    "priority": (_is_uint, _UINT),
    "timeout": (_is_uint, _TIMEOUT),
    "sequence_id": (_is_seq_id, _SEQ_ID),
    "sequence_start": (_is_bool, _BOOL),
    "sequence_end": (_is_bool, _BOOL),
    "binary_data_output": (_is_bool, _BOOL),
}

#: Keys starting with ``triton_`` that gRPC clients may send [TRITON], and their rules.
_GRPC_TRITON_KEYS: dict[str, tuple[Callable[[object], bool], tuple[str, str]]] = {
    "triton_enable_empty_final_response": (_is_bool, _BOOL),
}

_SCALARS = (str, int, float, bool)


def _kind(value: object) -> str:
    """How a value that is not a V2 parameter value appears on the wire."""
    if value is None:
        return "null (or an InferParameter with no value set)"
    if type(value) is list:
        return "an array"
    if type(value) is dict:
        return "an object"
    return type(value).__name__


def check_scalar_parameters(params: Mapping[str, object], where: str) -> None:
    """Check that every value of a ``parameters`` object is a string, number or
    boolean [V2].

    Args:
        params: the decoded parameters (HTTP: the JSON object; gRPC: the oneof values,
            ``None`` where no value is set).
        where: names the object in the message, e.g. ``"input 'x'"``.

    Raises:
        InferError(INVALID_ARG): a value that is null, an array or an object, naming
            its key.
    """
    for key, value in params.items():
        if not isinstance(value, _SCALARS):
            raise InferError(
                f"{where} parameter '{key}' must be a string, number or boolean, not {_kind(value)}"
            )


def check_request_parameters(params: Mapping[str, object], grpc: bool = False) -> None:
    """Check a request's ``parameters`` against [V2] and [TRITON] (see the module
    docstring).

    Args:
        params: the decoded request parameters.
        grpc: the request came over gRPC (``binary_data_output`` is HTTP's only and is
            then an ordinary key; ``triton_enable_empty_final_response`` is allowed).

    Raises:
        InferError(INVALID_ARG): naming the key: a value that is not a string, number
            or boolean; a reserved key whose value has the wrong type or range; a key
            starting with ``triton_`` that is reserved for Triton.
    """
    for key, value in params.items():
        rule = _RESERVED.get(key)
        if rule is None and key.startswith("triton_"):
            rule = _GRPC_TRITON_KEYS.get(key) if grpc else None
            if rule is None:
                allowed = ", ".join(_GRPC_TRITON_KEYS) if grpc else "none"
                raise InferError(
                    f"request parameter '{key}': keys starting with 'triton_' are reserved "
                    f"(allowed: {allowed})"
                )
        if rule is not None and not (grpc and key == "binary_data_output"):
            ok, wanted = rule
            if not ok(value):
                raise InferError(
                    f"request parameter '{key}' must be {wanted[grpc]}, got {_show(value)}"
                )
        elif not isinstance(value, _SCALARS):
            raise InferError(
                f"request parameter '{key}' must be a string, number or boolean, not {_kind(value)}"
            )


def _show(value: object) -> str:
    """A short rendering of a bad value for a message."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
