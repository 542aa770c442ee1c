"""KServe V2 REST inference request bodies (JSON, and Triton's binary tensor data
extension) -> :class:`InferRequest`: pure functions, no I/O.

Sources: [V2] the Open Inference Protocol, REST (kserve/open-inference-protocol,
``inference_rest.md``); [BIN] Triton's binary tensor data extension: binary inputs'
bytes follow the JSON header, whose size ``Inference-Header-Content-Length`` gives;
little-endian, row-major; a BYTES element is a uint32 length and its bytes.

Beyond the specs: binary fixed-size inputs are zero-copy **read-only** views into the
body; JSON data must be an array of the kind the datatype calls for, range-checked (400
where Triton wraps or makes inf); ``NaN`` / ``Infinity`` tokens are read as Triton
reads them; FP16 is accepted as JSON numbers (Triton refuses it); shared-memory inputs
go to ``InferRequest.shm_inputs`` (:mod:`pdserve.frontends.shared_memory`).
"""

from __future__ import annotations

import json
import re
import time
import warnings
from typing import Any, TypeAlias

import numpy as np
import orjson

from pdserve.core.datatypes import (
    V2_TO_NUMPY,
    deserialize_bytes_tensor,
    shape_element_count,
)
from pdserve.core.errors import InferError
from pdserve.core.types import InferRequest, RequestedOutput
from pdserve.frontends.parameters import check_request_parameters, check_scalar_parameters
from pdserve.frontends.shared_memory import ShmInput, shm_params

__all__ = ["decode_infer_request"]

#: V2 datatype -> little-endian numpy dtype ([BIN]: binary data is little-endian).
#: On little-endian hosts these equal the native dtypes, so views need no swap.
LE_DTYPE: dict[str, np.dtype] = {
    k: v.newbyteorder("<") for k, v in V2_TO_NUMPY.items() if k != "BYTES"
}

#: numpy ``dtype.kind`` values that JSON data may have for each datatype family.
_INT_TYPES = frozenset(["UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64"])
FLOAT_TYPES = frozenset(["FP16", "FP32", "FP64"])
_NARROW_FLOATS = frozenset(["FP16", "FP32"])
_KIND_WORDS = {
    "b": "true/false",
    "i": "integer",
    "u": "integer",
    "f": "floating-point",
    "U": "string",
    "O": "mixed, null or out-of-range",
}

_DUMPS_OPTS = orjson.OPT_SERIALIZE_NUMPY

#: JSON ``data`` whose nested lists promise more elements than the shape's count, and
#: more than this many, is rejected before it is converted element by element.
_EXCESS_CHECK = 4096

# The finiteness / range tests below are dot products, which overflow (harmlessly: the
# exact test follows) for huge values; numpy would warn each time.
warnings.filterwarnings(
    "ignore", "overflow encountered in dot", RuntimeWarning, re.escape(__name__) + "$"
)

#: FP32's largest finite value, squared (as a float64): JSON numbers whose squares sum
#: to less than this all fit FP32.
_FP32_MAX_SQUARED = float(np.finfo(np.float32).max) ** 2

#: What the encoder hands back to send: ``bytes`` or a zero-copy ``memoryview``.
Buffer: TypeAlias = bytes | memoryview


