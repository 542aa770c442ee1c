"""The one table of tensor datatypes: KServe V2 names, numpy dtypes, config enums.

V2 datatype names follow the Open Inference Protocol
(https://github.com/kserve/open-inference-protocol, "Tensor Data Types"); the
``TYPE_*`` names are Triton's ``model_config.proto`` ``DataType`` enum. BYTES
tensors are numpy ``object`` arrays whose items are ``bytes`` (Triton's
convention). On the wire (binary tensor extension, gRPC ``raw_*_contents``) each
BYTES element is a 4-byte little-endian unsigned length followed by the bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from pdserve.core.errors import InferError

#: V2 datatype name -> numpy dtype (BYTES -> object).
V2_TO_NUMPY: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
    "BYTES": np.dtype(object),
}

#: numpy dtype -> V2 datatype name. Unicode/bytes string arrays map to BYTES.
NUMPY_TO_V2: dict[np.dtype, str] = {v: k for k, v in V2_TO_NUMPY.items()}

#: V2 datatype -> little-endian numpy dtype (raw contents are little-endian).
V2_LE_DTYPE: dict[str, np.dtype] = {
    k: v.newbyteorder("<") for k, v in V2_TO_NUMPY.items() if k != "BYTES"
}

#: Size in bytes of one element, for fixed-size datatypes.
V2_ITEMSIZE: dict[str, int] = {k: v.itemsize for k, v in V2_TO_NUMPY.items() if k != "BYTES"}

#: V2 datatype name <-> model configuration ``DataType`` enum name (``TYPE_FP32``...).
V2_TO_CONFIG: dict[str, str] = {
    k: ("TYPE_STRING" if k == "BYTES" else f"TYPE_{k}") for k in V2_TO_NUMPY
}
CONFIG_TO_V2: dict[str, str] = {v: k for k, v in V2_TO_CONFIG.items()}

#: V2 datatype -> the gRPC ``InferTensorContents`` field that carries it typed (FP16 and
#: BF16 have none: raw contents only). Used by the gRPC frontend's codec and the remote
#: backend's gRPC client.
GRPC_CONTENTS_FIELD: dict[str, str] = {
    "BOOL": "bool_contents",
    "INT8": "int_contents",
    "INT16": "int_contents",
    "INT32": "int_contents",
    "INT64": "int64_contents",
    "UINT8": "uint_contents",
    "UINT16": "uint_contents",
    "UINT32": "uint_contents",
    "UINT64": "uint64_contents",
    "FP32": "fp32_contents",
    "FP64": "fp64_contents",
    "BYTES": "bytes_contents",
}

#: ONNX Runtime type strings (``NodeArg.type``) -> V2 datatype name.
ORT_TO_V2: dict[str, str] = {
    "tensor(bool)": "BOOL",
    "tensor(uint8)": "UINT8",
    "tensor(uint16)": "UINT16",
    "tensor(uint32)": "UINT32",
    "tensor(uint64)": "UINT64",
    "tensor(int8)": "INT8",
    "tensor(int16)": "INT16",
    "tensor(int32)": "INT32",
    "tensor(int64)": "INT64",
    "tensor(float16)": "FP16",
    "tensor(float)": "FP32",
    "tensor(double)": "FP64",
    "tensor(string)": "BYTES",
}


def numpy_to_v2(dtype: np.dtype) -> str:
    """Return the V2 datatype name for a numpy dtype.

    ``object``, ``bytes_`` (``S``) and ``str_`` (``U``) arrays are BYTES.

    Raises:
        InferError(INVALID_ARG): the dtype has no V2 datatype (e.g. complex64).
    """
    dtype = np.dtype(dtype)
    if dtype.kind in "OSU":
        return "BYTES"
    try:
        return NUMPY_TO_V2[dtype.newbyteorder("=")]
    except KeyError:
        raise InferError(f"numpy dtype {dtype} has no V2 datatype") from None


def v2_to_numpy(datatype: str) -> np.dtype:
    """Return the numpy dtype for a V2 datatype name (``"FP32"`` -> ``float32``).

    Raises:
        InferError(INVALID_ARG): unknown datatype name.
    """
    try:
        return V2_TO_NUMPY[datatype]
    except KeyError:
        raise InferError(f"unsupported datatype '{datatype}'") from None


#: The 4-byte little-endian length before each BYTES element.
_LEN = struct.Struct("<I")

#: :func:`deserialize_bytes_tensor` copies a buffer of at most this many bytes (or one
#: whose elements average under :data:`_COPY_PER_ELEMENT` bytes) into one ``bytes``
#: and slices that: a ``bytes`` slice is one step per element, a memoryview slice
#: and its copy two. Larger buffers of large elements are sliced in place.
_COPY_MAX = 64 * 1024
_COPY_PER_ELEMENT = 1024


def _element_bytes(item: object) -> bytes:
    """One BYTES element as ``bytes``: ``str`` -> UTF-8, ``bytearray``/``memoryview``
    copied, anything else (a number in an object array) as ``str(item)`` in UTF-8, as
    Triton's ``pb_utils.serialize_byte_tensor`` does."""
    if isinstance(item, bytes):
        return item
    if isinstance(item, str):
        return item.encode("utf-8")
    if isinstance(item, (bytearray, memoryview)):
        return bytes(item)
    return str(item).encode("utf-8")


