"""V2 gRPC codec: ``ModelInferRequest`` <-> InferRequest, InferResponse -> ``ModelInferResponse``.

Tensor data as Triton's gRPC frontend accepts and sends it: inputs come either all in
``raw_input_contents`` (one little-endian, row-major buffer per input, in input order; a
BYTES element is a uint32 little-endian length and its bytes; fixed-size ones become
zero-copy read-only ``np.frombuffer`` views) or each in its typed ``contents`` (FP16 has
no typed field and must be raw). Outputs are always sent in ``raw_output_contents``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
from tritonclient.grpc import service_pb2

from pdserve.core.datatypes import GRPC_CONTENTS_FIELD as _CONTENTS_FIELD
from pdserve.core.datatypes import V2_LE_DTYPE as _LE_DTYPE
from pdserve.core.datatypes import (
    V2_TO_NUMPY,
    array_from_raw,
    numpy_to_v2,
    raw_tensor,
    shape_element_count,
)
from pdserve.core.errors import InferError, internal
from pdserve.core.types import InferRequest, InferResponse, RequestedOutput
from pdserve.frontends.offload import codec_pool
from pdserve.frontends.parameters import check_request_parameters, check_scalar_parameters
from pdserve.frontends.shared_memory import ShmInput, shm_params

log = logging.getLogger("pdserve.grpc")

#: Default limit on a gRPC message, sent or received: 64 MiB, like the HTTP body limit.
#: A 32x3x224x224 FP32 batch is 19 MB. ``--grpc-max-message-bytes`` raises it (Triton
#: uses 2 GiB - 1).
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


#: The one ``triton_`` request parameter Triton's gRPC frontend accepts (tritonclient's
#: ``enable_empty_final_response``; perf_analyzer sets it on every gRPC request). The
#: frontend consumes it: it is checked (a ``bool_param``) and read by the stream
#: handler (:func:`empty_final_requested`), and not passed on in
#: ``InferRequest.parameters`` (Triton: "the reserved parameters are not accessible in
#: the Triton C-API", so its backends never see it).
EMPTY_FINAL_PARAM = "triton_enable_empty_final_response"

#: The Python value of an ``InferParameter`` oneof (bytes: ``ModelRepositoryParameter``).
ParamValue = bool | int | float | str | bytes | None


def empty_final_requested(msg: service_pb2.ModelInferRequest) -> bool:
    """Whether a request asks for Triton's empty final responses (its
    ``triton_enable_empty_final_response`` is ``bool_param: true``)."""
    pmap = msg.parameters
    return EMPTY_FINAL_PARAM in pmap and pmap[EMPTY_FINAL_PARAM].bool_param is True


def _request_parameters(
    pmap: Mapping[str, service_pb2.InferParameter],
) -> dict[str, ParamValue]:
    """A request's checked ``parameters`` less :data:`EMPTY_FINAL_PARAM` (consumed by
    the frontend). A map holding only that key as a ``bool_param`` (perf_analyzer's
    every request) is read without building a dict to check.

    Raises:
        InferError(INVALID_ARG): as :func:`check_request_parameters`.
    """
    if (
        len(pmap) == 1
        and EMPTY_FINAL_PARAM in pmap
        and pmap[EMPTY_FINAL_PARAM].WhichOneof("parameter_choice") == "bool_param"
    ):
        return {}
    parameters = _params(pmap)
    check_request_parameters(parameters, grpc=True)
    parameters.pop(EMPTY_FINAL_PARAM, None)
    return parameters


def param_value(
    p: service_pb2.InferParameter | service_pb2.ModelRepositoryParameter,
) -> ParamValue:
    """The Python value of an ``InferParameter`` / ``ModelRepositoryParameter``."""
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def _params(pmap: Mapping[str, service_pb2.InferParameter]) -> dict[str, ParamValue]:
    """A protobuf ``map<string, InferParameter>`` as a dict of Python values. Keys are
    iterated and looked up: the upb map's ``items()`` goes through
    ``collections.abc.Mapping``'s slower ``ItemsView``."""
    return {k: param_value(pmap[k]) for k in pmap}


