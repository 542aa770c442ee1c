"""Input tensors for ``pdserve perf`` and the request bytes that carry them.

The model's inputs come from V2 model metadata (``GET /v2/models/{m}`` or gRPC
``ModelMetadata``) and its ``max_batch_size`` from the model configuration
(``/config``). A server without the configuration endpoint (KServe, MLServer) is
taken to batch when an input's first metadata dim is ``-1``.

Input data, as perf_analyzer's ``--input-data``: ``random`` (default; one random row
per input, generated once: floats in [0, 1), integers in [0, 100), booleans, BYTES
strings of ``--string-length`` random letters; repeated for each row of a batch),
``zero`` (BYTES: strings of ``"0"``), or a JSON file (:func:`load_input_file`).

Request bytes are built once, before the load starts: HTTP JSON or the binary tensor
extension, or a serialized gRPC ``ModelInferRequest`` (``raw_input_contents``).
"""

from __future__ import annotations

import base64
import json
import math
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.app.perf.options import PerfError, PerfOptions
from pdserve.core.datatypes import V2_TO_NUMPY, deserialize_bytes_tensor, serialize_bytes_tensor

#: Most distinct requests prepared (a longer data file is used from its start).
MAX_DISTINCT_REQUESTS = 1024


@dataclass
class TensorSpec:
    """One model input: V2 ``datatype`` and ``dims`` without the batch dimension
    (``-1`` = variable)."""

    name: str
    datatype: str
    dims: list[int]


@dataclass
class ModelSpec:
    """What the server says about the model.

    ``max_batch_size``: from the configuration; -1 when the server has no
    configuration endpoint and the first metadata dims are ``-1`` (batching assumed).
    """

    name: str
    version: str
    max_batch_size: int
    inputs: list[TensorSpec]
    outputs: list[str]
    platform: str = ""
    versions: list[str] = field(default_factory=list)
    #: An ensemble's step models (from ``ensemble_scheduling``), in step order.
    composing: list[str] = field(default_factory=list)

    @property
    def batching(self) -> bool:
        """Whether requests carry a leading batch dimension."""
        return self.max_batch_size != 0

    @classmethod
    def from_metadata(
        cls, metadata: Mapping[str, Any], config: Mapping[str, Any] | None, version: str = ""
    ) -> ModelSpec:
        """Build from V2 model metadata (JSON form; shape entries may be strings, as
        gRPC's int64 in JSON) and the model configuration (None when unavailable).

        Raises:
            PerfError: metadata without inputs or with an unknown datatype.
        """
        inputs_meta = list(metadata.get("inputs") or [])
        if not inputs_meta:
            raise PerfError(f"model '{metadata.get('name')}' lists no inputs in its metadata")
        shapes = [[int(d) for d in (t.get("shape") or [])] for t in inputs_meta]
        if config is not None:
            mbs = int(config.get("max_batch_size", 0) or 0)
        else:
            mbs = -1 if shapes and all(s and s[0] == -1 for s in shapes) else 0
        inputs = []
        for t, shape in zip(inputs_meta, shapes, strict=True):
            dt = str(t.get("datatype", ""))
            if dt not in V2_TO_NUMPY:
                raise PerfError(
                    f"input '{t.get('name')}' has datatype '{dt}', which perf cannot make"
                )
            dims = shape[1:] if mbs != 0 and shape else shape
            inputs.append(TensorSpec(str(t.get("name")), dt, dims))
        outputs = [str(t.get("name")) for t in metadata.get("outputs") or []]
        steps = ((config or {}).get("ensemble_scheduling") or {}).get("step") or []
        composing = list(dict.fromkeys(str(s.get("model_name")) for s in steps))
        return cls(
            name=str(metadata.get("name", "")),
            version=version,
            max_batch_size=mbs,
            inputs=inputs,
            outputs=outputs,
            platform=str(metadata.get("platform", "")),
            versions=[str(v) for v in metadata.get("versions") or []],
            composing=composing,
        )