def serialize_bytes_tensor(array: np.ndarray) -> bytes:
    """Encode a BYTES tensor (any shape, row-major) as length-prefixed elements.

    The one implementation of the BYTES wire format (both frontends, the python
    backend's shared memory and ``pb_utils.serialize_byte_tensor`` use it): each
    element becomes a ``uint32`` little-endian length followed by its bytes, the
    binary tensor extension's and gRPC's ``raw_*_contents`` encoding of BYTES.
    ``bytes`` elements are taken as they are, ``str`` elements are UTF-8 encoded,
    ``bytearray``/``memoryview`` copied, other objects written as ``str(item)``.
    Works on ``object``, ``S`` and ``U`` arrays; no elements gives ``b""``.

    Raises:
        InferError(INVALID_ARG): an element of 4 GiB or more (its length does not fit
            the prefix).
    """
    items = [x if type(x) is bytes else _element_bytes(x) for x in array.reshape(-1).tolist()]
    parts: list[bytes] = [b""] * (2 * len(items))
    parts[1::2] = items
    pack = _LEN.pack
    try:
        parts[0::2] = [pack(len(x)) for x in items]
    except struct.error:
        raise InferError(
            "a BYTES element is 4 GiB or longer: its length does not fit the 4-byte prefix"
        ) from None
    return b"".join(parts)


def deserialize_bytes_tensor(
    buffer: bytes | bytearray | memoryview, count: int | None = None
) -> np.ndarray:
    """Decode length-prefixed BYTES elements into a 1-D object array of ``bytes``.

    The inverse of :func:`serialize_bytes_tensor`. Each element is a new ``bytes``
    object: nothing refers to ``buffer`` afterwards (it may be shared memory that is
    reused at once).

    Args:
        buffer: concatenated ``<uint32 LE length><bytes>`` elements.
        count: the number of elements the shape calls for, if known. Then the buffer
            must hold at least ``4 * count`` bytes (checked before parsing) and parsing
            stops after ``count`` elements, so a buffer of millions of zero-length
            elements costs nothing when the shape calls for a few.

    Raises:
        InferError(INVALID_ARG): a length prefix or an element runs past the end of the
            buffer ("truncated"), or the buffer holds fewer or more elements than
            ``count``.
    """
    src: bytes | memoryview
    if type(buffer) is bytes:
        src = buffer
    else:
        src = memoryview(buffer)
        if src.format != "B" or src.ndim != 1:
            src = src.cast("B")
    n = len(src)
    if count is not None and n < 4 * count:
        raise InferError(
            f"BYTES tensor data is truncated: its {n} bytes hold at most {n // 4} elements "
            f"but its shape calls for {count} (each element needs a 4-byte length prefix)"
        )
    if type(src) is not bytes and (
        n <= _COPY_MAX or (count is not None and n < _COPY_PER_ELEMENT * count)
    ):
        src = bytes(src)
    unpack = _LEN.unpack_from
    if count is None:
        count = _element_count(src, n)
    items: list[Any] = []
    append = items.append
    offset = 0
    try:
        for _ in range(count):
            (length,) = unpack(src, offset)
            offset += 4
            end = offset + length
            if end > n:
                raise _element_past_end(length)
            append(src[offset:end])
            offset = end
    except struct.error:  # fewer than 4 bytes left for a length prefix
        if offset == n:
            raise InferError(
                f"BYTES tensor holds {len(items)} elements but its shape calls for {count}"
            ) from None
        raise InferError(
            "BYTES tensor data is truncated: a length prefix runs past the end"
        ) from None
    if offset != n:
        if n - offset < 4:
            raise InferError(
                f"BYTES tensor data is truncated: {n - offset} bytes follow its {count} "
                "elements, too few for a length prefix"
            )
        raise InferError(
            f"BYTES tensor holds more than {count} elements but its shape calls for {count}"
        )
    if type(src) is not bytes:
        items = list(map(bytes, items))
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out