def decode_infer_request(
    body: bytes,
    header_length: int | None,
    model_name: str,
    model_version: str = "",
    arrival_ns: int | None = None,
    keep_json: bool = False,
) -> InferRequest:
    """Decode a V2 REST inference request body into an :class:`InferRequest`.

    Args:
        body: the whole (decompressed) HTTP request body.
        header_length: the ``Inference-Header-Content-Length`` HTTP header as an int:
            the size in bytes of the JSON header at the start of ``body``; the rest of
            the body is the inputs' binary data [BIN]. ``None`` when the header is
            absent: the whole body is JSON.
        model_name / model_version: from the URL path (a ``model_name`` inside the
            JSON is ignored, as Triton does); ``""`` lets the version policy pick.
        arrival_ns: ``time.monotonic_ns()`` when the request arrived; now if ``None``.
        keep_json: set ``json_body`` to ``body`` when it is a plain JSON request whose
            ``inputs`` hold all their data, no BYTES (JSON text, base64 in the log) and
            no ``NaN`` / ``Infinity`` tokens (not JSON),
            with no ``model_name`` / ``model_version`` of its own and no empty ``id``
            (the payload log writes it as it is).

    Returns:
        An :class:`InferRequest`. ``inputs`` maps name -> array of ``shape``:
        fixed-size datatypes as numpy arrays (binary ones zero-copy read-only views
        into ``body``), BYTES as object arrays of ``bytes``. ``outputs`` is ``None``
        when the request names none [V2]. ``parameters`` is the request's
        ``parameters`` object unchanged (``binary_data_output``, ``priority``,
        ``timeout``...). ``cancelled`` is left ``None`` for the caller to set.

    Raises:
        InferError(INVALID_ARG): malformed JSON; a header length outside ``[0, len(body)]``;
            a field of the wrong type (``id`` not a string, ``data`` not an array, a
            ``parameters`` value that is not a string, number or boolean, a reserved
            request parameter of the wrong type: see :mod:`pdserve.frontends.parameters`);
            an unknown datatype; a negative or non-integer
            shape, or one of more than 64 dimensions or 2**59 elements or more;
            ``data`` whose element count differs from the shape's, or whose values do
            not fit the datatype (integers out of range, finite numbers past FP32 /
            FP16's range); binary sizes that disagree with the datatype and
            shape or with the bytes the body holds (the message names the input);
            truncated BYTES, or more BYTES elements than the shape calls for.
    """
    if arrival_ns is None:
        arrival_ns = time.monotonic_ns()
    body_len = len(body)
    doc, offset, strict = _request_json(body, header_length)
    request_id = doc.get("id", "")
    if type(request_id) is not str:
        raise InferError("request 'id' must be a string")
    parameters = doc.get("parameters")
    if parameters is None:
        parameters = {}
    elif type(parameters) is not dict:
        raise InferError("request 'parameters' must be a JSON object")
    elif parameters:
        check_request_parameters(parameters)

    inputs_json = doc.get("inputs")
    if type(inputs_json) is not list:
        raise InferError("the inference request must have an 'inputs' list")
    inputs: dict[str, np.ndarray] = {}
    mv: memoryview | None = None
    last_binary: str | None = None
    shm_inputs: dict[str, ShmInput] | None = None
    plain = keep_json and strict  # no BYTES input yet, no NaN token
    for item in inputs_json:
        if type(item) is not dict:
            raise InferError("each entry of 'inputs' must be a JSON object")
        name = item.get("name")
        if type(name) is not str:
            raise InferError("each input must have a string 'name'")
        if name in inputs:
            raise InferError(f"input '{name}' is given more than once")
        datatype = item.get("datatype")
        if type(datatype) is not str:
            raise InferError(f"input '{name}' must have a string 'datatype'")
        shape, count = _parse_shape(item.get("shape"), name)
        params = item.get("parameters")
        if params is not None:
            if type(params) is not dict:
                raise InferError(f"input '{name}' 'parameters' must be a JSON object")
            if params:
                check_scalar_parameters(params, f"input '{name}'")
        if params and "binary_data_size" in params:
            if mv is None:
                mv = memoryview(body)
            end = _binary_end(item, params, name, offset, body_len, header_length)
            inputs[name] = _binary_to_array(mv[offset:end], datatype, shape, count, name)
            offset = end
            last_binary = name
        elif params and "shared_memory_region" in params:
            if shm_inputs is None:
                shm_inputs = {}
            shm_inputs[name] = _shm_input(item, params, name, datatype, shape, count)
            inputs[name] = _SHM_PLACEHOLDER
        else:
            inputs[name] = _json_input(item, name, datatype, shape, count)
            if datatype == "BYTES":
                plain = False
    if offset != body_len:
        raise InferError(
            _binary_excess_message(inputs_json, body_len, offset, header_length, last_binary)
        )
    outputs_json = doc.get("outputs")
    outputs = None if outputs_json is None else _requested_outputs(outputs_json)

    # positional, in InferRequest's field order (model_name, model_version, inputs,
    # outputs, id, parameters, arrival_ns): cheaper than the keyword form
    request = InferRequest(
        model_name, model_version, inputs, outputs, request_id, parameters, arrival_ns
    )
    if shm_inputs is not None:
        request.shm_inputs = shm_inputs
    elif plain and header_length is None and _plain_json(doc, request_id):
        request.json_body = body
    return request


