""":class:`InferResponse` -> a KServe V2 REST inference response body (JSON, with
Triton's binary tensor data extension for outputs asked for as binary), and the V2 error
body: pure functions, no I/O (sources: see :mod:`~pdserve.frontends.http.decode`).

JSON outputs: ``NaN`` / ``Infinity`` / ``-Infinity`` are written as Triton writes them;
FP16 is written as numbers (shortest round-trip form); a BYTES element that is not valid
UTF-8 fails the request with 400 (ask for that output with ``binary_data: true``), where
Triton writes raw bytes no client can parse. An output the request asked for in shared
memory has name, datatype and shape but no data, as Triton.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import orjson

from pdserve.core.datatypes import (
    NUMPY_TO_V2,
    numpy_to_v2,
    serialize_bytes_tensor,
    to_bytes_object_array,
)
from pdserve.core.errors import InferError, internal
from pdserve.core.types import InferRequest, InferResponse
from pdserve.frontends.http.decode import FLOAT_TYPES, LE_DTYPE, Buffer
from pdserve.frontends.shared_memory import shm_output_names

__all__ = [
    "encode_error",
    "encode_infer_response",
    "encode_infer_response_parts",
    "json_output_names",
    "output_data_json",
]

_DUMPS_OPTS = orjson.OPT_SERIALIZE_NUMPY


def _binary_flags(request: InferRequest) -> tuple[bool, dict[str, bool] | None]:
    """``(default, per output)``: whether outputs are sent binary [BIN] — the request's
    ``binary_data_output`` parameter, and each requested output's ``binary_data``."""
    default_binary = request.parameters.get("binary_data_output") is True
    flags: dict[str, bool] | None = None
    if request.outputs:
        flags = {
            o.name: (default_binary if o.binary_data is None else o.binary_data)
            for o in request.outputs
        }
    return default_binary, flags


def json_output_names(response: InferResponse, request: InferRequest) -> list[str]:
    """The outputs of ``response`` that :func:`encode_infer_response_parts` writes as JSON
    ``data`` (not binary, not in shared memory), in output order."""
    default_binary, flags = _binary_flags(request)
    shm = shm_output_names(request)
    return [
        name
        for name in response.outputs
        if not (default_binary if flags is None else flags.get(name, default_binary))
        and (shm is None or name not in shm)
    ]


def _v2_datatype(arr: np.ndarray, name: str) -> str:
    datatype = NUMPY_TO_V2.get(arr.dtype)  # fast path: native dtypes, object -> BYTES
    if datatype is None:
        try:
            datatype = numpy_to_v2(arr.dtype)  # S/U strings, non-native byte order
        except InferError as exc:
            raise internal(f"output '{name}': {exc.message}") from None
    return datatype


def _json_data(arr: np.ndarray, datatype: str, name: str) -> Any:
    """What a JSON output's ``data`` is written from: a flat array, a list of strings or
    an ``orjson.Fragment`` (floats with NaN / inf, written as Triton writes them)."""
    if datatype == "BYTES":
        return _bytes_to_json(arr, name)
    if not (arr.flags.c_contiguous and arr.dtype.isnative):
        arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("="))
    data = arr.reshape(-1)
    if datatype in FLOAT_TYPES:
        # orjson would write NaN and +/-inf as null; Triton writes tokens.
        # One dot product (finite: no NaN / inf) spares the exact test.
        if datatype == "FP16" or not math.isfinite(data.dot(data)):
            if not np.isfinite(data).all():
                return orjson.Fragment(_float_json(data))
    return data


def output_data_json(arr: np.ndarray, name: str) -> bytes:
    """The JSON text of output ``name``'s ``data`` (``[1.5,2.0]``), exactly as
    :func:`encode_infer_response_parts` writes it; give it back to that function in
    ``encoded``. A module-level function, so that a large output can be encoded in a
    decode process (:func:`pdserve.frontends.offload.off_process`): the encoder holds
    the GIL for the whole array.

    Raises:
        InferError(INVALID_ARG) / InferError(INTERNAL): as
            :func:`encode_infer_response_parts` for this output.
    """
    if type(arr) is not np.ndarray:
        arr = np.asarray(arr)
    data = _json_data(arr, _v2_datatype(arr, name), name)
    return orjson.dumps(data, option=_DUMPS_OPTS)  # a Fragment is written as it is


