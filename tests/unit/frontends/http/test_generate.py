"""pdserve.frontends.http.generate: generate-extension requests are checked as /infer's;
responses are laid out as Triton's (outputs and parameters top-level, flat arrays)."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
import pytest

from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.types import InferResponse
from pdserve.frontends.http.generate import generate_request, response_json

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


def test_the_id_is_the_request_id_and_a_string() -> None:
    r = request({"IN": [1], "id": "42"})
    assert r.id == "42" and r.parameters["id"] == "42"  # as Triton: a parameter too
    assert request({"IN": [1]}).id == ""
    with pytest.raises(InferError) as e:
        request({"IN": [1], "id": 42})
    assert e.value.code == ErrorCode.INVALID_ARG and "Unable to parse 'id'" in e.value.message


def test_response_fields_are_top_level_and_arrays_flat() -> None:
    outputs = {
        "one": np.array([[7]], dtype=np.int32),  # one element: the element
        "row": np.array([[1.5, 2.5, 3.5]], dtype=np.float32),  # batch of 1: flat
        "grid": np.arange(4, dtype=np.int64).reshape(2, 2),  # row-major, flat
        "text": np.array([[b"a"], [b"b"]], dtype=object),
    }
    response = InferResponse("m", "3", outputs, id="r7", parameters={"p": 2, "q": "x"})
    assert orjson.loads(response_json(response)) == {
        "id": "r7",
        "model_name": "m",
        "model_version": "3",
        "p": 2,
        "q": "x",
        "one": 7,
        "row": [1.5, 2.5, 3.5],
        "grid": [0, 1, 2, 3],
        "text": ["a", "b"],
    }
    assert "id" not in orjson.loads(response_json(InferResponse("m", "1", outputs)))
