"""pdserve.core.datatypes: the shape and element-count checks both codecs and the model
configuration share."""

from __future__ import annotations

import pytest

from pdserve.core.datatypes import (
    MAX_DIMS,
    WILDCARD_DIM,
    dims_element_count,
    fixed_dim_chunks,
    shape_element_count,
    shape_str,
)
from pdserve.core.errors import InferError


@pytest.mark.parametrize(
    ("shape", "count"),
    [([], 1), ([0], 0), ([3], 3), ([2, 3, 4], 24), ([0, 2**40], 0), ([1] * MAX_DIMS, 1)],
)
def test_shape_element_count(shape: list[int], count: int) -> None:
    assert shape_element_count(shape, "x") == count


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        ([-1], "input 'x' has shape [-1]: dimensions must be non-negative integers"),
        ([2, 1.0], "input 'x' has shape [2, 1.0]: dimensions must be non-negative integers"),
        ([True], "input 'x' has shape [True]: dimensions must be non-negative integers"),
        ([1] * 65, "input 'x' has 65 dimensions; at most 64 are supported"),
        (
            [0, 2**59],
            "input 'x' has shape [0, 576460752303423488]: too many elements "
            "(the product of its non-zero dimensions must be below 2**59)",
        ),
        ([2**30, 2**29], "too many elements"),
    ],
)
def test_shape_element_count_errors(shape: list, message: str) -> None:
    with pytest.raises(InferError) as e:
        shape_element_count(shape, "x")
    assert message in e.value.message


def test_dims_element_count_is_tritons() -> None:
    assert dims_element_count([]) == 0
    assert dims_element_count([4]) == 4
    assert dims_element_count([2, 3, 4]) == 24
    assert dims_element_count([2, WILDCARD_DIM]) == WILDCARD_DIM


def test_fixed_dim_chunks_and_shape_str() -> None:
    assert fixed_dim_chunks([2, 4, -1, 6]) == [8, 6]
    assert fixed_dim_chunks([-1]) == [1, 1]
    assert fixed_dim_chunks([]) == [1]
    assert shape_str([2, -1, 3]) == "[2,-1,3]"
    assert shape_str([]) == "[]"
    assert shape_str(None) == "unknown"