def resolve_dims(spec: ModelSpec, shapes: Mapping[str, Sequence[int]]) -> dict[str, list[int]]:
    """The dims (without batch) each input is sent with: the model's, with ``--shape``
    taking the place of variable dims.

    Raises:
        PerfError: ``--shape`` names an unknown input, has another rank or changes a
            fixed dim; or a variable dim is left without ``--shape``.
    """
    names = {t.name for t in spec.inputs}
    for name in shapes:
        if name not in names:
            raise PerfError(
                f"--shape names input '{name}', which model '{spec.name}' does not have "
                f"(inputs: {', '.join(sorted(names))})"
            )
    out: dict[str, list[int]] = {}
    for t in spec.inputs:
        given = shapes.get(t.name)
        if given is None:
            out[t.name] = list(t.dims)
            continue
        if len(given) != len(t.dims):
            raise PerfError(
                f"--shape {t.name}:{','.join(map(str, given))} has {len(given)} dims; the model's "
                f"input has {len(t.dims)} ({t.dims}, without the batch dimension)"
            )
        for g, d in zip(given, t.dims, strict=True):
            if d != -1 and g != d:
                raise PerfError(
                    f"--shape {t.name}:{','.join(map(str, given))} changes a fixed dim of {t.dims}"
                )
        out[t.name] = list(given)
    return out


def _check_concrete(spec: ModelSpec, dims: Mapping[str, list[int]]) -> None:
    for t in spec.inputs:
        if any(d < 0 for d in dims[t.name]):
            example = ",".join("1" if d < 0 else str(d) for d in dims[t.name])
            raise PerfError(
                f"input '{t.name}' has variable dims {dims[t.name]}: give its shape, e.g. "
                f"--shape {t.name}:{example}"
            )


def _random_row(t: TensorSpec, dims: list[int], rng: np.random.Generator, n: int) -> np.ndarray:
    count = math.prod(dims)
    if t.datatype == "BYTES":
        letters = np.frombuffer(string.ascii_letters.encode(), dtype=np.uint8)
        items = [rng.choice(letters, n).tobytes() for _ in range(count)]
        arr = np.empty(count, dtype=object)
        arr[:] = items
        return arr.reshape(dims)
    dtype = V2_TO_NUMPY[t.datatype]
    if t.datatype == "BOOL":
        return rng.integers(0, 2, size=dims).astype(np.bool_)
    if dtype.kind == "f":
        return rng.random(size=dims).astype(dtype)
    return rng.integers(0, 100, size=dims).astype(dtype)


def _zero_row(t: TensorSpec, dims: list[int], n: int) -> np.ndarray:
    if t.datatype == "BYTES":
        arr = np.empty(math.prod(dims), dtype=object)
        arr[:] = [b"0" * n] * arr.size
        return arr.reshape(dims)
    return np.zeros(dims, dtype=V2_TO_NUMPY[t.datatype])


def _bytes_items(values: list[object]) -> np.ndarray:
    arr = np.empty(len(values), dtype=object)
    arr[:] = [v if isinstance(v, bytes) else str(v).encode() for v in values]
    return arr


def _flatten(value: object) -> list[object]:
    if isinstance(value, list):
        out: list[object] = []
        for v in value:
            out.extend(_flatten(v))
        return out
    return [value]