def set_param(
    p: service_pb2.InferParameter | service_pb2.LogSettingsResponse.SettingValue,
    value: object,
    int_field: str = "int64_param",
) -> None:
    """Store a Python value in an ``InferParameter`` (or a message of the same oneof
    shape: ``LogSettingsResponse.SettingValue`` with ``int_field="uint32_param"``)."""
    if isinstance(value, bool):
        p.bool_param = value
    elif isinstance(value, int):
        setattr(p, int_field, value)
    elif isinstance(value, float):
        p.double_param = value
    else:
        p.string_param = str(value)


#: Typed contents fields wider than their datatype: values are range-checked.
_NARROW_INTS: dict[str, tuple[np.dtype, int, int]] = {
    dt: (np.dtype(np.int32 if dt[0] == "I" else np.uint32), int(info.min), int(info.max))
    for dt, info in (
        ("INT8", np.iinfo(np.int8)),
        ("INT16", np.iinfo(np.int16)),
        ("UINT8", np.iinfo(np.uint8)),
        ("UINT16", np.iinfo(np.uint16)),
    )
}


def _typed_contents_array(values: Sequence[float], datatype: str, name: str) -> np.ndarray:
    """A fixed-size input's typed ``contents`` as a 1-D array, range-checked for the
    datatypes narrower than their field (INT8/INT16 in ``int_contents``, UINT8/UINT16
    in ``uint_contents``)."""
    narrow = _NARROW_INTS.get(datatype)
    if narrow is None:
        return np.array(values, dtype=V2_TO_NUMPY[datatype])
    wide, lo, hi = narrow
    arr = np.array(values, dtype=wide)
    if arr.size:
        low, high = int(arr.min()), int(arr.max())
        if low < lo or high > hi:
            bad = low if low < lo else high
            raise InferError(
                f"input '{name}' value {bad} is out of range for {datatype} [{lo}, {hi}]"
            )
    return arr.astype(V2_TO_NUMPY[datatype])


def _any_shm(inputs_msg: Iterable[service_pb2.ModelInferRequest.InferInputTensor]) -> bool:
    """Whether any input names a shared-memory region."""
    return any("shared_memory_region" in t.parameters for t in inputs_msg)


def _shm_input(
    tensor: service_pb2.ModelInferRequest.InferInputTensor,
    tparams: Mapping[str, object],
    shape: list[int],
    count: int,
) -> ShmInput:
    """An input that names a shared-memory region (its checked parameters ``tparams``)."""
    name, datatype = tensor.name, tensor.datatype
    if tensor.HasField("contents"):
        raise InferError(
            f"input '{name}' has both contents and 'shared_memory_region'; send one of them"
        )
    if datatype not in _LE_DTYPE and datatype != "BYTES":
        raise InferError(f"input '{name}' has unknown datatype '{datatype}'")
    region, size, offset = shm_params(tparams, f"input '{name}'")
    return ShmInput(datatype, shape, count, region, size, offset)


def _contents_array(
    tensor: service_pb2.ModelInferRequest.InferInputTensor, shape: list[int], count: int
) -> np.ndarray:
    """An input sent as typed ``contents`` (not ``raw_input_contents``), shaped."""
    name, datatype = tensor.name, tensor.datatype
    field = _CONTENTS_FIELD.get(datatype)
    if field is None:
        if datatype in _LE_DTYPE:
            raise InferError(
                f"input '{name}' of datatype {datatype} must be sent in "
                "raw_input_contents (it has no typed contents field)"
            )
        raise InferError(f"input '{name}' has unknown datatype '{datatype}'")
    values = getattr(tensor.contents, field)
    if len(values) != count:
        raise InferError(
            f"unexpected number of elements {len(values)} in the contents of input "
            f"'{name}', expecting {count} for shape {shape}"
        )
    if datatype == "BYTES":
        arr = np.empty(count, dtype=object)
        arr[:] = list(values)
        return arr.reshape(shape)
    return _typed_contents_array(values, datatype, name).reshape(shape)


def _requested_output(
    out: service_pb2.ModelInferRequest.InferRequestedOutputTensor,
) -> RequestedOutput:
    """A requested output that has parameters (checked)."""
    params = _params(out.parameters)
    check_scalar_parameters(params, f"output '{out.name}'")
    if "shared_memory_region" in params:
        shm_params(params, f"output '{out.name}'")  # checks the types
    cls = params.pop("classification", 0)
    if type(cls) is not int or cls < 0:
        raise InferError(
            f"output '{out.name}' parameter 'classification' must be an int64_param "
            f">= 0 or a uint64_param, got {cls!r}"
        )
    binary = params.pop("binary_data", None)
    if binary is not None and type(binary) is not bool:
        raise InferError(f"output '{out.name}' parameter 'binary_data' must be a bool_param")
    return RequestedOutput(out.name, None, cls, params)