def _element_count(src: bytes | memoryview, n: int) -> int:
    """How many elements the ``n`` bytes of ``src`` hold when no shape says: a length
    prefix cut short counts as one (parsing it then fails as truncated)."""
    unpack = _LEN.unpack_from
    count = offset = 0
    while n - offset >= 4:
        offset += 4 + unpack(src, offset)[0]
        count += 1
    return count + (offset < n)


def _element_past_end(length: int) -> InferError:
    return InferError(
        f"BYTES tensor data is truncated: element of {length} bytes runs past the end"
    )


# --------------------------------------------------------------------------- shapes
#
# The one home of shape and element-count checks: request shapes (both codecs) and
# configured dims (model configuration validation and auto-complete).

#: Most dimensions a tensor shape may have (numpy's own limit is 64).
MAX_DIMS = 64

#: A shape's element count, counting a 0 dimension as 1, must stay below this: numpy
#: refuses arrays whose ``size * itemsize`` passes 2**63 even when a 0 dimension makes
#: them empty, and 2**59 elements of the widest (8-byte) datatype is 2**62 bytes.
MAX_ELEMENTS = 1 << 59

#: Triton's ``WILDCARD_DIM``: a variable-size dimension in a model configuration.
WILDCARD_DIM = -1


def raw_tensor(array: np.ndarray) -> tuple[str, bytes]:
    """The V2 datatype of ``array`` and its raw contents, as gRPC's
    ``raw_input_contents``/``raw_output_contents`` and HTTP's binary tensor extension carry
    them: fixed-size datatypes little-endian, row-major; BYTES (``object``, ``S``, ``U``
    arrays) as :func:`serialize_bytes_tensor` writes it.

    Raises:
        InferError(INVALID_ARG): the dtype has no V2 datatype (e.g. complex64), or a BYTES
            element is 4 GiB or longer. Callers add which tensor it is.
    """
    if array.dtype.kind in "OSU":
        return "BYTES", serialize_bytes_tensor(array)
    datatype = numpy_to_v2(array.dtype)
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    return datatype, array.tobytes()