def _requested_outputs(outputs_json: Any) -> list[RequestedOutput]:
    """The request's ``outputs`` list (InferError: not a list, or a bad entry)."""
    if type(outputs_json) is not list:
        raise InferError("request 'outputs' must be a list")
    return [_parse_requested_output(o) for o in outputs_json]


def _plain_json(doc: dict[str, Any], request_id: str) -> bool:
    """Whether a request document can stand for its own record in the payload log: it
    names no model (the URL's would be written beside it) and has an id unless it
    has no ``id`` key at all (the log then writes the one it makes up)."""
    return (
        "model_name" not in doc
        and "model_version" not in doc
        and (request_id != "" or "id" not in doc)
    )


def _request_json(body: bytes, header_length: int | None) -> tuple[dict[str, Any], int, bool]:
    """The request's JSON object, where its binary data begins, and whether the JSON
    was strict (False: it held ``NaN`` / ``Infinity`` tokens, read leniently)."""
    body_len = len(body)
    if header_length is None:
        header: Buffer = body
        offset = body_len
    else:
        if header_length < 0 or header_length > body_len:
            raise InferError(  # Triton's words (http_server.cc GetInferenceHeaderLength)
                f"inference header size should be in range (0, {body_len}), got: {header_length}"
            )
        header = memoryview(body)[:header_length] if header_length != body_len else body
        offset = header_length
    strict = True
    try:
        doc = orjson.loads(header)
    except orjson.JSONDecodeError as exc:
        doc = _loads_lenient(header, exc, header_length is None and b"binary_data_size" in body)
        strict = False
    if type(doc) is not dict:
        raise InferError("the inference request must be a JSON object")
    return doc, offset, strict


def _binary_end(
    item: dict[str, Any],
    params: dict[str, Any],
    name: str,
    offset: int,
    body_len: int,
    header_length: int | None,
) -> int:
    """Where a binary input's bytes, from ``offset``, end in the body [BIN]."""
    size = params["binary_data_size"]
    if type(size) is not int or size < 0:
        raise InferError(
            f"input '{name}' parameter 'binary_data_size' must be a non-negative integer"
        )
    if item.get("data") is not None:
        raise InferError(f"input '{name}' has both 'data' and 'binary_data_size'; send one of them")
    end = offset + size
    if end > body_len:
        raise InferError(_binary_overrun_message(name, size, body_len - offset, header_length))
    return end


def _shm_input(
    item: dict[str, Any],
    params: dict[str, Any],
    name: str,
    datatype: str,
    shape: list[int],
    count: int,
) -> ShmInput:
    """An input in a shared-memory region (read by the frontend)."""
    if item.get("data") is not None:
        raise InferError(
            f"input '{name}' has both 'data' and 'shared_memory_region'; send one of them"
        )
    if datatype not in LE_DTYPE and datatype != "BYTES":
        raise InferError(_unknown_datatype(datatype, name))
    region, size, shm_offset = shm_params(params, f"input '{name}'")
    return ShmInput(datatype, shape, count, region, size, shm_offset)


def _json_input(
    item: dict[str, Any], name: str, datatype: str, shape: list[int], count: int
) -> np.ndarray:
    """An input sent as JSON ``data``."""
    data = item.get("data")
    if type(data) is not list:
        if data is None:
            raise InferError(f"input '{name}' has neither 'data' nor 'binary_data_size'")
        raise InferError(
            f"input '{name}' 'data' must be a JSON array (flat or nested, row-major), "
            f"not {_json_kind(data)}"
        )
    return _json_to_array(data, datatype, shape, count, name)


#: What ``inputs`` holds for a shared-memory input until the frontend reads it (keeps
#: the inputs' order; the frontend replaces it).
_SHM_PLACEHOLDER = np.empty(0, dtype=np.uint8)


