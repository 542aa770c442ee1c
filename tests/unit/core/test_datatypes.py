"""pdserve.core.datatypes: the shape and element-count checks both codecs and the model
configuration share, and the one BYTES codec."""

from __future__ import annotations

import struct

import numpy as np
import pytest

from pdserve.core.datatypes import (
    MAX_DIMS,
    WILDCARD_DIM,
    array_from_raw,
    deserialize_bytes_tensor,
    dims_element_count,
    fixed_dim_chunks,
    raw_tensor,
    serialize_bytes_tensor,
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


# --------------------------------------------------------------------------- BYTES codec


def _elements(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


def test_bytes_tensor_round_trip() -> None:
    array = np.array([[b"abc", "h\u00e9"], [b"", 7]], dtype=object)
    data = serialize_bytes_tensor(array)
    # row-major; str as UTF-8; a number as str(number), as Triton's pb_utils
    assert data == _elements(b"abc", "h\u00e9".encode(), b"", b"7")
    for buffer in (data, bytearray(data), memoryview(data)):
        out = deserialize_bytes_tensor(buffer, 4)
        assert out.dtype == object and out.shape == (4,)
        assert out.tolist() == [b"abc", b"h\xc3\xa9", b"", b"7"]
        assert all(type(x) is bytes for x in out)
    assert deserialize_bytes_tensor(data).tolist() == deserialize_bytes_tensor(data, 4).tolist()
    # numpy S and U arrays are BYTES too
    assert serialize_bytes_tensor(np.array([b"ab", b"c"])) == _elements(b"ab", b"c")
    assert serialize_bytes_tensor(np.array(["\u00fc", "x"])) == _elements(b"\xc3\xbc", b"x")
    buffers = np.empty(2, dtype=object)
    buffers[:] = [bytearray(b"q"), memoryview(b"r")]
    assert serialize_bytes_tensor(buffers) == _elements(b"q", b"r")


def test_bytes_tensor_empty_strings_and_no_elements() -> None:
    array = np.array([b"", b"", b"x"], dtype=object)
    data = serialize_bytes_tensor(array)
    assert data == b"\0\0\0\0\0\0\0\0\x01\0\0\0x"
    assert deserialize_bytes_tensor(data, 3).tolist() == [b"", b"", b"x"]
    assert serialize_bytes_tensor(np.empty((0, 4), dtype=object)) == b""
    empty = deserialize_bytes_tensor(b"", 0)
    assert empty.shape == (0,) and empty.dtype == object
    assert deserialize_bytes_tensor(memoryview(b"")).shape == (0,)


def test_bytes_tensor_non_ascii_bytes_are_kept_as_they_are() -> None:
    raw = [bytes(range(256)), b"\xff\xfe\x00", "\u65e5\u672c".encode("utf-8"), b"\x00" * 5]
    array = np.empty(4, dtype=object)
    array[:] = raw
    assert deserialize_bytes_tensor(serialize_bytes_tensor(array), 4).tolist() == raw


def test_large_bytes_buffers_decode_without_keeping_the_buffer() -> None:
    big = [b"a" * 100_000, b"b" * 70_000, b""]
    data = bytearray(_elements(*big))  # > 64 KiB of large elements: sliced in place
    out = deserialize_bytes_tensor(memoryview(data), 3)
    data[4:8] = b"zzzz"  # the decoded elements are copies
    assert out.tolist() == big and all(type(x) is bytes for x in out)
    many = [bytes([i % 251]) * 3 for i in range(30_000)]  # many small elements: copied once
    assert deserialize_bytes_tensor(memoryview(_elements(*many)), len(many)).tolist() == many
    words = np.frombuffer(_elements(b"abcd", b"efgh"), dtype=np.uint32)  # not a byte format
    assert deserialize_bytes_tensor(memoryview(words), 2).tolist() == [b"abcd", b"efgh"]


@pytest.mark.parametrize(
    ("data", "count", "message"),
    [
        (struct.pack("<I", 9) + b"ab", 1, "truncated: element of 9 bytes runs past the end"),
        (struct.pack("<I", 9) + b"ab", None, "truncated: element of 9 bytes runs past the end"),
        (_elements(b"ab") + b"\x01\x00", None, "truncated: a length prefix runs past the end"),
        (_elements(b"ab") + b"\x01\x00", 1, "truncated: 2 bytes follow its 1 elements"),
        (_elements(b"ab", b"c"), 1, "holds more than 1 elements but its shape calls for 1"),
        (_elements(b"abcdefgh", b""), 4, "holds 2 elements but its shape calls for 4"),
        (_elements(b"a"), 3, "its 5 bytes hold at most 1 elements but its shape calls for 3"),
        (b"\x05\x00", None, "truncated: a length prefix runs past the end"),
    ],
)
def test_truncated_or_miscounted_bytes_give_a_clear_error(
    data: bytes, count: int | None, message: str
) -> None:
    for buffer in (data, memoryview(data)):
        with pytest.raises(InferError) as e:
            deserialize_bytes_tensor(buffer, count)
        assert message in e.value.message
        assert e.value.code.name == "INVALID_ARG"


# --------------------------------------------------------------------------- raw contents


def test_raw_tensor_is_little_endian_row_major_and_round_trips() -> None:
    arr = np.arange(6, dtype=">i4").reshape(2, 3)[:, ::2]  # big-endian, not contiguous
    datatype, data = raw_tensor(arr)
    assert datatype == "INT32"
    assert data == struct.pack("<4i", 0, 2, 3, 5)
    back = array_from_raw(data, datatype, [2, 2], 4, "input 'x'")
    assert back.tolist() == [[0, 2], [3, 5]]


def test_raw_tensor_bytes_uses_the_bytes_codec() -> None:
    arr = np.array([b"ab", "c"], dtype=object)
    assert raw_tensor(arr) == ("BYTES", b"\x02\x00\x00\x00ab\x01\x00\x00\x00c")
    back = array_from_raw(raw_tensor(arr)[1], "BYTES", [2], 2, "output 'y'")
    assert back.dtype == object and back.tolist() == [b"ab", b"c"]


def test_raw_tensor_refuses_a_dtype_without_v2_datatype() -> None:
    with pytest.raises(InferError, match="numpy dtype complex64 has no V2 datatype"):
        raw_tensor(np.zeros(2, dtype=np.complex64))


@pytest.mark.parametrize(
    ("data", "datatype", "count", "message"),
    [
        (b"\0" * 7, "FP32", 2, "unexpected total byte size 7 for input 'x', expecting 8"),
        (b"\0" * 8, "FP9", 2, "input 'x' has unknown datatype 'FP9'"),
        (b"\x05\0\0\0ab", "BYTES", 1, "input 'x': "),
    ],
)
def test_array_from_raw_names_the_tensor(
    data: bytes, datatype: str, count: int, message: str
) -> None:
    with pytest.raises(InferError) as err:
        array_from_raw(data, datatype, [count], count, "input 'x'")
    assert err.value.message.startswith(message), err.value.message