def decode_infer_request(msg: service_pb2.ModelInferRequest, arrival_ns: int) -> InferRequest:
    """Turn a ``ModelInferRequest`` into an :class:`InferRequest`.

    Raises:
        InferError(INVALID_ARG): unknown datatype, data whose size disagrees with the shape,
            a shape of more than 64 dimensions or 2**59 elements or more, typed
            contents out of range for the datatype (INT8/INT16/UINT8/UINT16),
            raw and typed contents mixed, a raw-contents count that is not the input
            count, FP16 sent as typed contents, bad ``shared_memory_*`` parameters (a
            shared-memory input is recorded in ``InferRequest.shm_inputs`` for the
            frontend to read); an
            ``InferParameter`` with no value set; a reserved request parameter of the
            wrong type (``priority``, ``timeout``, ``sequence_*``; keys starting with
            ``triton_``; see :mod:`pdserve.frontends.parameters`); an output's
            ``classification`` that is not an integer >= 0 or ``binary_data`` that is
            not a bool. Each message names the input, output or parameter.
    """
    raw = msg.raw_input_contents
    n_raw = len(raw)
    inputs_msg = msg.inputs
    if n_raw and n_raw != len(inputs_msg) and not _any_shm(inputs_msg):
        raise InferError(
            f"expected {len(inputs_msg)} raw input contents (one per input), got {n_raw}"
        )
    ri = 0  # the next raw_input_contents entry (inputs in shared memory have none)
    inputs: dict[str, np.ndarray] = {}
    shm_inputs: dict[str, ShmInput] | None = None
    for tensor in inputs_msg:
        name = tensor.name
        datatype = tensor.datatype
        shape = tensor.shape[:]  # a list (upb: faster than list(...))
        count = shape_element_count(shape, name)
        if tensor.parameters:
            tparams = _params(tensor.parameters)
            check_scalar_parameters(tparams, f"input '{name}'")
            if "shared_memory_region" in tparams:
                if name in inputs:
                    raise InferError(f"input '{name}' is given more than once")
                if shm_inputs is None:
                    shm_inputs = {}
                shm_inputs[name] = _shm_input(tensor, tparams, shape, count)
                inputs[name] = _SHM_PLACEHOLDER
                continue
        if name in inputs:
            raise InferError(f"input '{name}' is given more than once")
        if n_raw:
            if tensor.HasField("contents"):
                raise InferError(
                    f"contents field must not be specified when using raw_input_contents "
                    f"for '{name}'"
                )
            if ri >= n_raw:
                raise InferError(
                    f"expected one raw input contents per input not in shared memory, got {n_raw}"
                )
            arr = array_from_raw(raw[ri], datatype, shape, count, f"input '{name}'")
            ri += 1
        else:
            arr = _contents_array(tensor, shape, count)
        inputs[name] = arr
    if ri != n_raw:
        raise InferError(
            f"expected {ri} raw input contents (one per input not in shared memory), got {n_raw}"
        )
    outputs: list[RequestedOutput] | None = None
    if msg.outputs:
        outputs = []
        for out in msg.outputs:
            outputs.append(_requested_output(out) if out.parameters else RequestedOutput(out.name))
    parameters: dict[str, ParamValue] = {}
    if msg.parameters:
        parameters = _request_parameters(msg.parameters)
    request = InferRequest(
        model_name=msg.model_name,
        model_version=msg.model_version,
        inputs=inputs,
        outputs=outputs,
        id=msg.id,
        parameters=parameters,
        arrival_ns=arrival_ns,
    )
    if shm_inputs is not None:
        request.shm_inputs = shm_inputs
    return request


#: What ``inputs`` holds for a shared-memory input until the frontend reads it.
_SHM_PLACEHOLDER = np.empty(0, dtype=np.uint8)