#: The non-finite number tokens Triton reads and writes (RapidJSON's
#: ``kParseNanAndInfFlag`` / ``kWriteNanAndInfFlag``) and Python's ``json`` writes.
_NONFINITE_TOKENS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}
_NONFINITE_RE = re.compile(rb"NaN|Infinity")
#: A ``\uD800``-``\uDFFF`` escape: orjson refuses a lone surrogate, Python's json
#: does not (a valid pair is one character in both).
_SURROGATE_RE = re.compile(rb"\\u[dD][89a-fA-F]")
_U64_LIMIT = 1 << 64


def _parse_int(text: str) -> int | float:
    """Integers as orjson reads them: past 64 bits they become floats."""
    value = int(text)
    if -_U64_LIMIT < value < _U64_LIMIT:
        return value
    return float(value)


def _parse_float(text: str) -> float:
    """Numbers as orjson reads them: one that overflows a double is an error."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:40]} is out of range for a double")
    return value


def _loads_lenient(header: Buffer, exc: orjson.JSONDecodeError, binary_hint: bool) -> Any:
    """Parse a request JSON that orjson refused, if it failed only for ``NaN`` /
    ``Infinity`` / ``-Infinity`` tokens (which Triton and ``tritonclient`` accept in
    tensor data); otherwise answer 400 with orjson's message.

    This is the slow path, taken only for such bodies. It reads them with Python's
    ``json`` made as strict as orjson: UTF-8 only, integers past 64 bits as floats,
    numbers that overflow a double and lone surrogates refused.

    Raises:
        InferError(INVALID_ARG): the JSON is malformed (``binary_hint``: mention the
            ``Inference-Header-Content-Length`` header, since the body seems to carry
            binary data).
    """
    raw = bytes(header)
    if _NONFINITE_RE.search(raw) is not None:
        try:
            doc = json.loads(
                raw.decode("utf-8"),
                parse_constant=_NONFINITE_TOKENS.__getitem__,
                parse_float=_parse_float,
                parse_int=_parse_int,
            )
            if _SURROGATE_RE.search(raw) is not None:
                orjson.dumps(doc)  # refuses strings holding a lone surrogate
            return doc
        except (ValueError, RecursionError, orjson.JSONEncodeError):
            pass  # report orjson's message, which points at the first problem
    hint = ""
    if binary_hint:
        hint = " (a body with binary tensor data needs the Inference-Header-Content-Length header)"
    raise InferError(f"failed to parse the request JSON: {exc}{hint}") from None


def _parse_shape(shape: Any, name: str) -> tuple[list[int], int]:
    """Check a ``shape`` list ([V2]: array of int64, here non-negative); return it and
    its element count (1 for ``[]``)."""
    if type(shape) is not list:
        raise InferError(f"input '{name}' must have a 'shape' list of integers")
    return shape, shape_element_count(shape, name)


def _binary_overrun_message(name: str, size: int, remaining: int, header_length: int | None) -> str:
    """Input ``name`` declares more binary data than the body holds after the inputs
    before it [BIN]."""
    if header_length is None:
        return (
            f"input '{name}' has binary_data_size {size} but the request has no "
            "Inference-Header-Content-Length header, so the body holds no binary data"
        )
    return (
        f"input '{name}' has binary_data_size {size} but only {remaining} bytes of binary "
        "data are left in the body after the inputs before it"
    )


def _binary_excess_message(
    inputs_json: list[Any],
    body_len: int,
    offset: int,
    header_length: int | None,
    last_binary: str | None,
) -> str:
    """The body holds bytes that no input's ``binary_data_size`` accounts for [BIN]."""
    extra = body_len - offset
    held = body_len - (header_length or 0)
    if last_binary is None:
        return (
            f"the request body holds {held} bytes of binary data after the JSON header but "
            "no input has a binary_data_size parameter"
        )
    declared = 0
    for item in inputs_json:
        params = item.get("parameters")
        if type(params) is dict and type(params.get("binary_data_size")) is int:
            declared += params["binary_data_size"]
    return (
        f"the inputs' binary_data_size add up to {declared} bytes but the body holds {held} "
        f"bytes of binary data after the JSON header: {extra} bytes follow the last binary "
        f"input, '{last_binary}'"
    )