def _decode_value(value: object, t: TensorSpec, dims: list[int], where: str) -> np.ndarray:
    """One input's value in an input-data entry -> a row array of its shape."""
    shape = dims
    content = value
    if isinstance(value, dict):
        if "b64" in value:
            content = value
        elif "content" in value:
            content = value["content"]
            if "shape" in value:
                try:
                    shape = [int(d) for d in value["shape"]]
                except (TypeError, ValueError):
                    raise PerfError(f"{where}: 'shape' must be a list of integers") from None
        else:
            raise PerfError(f"{where}: an object needs 'content' or 'b64'")
    variable = sum(1 for d in shape if d < 0)
    if variable > 1:
        example = ",".join("1" if d < 0 else str(d) for d in shape)
        raise PerfError(
            f"{where}: input '{t.name}' has variable dims {shape}: give 'shape' in the "
            f"data file or --shape {t.name}:{example}"
        )
    arr = _decode_content(content, t, shape, where)
    if variable == 1:
        fixed = math.prod(d for d in shape if d >= 0)
        if fixed == 0 or arr.size % fixed:
            raise PerfError(f"{where}: {arr.size} values do not fill shape {shape}")
        shape = [arr.size // fixed if d < 0 else d for d in shape]
    count = math.prod(shape)
    if arr.size != count:
        raise PerfError(f"{where}: {arr.size} values; shape {shape} needs {count}")
    return arr.reshape(shape)


def _decode_content(content: object, t: TensorSpec, shape: list[int], where: str) -> np.ndarray:
    """The flat values of one input's content (a list, or a ``{"b64": ...}`` object)."""
    if isinstance(content, dict):
        if "b64" not in content:
            raise PerfError(f"{where}: 'content' object needs 'b64'")
        try:
            raw = base64.b64decode(content["b64"], validate=True)
        except (ValueError, TypeError):
            raise PerfError(f"{where}: 'b64' is not valid base64") from None
        if t.datatype == "BYTES":
            try:
                arr = deserialize_bytes_tensor(raw)
            except Exception as e:  # noqa: BLE001 - any decoding failure is the file's
                raise PerfError(f"{where}: BYTES b64 content is not length-prefixed: {e}") from None
        else:
            itemsize = V2_TO_NUMPY[t.datatype].itemsize
            if len(raw) % itemsize or (
                all(d >= 0 for d in shape) and len(raw) != math.prod(shape) * itemsize
            ):
                raise PerfError(
                    f"{where}: b64 content has {len(raw)} bytes; shape {shape} of "
                    f"{t.datatype} needs {math.prod(shape) * itemsize}"
                )
            arr = np.frombuffer(raw, dtype=V2_TO_NUMPY[t.datatype].newbyteorder("<")).astype(
                V2_TO_NUMPY[t.datatype]
            )
    else:
        flat = _flatten(content)
        if t.datatype == "BYTES":
            arr = _bytes_items(flat)
        else:
            try:
                arr = np.asarray(flat, dtype=V2_TO_NUMPY[t.datatype])
            except (TypeError, ValueError, OverflowError):
                raise PerfError(f"{where}: values are not {t.datatype}") from None
    return arr


def load_input_file(
    path: str | Path, spec: ModelSpec, dims: Mapping[str, list[int]]
) -> list[dict[str, np.ndarray]]:
    """Read a perf_analyzer input-data JSON file: one dict of row arrays per entry.

    The file is ``{"data": [{"INPUT0": [...], ...}, ...]}``. Each entry holds every
    input for one batch row: a flat (or nested) list in row-major order,
    ``{"content": [...], "shape": [...]}``, ``{"b64": "..."}`` (little-endian bytes;
    BYTES elements as 4-byte length + bytes) or ``{"content": {"b64": ...},
    "shape": [...]}``. Requests go round-robin over the entries; a request of batch
    ``b`` takes ``b`` consecutive entries, as perf_analyzer does. Where one dim is
    variable and neither ``shape`` nor ``--shape`` gives it, the number of values
    does. Sequence data (a list of lists) is not supported; ``validation_data`` is
    ignored.

    Raises:
        PerfError: unreadable or not JSON, no ``data`` list, sequence streams, an
            entry missing a model input or naming an unknown one, or a value that
            does not fit its datatype and shape (the entry index and input name are
            in the message).
    """
    try:
        doc = json.loads(Path(path).read_text())
    except OSError as e:
        raise PerfError(f"cannot read input data file {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise PerfError(f"input data file {path} is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list) or not doc["data"]:
        raise PerfError(f'input data file {path}: expected {{"data": [ {{...}}, ... ]}}')
    entries = doc["data"]
    if any(isinstance(e, list) for e in entries):
        raise PerfError(
            f"input data file {path} holds sequence streams (lists of steps); "
            "sequence models are not supported yet"
        )
    known = {t.name: t for t in spec.inputs}
    rows: list[dict[str, np.ndarray]] = []
    for i, entry in enumerate(entries):
        where = f"{path}: data[{i}]"
        if not isinstance(entry, dict):
            raise PerfError(f"{where} is not an object of input name -> value")
        unknown = sorted(set(entry) - set(known))
        if unknown:
            raise PerfError(f"{where} names {', '.join(unknown)}, not inputs of '{spec.name}'")
        missing = sorted(set(known) - set(entry))
        if missing:
            raise PerfError(f"{where} has no value for input(s) {', '.join(missing)}")
        rows.append(
            {
                name: _decode_value(entry[name], t, list(dims[name]), f"{where}.{name}")
                for name, t in known.items()
            }
        )
    return rows


def make_rows(opts: PerfOptions, spec: ModelSpec) -> list[dict[str, np.ndarray]]:
    """The batch-1 rows requests are built from (one row for ``random``/``zero``).

    Raises:
        PerfError: as :func:`resolve_dims` and :func:`load_input_file`.
    """
    dims = resolve_dims(spec, opts.shapes)
    if opts.input_data in ("random", "zero"):
        _check_concrete(spec, dims)
        rng = np.random.default_rng(opts.seed)
        if opts.input_data == "random":
            return [
                {t.name: _random_row(t, dims[t.name], rng, opts.string_length) for t in spec.inputs}
            ]
        return [{t.name: _zero_row(t, dims[t.name], opts.string_length) for t in spec.inputs}]
    return load_input_file(opts.input_data, spec, dims)


def make_batches(
    rows: Sequence[dict[str, np.ndarray]], spec: ModelSpec, batch_size: int
) -> list[dict[str, np.ndarray]]:
    """The distinct request tensors: request ``j`` stacks rows ``j*b .. j*b+b-1``
    (modulo the number of rows) along a new batch axis when the model batches.

    Raises:
        PerfError: the model does not batch and ``batch_size`` > 1, the batch
            exceeds ``max_batch_size``, or rows of one batch differ in shape.
    """
    if not spec.batching and batch_size > 1:
        raise PerfError(
            f"model '{spec.name}' does not batch (max_batch_size 0): the batch size must be 1"
        )
    if spec.max_batch_size > 0 and batch_size > spec.max_batch_size:
        raise PerfError(
            f"batch size {batch_size} exceeds model '{spec.name}' max_batch_size "
            f"{spec.max_batch_size}"
        )
    n = len(rows)
    distinct = min(n // math.gcd(n, batch_size), MAX_DISTINCT_REQUESTS)
    out = []
    for j in range(distinct):
        picked = [rows[(j * batch_size + k) % n] for k in range(batch_size)]
        tensors: dict[str, np.ndarray] = {}
        for t in spec.inputs:
            parts = [p[t.name] for p in picked]
            if any(p.shape != parts[0].shape for p in parts):
                raise PerfError(
                    f"input '{t.name}': rows of one batch have different shapes "
                    f"({sorted({str(list(p.shape)) for p in parts})})"
                )
            tensors[t.name] = np.stack(parts) if spec.batching else parts[0]
        out.append(tensors)
    return out


def _raw(arr: np.ndarray, datatype: str) -> bytes:
    if datatype == "BYTES":
        return serialize_bytes_tensor(arr)
    return np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()


def _json_data(arr: np.ndarray, datatype: str, name: str) -> list[object]:
    if datatype != "BYTES":
        return arr.reshape(-1).tolist()
    out: list[object] = []
    for item in arr.reshape(-1):
        try:
            out.append(item.decode() if isinstance(item, bytes) else str(item))
        except UnicodeDecodeError:
            raise PerfError(
                f"input '{name}' holds bytes that are not UTF-8: JSON cannot carry them; "
                "use --input-tensor-format binary"
            ) from None
    return out


@dataclass
class HttpRequest:
    """One prepared HTTP infer request: path, headers (without Host and
    Content-Length) and body."""

    path: str
    headers: dict[str, str]
    body: bytes

    def wire(self, host: str) -> bytes:
        """The complete HTTP/1.1 request bytes for ``host`` (``host:port``)."""
        lines = [f"POST {self.path} HTTP/1.1", f"Host: {host}", f"Content-Length: {len(self.body)}"]
        lines += [f"{k}: {v}" for k, v in self.headers.items()]
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + self.body


def infer_path(model: str, version: str) -> str:
    """``/v2/models/{m}[/versions/{v}]/infer``."""
    return f"/v2/models/{model}" + (f"/versions/{version}" if version else "") + "/infer"


def encode_http(
    spec: ModelSpec,
    tensors: Mapping[str, np.ndarray],
    version: str,
    input_format: str,
    output_format: str,
) -> HttpRequest:
    """A V2 HTTP infer request for ``tensors`` (JSON, or JSON header + binary data).

    Raises:
        PerfError: a BYTES value that JSON cannot carry.
    """
    inputs: list[dict[str, object]] = []
    blobs: list[bytes] = []
    for t in spec.inputs:
        arr = tensors[t.name]
        entry: dict[str, object] = {
            "name": t.name,
            "shape": list(arr.shape),
            "datatype": t.datatype,
        }
        if input_format == "binary":
            raw = _raw(arr, t.datatype)
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = _json_data(arr, t.datatype, t.name)
        inputs.append(entry)
    doc: dict[str, object] = {"inputs": inputs}
    if output_format == "binary":
        doc["parameters"] = {"binary_data_output": True}
    header = json.dumps(doc, separators=(",", ":")).encode()
    headers = {"Content-Type": "application/json"}
    if blobs:
        headers = {
            "Content-Type": "application/octet-stream",
            "Inference-Header-Content-Length": str(len(header)),
        }
    return HttpRequest(infer_path(spec.name, version), headers, header + b"".join(blobs))


def encode_grpc(spec: ModelSpec, tensors: Mapping[str, np.ndarray], version: str) -> bytes:
    """A serialized gRPC ``inference.ModelInferRequest`` (inputs as
    ``raw_input_contents``; every output returned)."""
    from tritonclient.grpc import service_pb2

    req = service_pb2.ModelInferRequest(model_name=spec.name, model_version=version)
    for t in spec.inputs:
        arr = tensors[t.name]
        tensor = req.inputs.add()
        tensor.name = t.name
        tensor.datatype = t.datatype
        tensor.shape.extend(int(d) for d in arr.shape)
        req.raw_input_contents.append(_raw(arr, t.datatype))
    return req.SerializeToString()


def build_requests(opts: PerfOptions, spec: ModelSpec) -> list[bytes] | list[HttpRequest]:
    """Every distinct request of the run: :class:`HttpRequest` objects (HTTP) or
    serialized ``ModelInferRequest`` bytes (gRPC).

    Raises:
        PerfError: as :func:`make_rows`, :func:`make_batches`, :func:`encode_http`.
    """
    rows = make_rows(opts, spec)
    batches = make_batches(rows, spec, opts.batch_size)
    if opts.protocol == "grpc":
        return [encode_grpc(spec, b, opts.model_version) for b in batches]
    return [
        encode_http(spec, b, opts.model_version, opts.input_format, opts.output_format)
        for b in batches
    ]