def encode_infer_response(
    response: InferResponse, shm_outputs: frozenset[str] | None = None
) -> service_pb2.ModelInferResponse:
    """Turn an :class:`InferResponse` into a ``ModelInferResponse`` with raw outputs.

    ``shm_outputs``: outputs written into shared memory: listed with datatype and
    shape, and an empty ``raw_output_contents`` entry (as Triton, so that the entries
    stay one per output)."""
    msg = service_pb2.ModelInferResponse(
        model_name=response.model_name, model_version=response.model_version, id=response.id
    )
    raw = msg.raw_output_contents
    for name, arr in response.outputs.items():
        out = msg.outputs.add()
        out.name = name
        out.shape.extend(arr.shape)
        if shm_outputs is not None and name in shm_outputs:
            try:
                out.datatype = "BYTES" if arr.dtype.kind in "OSU" else numpy_to_v2(arr.dtype)
            except InferError as e:
                raise internal(f"output '{name}': {e.message}") from None
            raw.append(b"")
            continue
        try:
            out.datatype, data = raw_tensor(arr)
        except InferError as e:
            raise internal(f"output '{name}': {e.message}") from None
        raw.append(data)
    for k, v in response.parameters.items():
        set_param(msg.parameters[k], v)
    return msg


#: Requests whose tensor payload is over this many bytes are decoded, and responses
#: whose outputs are over it encoded, on a worker thread: parsing millions of BYTES
#: elements would otherwise stall every other call on the event loop. Smaller ones
#: stay on the loop (a thread hop costs more than they take).
OFFLOAD_BYTES = 1 << 20


def _payload_bytes(msg: service_pb2.ModelInferRequest) -> int:
    """About how many bytes of tensor data ``msg`` carries (cheap: no element walk)."""
    total = 0
    for raw in msg.raw_input_contents:
        total += len(raw)
    if total:
        return total
    for tensor in msg.inputs:
        field = _CONTENTS_FIELD.get(tensor.datatype)
        if field is not None and tensor.HasField("contents"):
            total += 8 * len(getattr(tensor.contents, field))
    return total


def decode_inline(msg: service_pb2.ModelInferRequest, arrival_ns: int) -> InferRequest | None:
    """:func:`decode_infer_request` of a request whose payload is small enough for the
    event loop (:data:`OFFLOAD_BYTES`); None for a larger one (:func:`decode_off_loop`
    decodes it on a worker thread). No coroutine: the common small request costs one
    coroutine level fewer."""
    if _payload_bytes(msg) <= OFFLOAD_BYTES:
        return decode_infer_request(msg, arrival_ns)
    return None


async def decode_off_loop(msg: service_pb2.ModelInferRequest, arrival_ns: int) -> InferRequest:
    """:func:`decode_infer_request`, on a worker thread when the payload is large."""
    request = decode_inline(msg, arrival_ns)
    if request is not None:
        return request
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(codec_pool(), decode_infer_request, msg, arrival_ns)


def encode_inline(
    response: InferResponse, shm_outputs: frozenset[str] | None = None
) -> service_pb2.ModelInferResponse | None:
    """:func:`encode_infer_response` of a response whose outputs are small enough for
    the event loop (:data:`OFFLOAD_BYTES`); None for larger ones (:func:`encode_off_loop`)."""
    size = 0
    for arr in response.outputs.values():
        size += getattr(arr, "nbytes", 0)
    if size <= OFFLOAD_BYTES:
        return encode_infer_response(response, shm_outputs)
    return None


async def encode_off_loop(
    response: InferResponse, shm_outputs: frozenset[str] | None = None
) -> service_pb2.ModelInferResponse:
    """:func:`encode_infer_response`, on a worker thread when the outputs are large."""
    msg = encode_inline(response, shm_outputs)
    if msg is not None:
        return msg
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(codec_pool(), encode_infer_response, response, shm_outputs)


def metadata_response(meta: dict[str, Any]) -> service_pb2.ModelMetadataResponse:
    msg = service_pb2.ModelMetadataResponse(
        name=meta["name"], versions=meta.get("versions", []), platform=meta.get("platform", "")
    )
    for key, target in (("inputs", msg.inputs), ("outputs", msg.outputs)):
        for t in meta.get(key, []):
            target.add(name=t["name"], datatype=t["datatype"], shape=t["shape"])
    return msg