def _binary_to_array(
    buf: memoryview, datatype: str, shape: list[int], count: int, name: str
) -> np.ndarray:
    """Turn one input's binary data [BIN] into an array of ``shape``.

    Fixed-size types: a zero-copy read-only view; ``len(buf)`` must be
    ``count * itemsize``. BYTES: length-prefixed elements, exactly ``count`` of them.
    """
    dtype = LE_DTYPE.get(datatype)
    if dtype is None:
        if datatype == "BYTES":
            try:
                return deserialize_bytes_tensor(buf, count).reshape(shape)
            except InferError as exc:
                raise InferError(f"input '{name}': {exc.message}") from None
        raise InferError(_unknown_datatype(datatype, name))
    expected = count * dtype.itemsize
    if len(buf) != expected:
        raise InferError(
            f"input '{name}' ({datatype}, shape {shape}) needs {expected} bytes of binary data "
            f"but its binary_data_size is {len(buf)}"
        )
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def _json_to_array(data: Any, datatype: str, shape: list[int], count: int, name: str) -> np.ndarray:
    """Turn one input's JSON ``data`` (flat or nested, row-major [V2]) into an array."""
    dtype = V2_TO_NUMPY.get(datatype)
    if dtype is None:
        raise InferError(_unknown_datatype(datatype, name))
    # The lengths along the first path of nested lists give the element count of a
    # rectangular array: reject a large excess before numpy or the BYTES loop walks it
    # all (small ones take the normal path and its exact messages).
    leading = 1
    item = data
    while type(item) is list:
        leading *= len(item)
        if not item:
            break
        item = item[0]
    if leading > count and leading > _EXCESS_CHECK:
        raise InferError(
            f"input '{name}' has at least {leading} elements in 'data' (or 'data' is not a "
            f"regular array) but its shape {shape} calls for {count}"
        )
    if datatype == "BYTES":
        flat: list[bytes] = []
        _flatten_strings(data, flat, name)
        if len(flat) != count:
            raise InferError(_count_message(name, len(flat), shape, count))
        out = np.empty(count, dtype=object)
        out[:] = flat
        return out.reshape(shape)
    try:
        arr = np.asarray(data)
    except (ValueError, TypeError, OverflowError) as exc:
        raise InferError(
            f"input '{name}' 'data' is not a regular (rectangular) array: {exc}"
        ) from None
    if arr.size != count:
        raise InferError(_count_message(name, arr.size, shape, count))
    if count:
        kind = arr.dtype.kind
        if datatype in FLOAT_TYPES:
            ok = kind in "iuf"
            wanted = "numbers"
        elif datatype in _INT_TYPES:
            if kind in "fO":
                # Mixed int64 / uint64-only values (e.g. 0 and 2**64-1) infer as float64
                # or object: check them as Python ints instead.
                return _exact_integers(data, dtype, datatype, name).reshape(shape)
            ok = kind in "iu"
            wanted = "integers"
        else:  # BOOL
            ok = kind == "b"
            wanted = "true/false values"
        if not ok:
            found = _KIND_WORDS.get(kind, str(arr.dtype))
            raise InferError(
                f"input '{name}' has datatype {datatype} but its 'data' holds {found} values; "
                f"expected {wanted}"
            )
        if kind in "iu" and arr.dtype != dtype and datatype in _INT_TYPES:
            info = np.iinfo(dtype)
            lo, hi = arr.min(), arr.max()
            if lo < info.min or hi > info.max:
                bad = lo if lo < info.min else hi
                raise InferError(
                    f"input '{name}' value {bad} is out of range for {datatype} "
                    f"[{info.min}, {info.max}]"
                )
        if datatype in _NARROW_FLOATS:  # (JSON numbers arrive as 8-byte numpy values)
            # Narrowing to FP32 / FP16: a finite number past the type's range would
            # become +/-inf. For FP32 from JSON numbers, one dot product clears every
            # value at once (a sum of squares under FP32's max squared means no value
            # is out of range; NaN / inf anywhere fails the test and takes the exact
            # check). Integers always fit FP32; FP16 always takes the exact check.
            vec = arr if arr.ndim == 1 else arr.reshape(-1)
            if datatype == "FP32" and (kind != "f" or vec.dot(vec) < _FP32_MAX_SQUARED):
                return vec.astype(dtype).reshape(shape)
            return _narrow_checked(vec, dtype, datatype, name).reshape(shape)
    return arr.astype(dtype, copy=False).reshape(shape)