def encode_infer_response_parts(
    response: InferResponse,
    request: InferRequest,
    encoded: Mapping[str, bytes] | None = None,
) -> tuple[list[Buffer], int | None, int]:
    """Encode a response as a list of buffers to send one after another.

    Args:
        response: the server's answer; ``outputs`` in the order to send them.
        request: the request it answers: its ``outputs`` (``binary_data`` per output)
            and ``parameters["binary_data_output"]`` decide which outputs are binary
            [BIN]; its ``id`` is echoed when the response has none.
        encoded: output name -> the JSON text of its ``data``, encoded beforehand by
            :func:`output_data_json` (off the event loop); used as is.

    Returns:
        ``(parts, header_length, total)``: ``parts[0]`` is the JSON header
        (``model_name``, ``model_version``, ``id`` if any, ``parameters`` if any,
        ``outputs`` [V2]; an output the request asked for in shared memory has no
        ``data`` and no ``binary_data_size``, as Triton); each further part is one binary output's bytes (a buffer,
        possibly a zero-copy view of the output array) in output order.
        ``header_length`` is ``len(parts[0])`` for the ``Inference-Header-Content-Length``
        response header, or ``None`` when no output is binary (``parts`` is then just
        the JSON). ``total`` is the byte size of all parts.

    Raises:
        InferError(INVALID_ARG): a BYTES output asked for as JSON holds bytes that are not
            valid UTF-8.
        InferError(INTERNAL): an output array has a dtype with no V2 datatype, or
            something in ``parameters`` cannot be written as JSON.
    """
    default_binary, flags = _binary_flags(request)
    shm = shm_output_names(request) if flags is not None else None
    outputs_json: list[dict[str, Any]] = []
    #: (index in outputs_json, array, datatype, name) of float outputs written unchecked
    raw_floats: list[tuple[int, np.ndarray, str, str]] | None = None
    blobs: list[Buffer] = []
    total = 0
    for name, arr in response.outputs.items():
        if type(arr) is not np.ndarray:
            arr = np.asarray(arr)
        binary = default_binary if flags is None else flags.get(name, default_binary)
        datatype = _v2_datatype(arr, name)
        if shm is not None and name in shm:  # written into shared memory: no data
            outputs_json.append({"name": name, "datatype": datatype, "shape": arr.shape})
            continue
        if binary:
            if datatype == "BYTES":
                blob: Buffer = serialize_bytes_tensor(arr)
                size = len(blob)
            else:
                le = LE_DTYPE[datatype]
                if arr.dtype != le or not arr.flags.c_contiguous:
                    arr = np.ascontiguousarray(arr, dtype=le)
                size = arr.nbytes
                blob = arr.reshape(-1).view(np.uint8).data
            total += size
            blobs.append(blob)
            outputs_json.append(
                {
                    "name": name,
                    "datatype": datatype,
                    "shape": arr.shape,
                    "parameters": {"binary_data_size": size},
                }
            )
        else:
            text = encoded.get(name) if encoded else None
            if text is not None:
                data: Any = orjson.Fragment(text)
            elif datatype in FLOAT_TYPES and arr.flags.c_contiguous and arr.dtype.isnative:
                # Written as it is; NaN / inf (written null by orjson) are looked for once
                # in the whole text below instead of testing each array first.
                data = arr.reshape(-1)
                if raw_floats is None:
                    raw_floats = []
                raw_floats.append((len(outputs_json), arr, datatype, name))
            else:
                data = _json_data(arr, datatype, name)
            outputs_json.append(
                {"name": name, "datatype": datatype, "shape": arr.shape, "data": data}
            )
    doc: dict[str, Any] = {
        "model_name": response.model_name,
        "model_version": response.model_version,
    }
    rid = response.id or request.id
    if rid:
        doc["id"] = rid
    if response.parameters:
        doc["parameters"] = response.parameters
    doc["outputs"] = outputs_json
    try:
        header = orjson.dumps(doc, option=_DUMPS_OPTS)
        if raw_floats is not None and b"null" in header:
            # A NaN or inf (or a null elsewhere in the document): write those outputs
            # as _json_data does (Triton's NaN / Infinity tokens) and encode again.
            for index, arr, datatype, name in raw_floats:
                outputs_json[index]["data"] = _json_data(arr, datatype, name)
            header = orjson.dumps(doc, option=_DUMPS_OPTS)
    except orjson.JSONEncodeError as exc:
        raise internal(f"could not write the response as JSON: {exc}") from None
    if not blobs:
        return [header], None, len(header)
    return [header, *blobs], len(header), len(header) + total


def _float_json(data: np.ndarray) -> bytes:
    """A 1-D float array as a JSON array with NaN / +/-inf written ``NaN`` /
    ``Infinity`` / ``-Infinity``, as Triton writes them (RapidJSON's
    ``kWriteNanAndInfFlag``). orjson's own text has ``null`` exactly there, in order."""
    pieces = orjson.dumps(data, option=_DUMPS_OPTS).split(b"null")
    tokens = [
        b"NaN" if v != v else (b"Infinity" if v > 0 else b"-Infinity")
        for v in data[~np.isfinite(data)].tolist()
    ]
    out = [pieces[0]]
    for token, piece in zip(tokens, pieces[1:], strict=True):
        out.append(token)
        out.append(piece)
    return b"".join(out)


def encode_infer_response(
    response: InferResponse, request: InferRequest
) -> tuple[bytes, int | None]:
    """Encode a response as one body.

    Returns:
        ``(body, header_length)``: the JSON header followed by the binary outputs'
        bytes in output order, and the JSON header's size for the
        ``Inference-Header-Content-Length`` response header (``None`` when no output is
        binary and the body is pure JSON) [BIN]. See :func:`encode_infer_response_parts`
        for which outputs are binary and the errors raised.
    """
    parts, header_length, _ = encode_infer_response_parts(response, request)
    if len(parts) == 1:
        return parts[0], header_length  # type: ignore[return-value]  # one part: the JSON header, bytes
    return b"".join(parts), header_length


def _bytes_to_json(arr: np.ndarray, name: str) -> list[str]:
    """BYTES output elements as JSON strings (strict UTF-8; see the module docstring)."""
    if arr.dtype.kind == "U":
        return arr.reshape(-1).tolist()
    if arr.dtype.kind == "S":
        arr = to_bytes_object_array(arr)
    out: list[str] = []
    for i, item in enumerate(arr.reshape(-1).tolist()):
        if type(item) is str:
            out.append(item)
        elif isinstance(item, (bytes, bytearray, memoryview)):
            try:
                out.append(bytes(item).decode("utf-8"))
            except UnicodeDecodeError:
                raise InferError(
                    f"output '{name}' element {i} is not valid UTF-8 and cannot be returned as "
                    "a JSON string; request this output with parameters.binary_data = true"
                ) from None
        else:
            out.append(str(item))
    return out


def encode_error(message: str) -> bytes:
    """The V2 error body ``{"error": message}`` [V2 "Inference Response JSON Object"]."""
    return orjson.dumps({"error": message})
