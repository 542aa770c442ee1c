"""pdserve.frontends.http.generate: generate-extension requests are checked as /infer's."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pdserve.core.errors import ErrorCode, InferError
from pdserve.frontends.http.generate import generate_request

META = {
    "inputs": [
        {"name": "IN", "datatype": "INT32", "shape": [-1]},
        {"name": "X", "datatype": "FP32", "shape": [-1]},
        {"name": "TEXT", "datatype": "BYTES", "shape": [1]},
        {"name": "FLAG", "datatype": "BOOL", "shape": [1]},
    ]
}


def request(doc: dict[str, Any]) -> Any:
    return generate_request(doc, "m", "", META, batching=False, arrival_ns=0)


def test_values_of_the_right_json_type_convert() -> None:
    r = request({"IN": [1, 2], "X": [1, 2.5], "TEXT": "hello", "FLAG": True, "timeout": 5})
    assert r.inputs["IN"].dtype == np.int32 and r.inputs["IN"].tolist() == [1, 2]
    assert r.inputs["X"].tolist() == [1.0, 2.5]
    assert r.inputs["TEXT"].tolist() == [b"hello"]
    assert r.inputs["FLAG"].tolist() == [True]
    assert r.parameters == {"timeout": 5}


@pytest.mark.parametrize(
    ("doc", "words"),
    [
        ({"IN": [1.5, 2]}, "INT32: a value of JSON type float"),
        ({"IN": [True]}, "INT32: a value of JSON type bool"),
        ({"X": ["1"]}, "FP32: a value of JSON type str"),
        ({"TEXT": None}, "BYTES: a value of JSON type null"),
        ({"TEXT": {"x": 1}}, "BYTES: a value of JSON type dict"),
        ({"FLAG": 1}, "BOOL: a value of JSON type int"),
    ],
)
def test_values_of_the_wrong_json_type_are_refused(doc: dict[str, Any], words: str) -> None:
    with pytest.raises(InferError) as e:
        request(doc)
    assert e.value.code == ErrorCode.INVALID_ARG
    assert words in e.value.message


@pytest.mark.parametrize(
    "params",
    [
        {"timeout": "abc"},
        {"timeout": -5},
        {"priority": "x"},
        {"parameters": {"timeout": [1]}},
        {"sequence_id": -1, "sequence_start": True},
        {"sequence_start": "yes"},
    ],
)
def test_request_parameters_are_checked_as_infer_checks_them(params: dict[str, Any]) -> None:
    with pytest.raises(InferError) as e:
        request({"IN": [1], **params})
    assert e.value.code == ErrorCode.INVALID_ARG