def _narrow_checked(flat: np.ndarray, dtype: np.dtype, datatype: str, name: str) -> np.ndarray:
    """``flat`` cast to FP32 / FP16, refusing a finite JSON number that would become
    +/-inf. Non-finite values sent as ``NaN`` / ``Infinity`` tokens stay as sent."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = flat.astype(dtype)
        bad = ~np.isfinite(out) & np.isfinite(flat)
    if bad.any():
        value = flat[int(np.argmax(bad))]
        limit = np.finfo(dtype).max
        raise InferError(
            f"input '{name}' value {value} is out of range for {datatype} "
            f"(finite values lie within +/-{limit!s}); send Infinity or -Infinity for an "
            "infinite value"
        )
    return out


def _json_kind(value: Any) -> str:
    """The JSON type of a decoded value, for messages."""
    if value is None:
        return "null"
    if type(value) is bool:
        return "a boolean"
    if type(value) in (int, float):
        return "a number"
    if type(value) is str:
        return "a string"
    if type(value) is dict:
        return "an object"
    return "an array"


def _exact_integers(data: Any, dtype: np.dtype, datatype: str, name: str) -> np.ndarray:
    """Convert JSON data that numpy did not infer as integers: every element must be a
    JSON integer within ``datatype``'s range (slow path, only for such data)."""
    flat = np.array(data, dtype=object).reshape(-1).tolist()
    info = np.iinfo(dtype)
    for value in flat:
        if type(value) is not int:
            found = "null" if value is None else type(value).__name__
            raise InferError(
                f"input '{name}' has datatype {datatype} but its 'data' holds {found} values; "
                "expected integers"
            )
        if value < info.min or value > info.max:
            raise InferError(
                f"input '{name}' value {value} is out of range for {datatype} "
                f"[{info.min}, {info.max}]"
            )
    return np.array(flat, dtype=dtype)


def _flatten_strings(data: Any, out: list[bytes], name: str) -> None:
    """Append the strings of a (nested) JSON list to ``out`` as UTF-8 ``bytes``."""
    if type(data) is str:
        out.append(data.encode("utf-8"))
        return
    if type(data) is not list:
        raise InferError(
            f"input '{name}' has datatype BYTES but its 'data' holds {type(data).__name__} "
            "values; expected strings"
        )
    for item in data:
        if type(item) is str:
            out.append(item.encode("utf-8"))
        else:
            _flatten_strings(item, out, name)


def _count_message(name: str, got: int, shape: list[int], count: int) -> str:
    return f"input '{name}' has {got} elements in 'data' but its shape {shape} calls for {count}"


def _unknown_datatype(datatype: str, name: str) -> str:
    return (
        f"input '{name}' has unsupported datatype '{datatype}'; expected one of "
        f"{', '.join(V2_TO_NUMPY)}"
    )


def _parse_requested_output(item: Any) -> RequestedOutput:
    """One entry of the request's ``outputs`` [V2] with its [BIN] / classification
    parameters pulled out; unknown names pass through for the server to check."""
    if type(item) is not dict:
        raise InferError("each entry of 'outputs' must be a JSON object")
    name = item.get("name")
    if type(name) is not str:
        raise InferError("each requested output must have a string 'name'")
    params = item.get("parameters")
    if params is None:
        return RequestedOutput(name)
    if type(params) is not dict:
        raise InferError(f"output '{name}' 'parameters' must be a JSON object")
    check_scalar_parameters(params, f"output '{name}'")
    binary = params.get("binary_data")
    if binary is not None and type(binary) is not bool:
        raise InferError(f"output '{name}' parameter 'binary_data' must be true or false")
    classification = params.get("classification", 0)
    if type(classification) is not int or classification < 0:
        raise InferError(
            f"output '{name}' parameter 'classification' must be a non-negative integer"
        )
    known = (binary is not None) + ("classification" in params)
    rest = (
        {k: v for k, v in params.items() if k != "binary_data" and k != "classification"}
        if len(params) > known
        else {}
    )
    if "shared_memory_region" in rest:
        shm_params(rest, f"output '{name}'")  # checks the types
    return RequestedOutput(name, binary, classification, rest)
