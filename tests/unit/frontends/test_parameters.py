"""The request-level ``parameters`` rules both frontends apply."""

from __future__ import annotations

import pytest

from pdserve.core.errors import ErrorCode, InferError
from pdserve.frontends.parameters import check_request_parameters, check_scalar_parameters


def test_scalar_parameters_accept_strings_numbers_and_booleans() -> None:
    check_scalar_parameters({"a": "x", "b": 1, "c": 1.5, "d": True}, "input 'x'")


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (None, "null (or an InferParameter with no value set)"),
        ([1], "an array"),
        ({"k": 1}, "an object"),
    ],
)
def test_scalar_parameters_reject_other_values_naming_the_key(value: object, kind: str) -> None:
    with pytest.raises(InferError) as err:
        check_scalar_parameters({"ok": 1, "bad": value}, "input 'x'")
    assert err.value.code is ErrorCode.INVALID_ARG
    assert str(err.value) == (
        f"input 'x' parameter 'bad' must be a string, number or boolean, not {kind}"
    )


def test_reserved_keys_accept_values_of_their_type() -> None:
    params = {
        "priority": 3,
        "timeout": 0,
        "sequence_id": "corr-1",
        "sequence_start": True,
        "sequence_end": False,
        "binary_data_output": True,
        "custom": 2.5,
    }
    check_request_parameters(params)
    check_request_parameters({**params, "sequence_id": (1 << 64) - 1}, grpc=True)


@pytest.mark.parametrize(
    ("params", "grpc", "message"),
    [
        (
            {"priority": -1},
            False,
            "request parameter 'priority' must be a non-negative integer, got -1",
        ),
        (
            {"priority": 1 << 64},
            True,
            "request parameter 'priority' must be an int64_param >= 0 or a uint64_param, "
            "got 18446744073709551616",
        ),
        (
            {"timeout": 1.5},
            False,
            "request parameter 'timeout' must be a non-negative integer (microseconds), got 1.5",
        ),
        (
            {"sequence_start": 1},
            False,
            "request parameter 'sequence_start' must be true or false, got 1",
        ),
        (
            {"sequence_end": "yes"},
            True,
            "request parameter 'sequence_end' must be a bool_param, got 'yes'",
        ),
        (
            {"sequence_id": True},
            False,
            "request parameter 'sequence_id' must be a non-negative integer or a string, got True",
        ),
        (
            {"priority": "x" * 50},
            False,
            "request parameter 'priority' must be a non-negative integer, got '" + "x" * 36 + "...",
        ),
        (
            {"other": [1, 2]},
            False,
            "request parameter 'other' must be a string, number or boolean, not an array",
        ),
    ],
)
def test_reserved_keys_of_the_wrong_type_are_errors_naming_the_key(
    params: dict[str, object], grpc: bool, message: str
) -> None:
    with pytest.raises(InferError) as err:
        check_request_parameters(params, grpc=grpc)
    assert err.value.code is ErrorCode.INVALID_ARG
    assert str(err.value) == message


def test_triton_keys_are_reserved_but_grpc_allows_empty_final_response() -> None:
    with pytest.raises(InferError, match=r"'triton_x': .*reserved \(allowed: none\)"):
        check_request_parameters({"triton_x": 1})
    with pytest.raises(
        InferError, match=r"reserved \(allowed: triton_enable_empty_final_response\)"
    ):
        check_request_parameters({"triton_x": 1}, grpc=True)
    with pytest.raises(InferError, match="reserved"):
        check_request_parameters({"triton_enable_empty_final_response": True})
    check_request_parameters({"triton_enable_empty_final_response": True}, grpc=True)
    with pytest.raises(InferError, match="must be a bool_param, got 1"):
        check_request_parameters({"triton_enable_empty_final_response": 1}, grpc=True)


def test_binary_data_output_is_an_ordinary_key_over_grpc() -> None:
    with pytest.raises(InferError, match="'binary_data_output' must be true or false"):
        check_request_parameters({"binary_data_output": "yes"})
    check_request_parameters({"binary_data_output": "yes"}, grpc=True)
    with pytest.raises(InferError, match="not an object"):
        check_request_parameters({"binary_data_output": {}}, grpc=True)