def array_from_raw(
    data: bytes | bytearray | memoryview,
    datatype: str,
    shape: list[int],
    count: int,
    what: str,
) -> np.ndarray:
    """The array that raw contents ``data`` hold (the inverse of :func:`raw_tensor`):
    ``count`` elements of ``datatype`` (a view of ``data`` for fixed-size datatypes, an
    ``object`` array of ``bytes`` for BYTES), reshaped to ``shape``.

    Args:
        what: the tensor in error messages, e.g. ``"input 'x'"``.

    Raises:
        InferError(INVALID_ARG): unknown datatype; ``data`` not exactly ``count``
            elements (Triton's "unexpected total byte size" for fixed-size datatypes,
            :func:`deserialize_bytes_tensor`'s errors for BYTES).
    """
    if datatype == "BYTES":
        try:
            return deserialize_bytes_tensor(data, count).reshape(shape)
        except InferError as exc:
            raise InferError(f"{what}: {exc.message}") from None
    dtype = V2_LE_DTYPE.get(datatype)
    if dtype is None:
        raise InferError(f"{what} has unknown datatype '{datatype}'")
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise InferError(f"unexpected total byte size {len(data)} for {what}, expecting {expected}")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def shape_element_count(shape: Sequence[int], name: str) -> int:
    """The element count of a request input's ``shape`` (1 for ``[]``), checked for
    use as a numpy shape.

    Both frontends decode a request's shapes with it (KServe V2 ``shape``: int64
    values, here non-negative; HTTP JSON gives Python ints, gRPC ``int64`` fields).

    Args:
        shape: the dimensions, each a Python ``int`` (a float or bool is refused).
        name: the input's name, for the messages.

    Raises:
        InferError(INVALID_ARG): a dimension that is not a non-negative ``int``, more than
            :data:`MAX_DIMS` dimensions, or an element count (0 dimensions counted
            as 1) of :data:`MAX_ELEMENTS` or more.
    """
    if len(shape) > MAX_DIMS:
        raise InferError(
            f"input '{name}' has {len(shape)} dimensions; at most {MAX_DIMS} are supported"
        )
    count = 1
    for dim in shape:
        if type(dim) is not int or dim < 0:
            raise InferError(
                f"input '{name}' has shape {shape}: dimensions must be non-negative integers"
            )
        count *= dim
    if count == 0 or count >= MAX_ELEMENTS:
        span = 1
        for dim in shape:
            if dim:
                span *= dim
        if span >= MAX_ELEMENTS:
            raise InferError(
                f"input '{name}' has shape {shape}: too many elements "
                f"(the product of its non-zero dimensions must be below 2**59)"
            )
    return count


def dims_element_count(dims: Iterable[int]) -> int:
    """Triton's ``GetElementCount`` of configured dims.

    Returns:
        :data:`WILDCARD_DIM` (-1) if any dimension is variable; 0 for no dims;
        otherwise the product of the dims.
    """
    dims = list(dims)
    if any(d == WILDCARD_DIM for d in dims):
        return WILDCARD_DIM
    count = 0
    for i, d in enumerate(dims):
        count = d if i == 0 else count * d
    return count


def fixed_dim_chunks(dims: Iterable[int]) -> list[int]:
    """Element counts of the runs of fixed dims between variable ones.

    ``[2, 4, -1, 6]`` -> ``[8, 6]``; two shapes with equal chunks reshape into each
    other whatever the variable dimensions turn out to be (Triton's reshape check).
    """
    out, current = [], 1
    for d in dims:
        if d == WILDCARD_DIM:
            out.append(current)
            current = 1
        else:
            current *= d
    out.append(current)
    return out


def shape_str(shape: Sequence[int] | None) -> str:
    """A shape as messages show it: ``[2,-1,3]``; ``unknown`` for None (unknown rank)."""
    return "unknown" if shape is None else "[" + ",".join(str(d) for d in shape) + "]"


def bytes_array(items: Iterable[bytes | str]) -> np.ndarray:
    """Build a 1-D object array of ``bytes`` from bytes or str items (str -> UTF-8)."""
    values = [i.encode("utf-8") if isinstance(i, str) else bytes(i) for i in items]
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def to_bytes_object_array(array: np.ndarray) -> np.ndarray:
    """Return ``array`` as an object array of ``bytes`` with the same shape.

    Accepts numpy ``S``/``U``/``object`` arrays (a ``str`` becomes UTF-8 bytes).
    """
    if array.dtype == object and all(isinstance(x, bytes) for x in array.reshape(-1)):
        return array
    flat = bytes_array(
        x if isinstance(x, (bytes, str)) else str(x) for x in array.reshape(-1).tolist()
    )
    return flat.reshape(array.shape)
