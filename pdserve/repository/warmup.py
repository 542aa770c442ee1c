"""Model warm-up: run sample requests on every instance of a version before it serves.

A new or changed version is loaded beside the serving one and only switched in
once it is ready; warming it up first means the first real requests after the
switch do not pay for lazy initialisation (ONNX Runtime's first-run allocations,
a Python model's first call), so clients see no latency step at the swap.

Samples come from the configuration's ``model_warmup`` (Triton's ``ModelWarmup``:
``name``, ``batch_size``, ``count``, and per input ``data_type``, ``dims`` and one of
``zero_data`` / ``random_data`` / ``input_data_file``, the file being read from
``<model>/warmup/``). As in Triton, each sample runs ``count`` times (at least
once) on *each* model instance, directly, so warm-up never shows in statistics or
metrics. A failing configured sample fails the load.

A configuration without ``model_warmup`` gets no warm-up at all, as in Triton:
no request the model did not ask for ever reaches it, so a model with side
effects (counters, writes, calls to other services) sees only real requests,
and a model that would reject an invented input logs no errors. (Load-time
checks need no request: the configuration, the backend's own load and each
python instance's ``initialize`` have passed before warm-up.) To warm a model
up, give it ``model_warmup`` — ``zero_data: true`` with the input's dims is the
smallest sample.
"""

from __future__ import annotations

import logging
import time

import numpy as np
from tritonclient.grpc import model_config_pb2

from pdserve.core.datatypes import CONFIG_TO_V2, V2_TO_NUMPY, deserialize_bytes_tensor
from pdserve.core.errors import InferError
from pdserve.core.types import InferRequest
from pdserve.repository.model import ModelVersion

log = logging.getLogger("pdserve.warmup")

__all__ = ["WarmupError", "build_samples", "warmup"]


class WarmupError(Exception):
    """A configured warm-up sample failed; the version must not serve."""


def _config_datatype(enum_value: int) -> str:
    """V2 datatype name of a ``DataType`` enum value (``TYPE_FP32`` -> ``FP32``)."""
    name = model_config_pb2.DataType.Name(enum_value)
    try:
        return CONFIG_TO_V2[name]
    except KeyError:
        raise WarmupError(f"unsupported warm-up data_type {name}") from None


def _make_array(
    datatype: str, shape: list[int], kind: str, data: bytes | None, where: str
) -> np.ndarray:
    """An input array of ``shape`` filled as ``kind`` says (zero / random / file)."""
    count = int(np.prod(shape)) if shape else 1
    if datatype == "BYTES":
        if kind == "file":
            arr = deserialize_bytes_tensor(data or b"")
            if arr.size != count:
                raise WarmupError(f"{where}: file holds {arr.size} strings, shape needs {count}")
            return arr.reshape(shape)
        arr = np.empty(count, dtype=object)
        arr[:] = [b""] * count
        return arr.reshape(shape)
    dtype = V2_TO_NUMPY.get(datatype)
    if dtype is None:
        raise WarmupError(f"{where}: unsupported data_type {datatype}")
    if kind == "file":
        need = count * dtype.itemsize
        if data is None or len(data) < need:
            raise WarmupError(
                f"{where}: file holds {0 if data is None else len(data)} bytes, shape needs {need}"
            )
        return np.frombuffer(data[:need], dtype=dtype.newbyteorder("<")).reshape(shape)
    if kind == "random":
        rng = np.random.default_rng(0)
        if dtype.kind == "f":
            return rng.random(count).astype(dtype).reshape(shape)
        if dtype.kind == "b":
            return (rng.integers(0, 2, count) == 1).reshape(shape)
        return rng.integers(0, 8, count).astype(dtype).reshape(shape)
    return np.zeros(shape, dtype=dtype)


def build_samples(mv: ModelVersion) -> list[tuple[str, InferRequest, int]]:
    """The configured ``model_warmup`` samples as ``(name, request, count)``.

    Raises:
        WarmupError: a sample names an unknown input, a missing data file, or data
            that does not fit its shape.
    """
    samples = []
    batching = mv.max_batch_size > 0
    for i, w in enumerate(mv.config.model_warmup):
        label = w.name or f"model_warmup[{i}]"
        batch = max(int(w.batch_size), 1)
        inputs: dict[str, np.ndarray] = {}
        for in_name, spec in w.inputs.items():
            where = f"warm-up sample '{label}' input '{in_name}'"
            if in_name not in mv.inputs:
                raise WarmupError(f"{where}: the model has no such input")
            dims = [int(d) for d in spec.dims]
            if any(d < 0 for d in dims):
                raise WarmupError(f"{where}: dims {dims} must be concrete")
            shape = ([batch] if batching else []) + dims
            choice = spec.WhichOneof("input_data_type")
            data = None
            kind = "zero"
            if choice == "random_data":
                kind = "random"
            elif choice == "input_data_file":
                kind = "file"
                path = mv.spec.model_dir / "warmup" / spec.input_data_file
                try:
                    data = path.read_bytes()
                except OSError as e:
                    raise WarmupError(f"{where}: cannot read {path}: {e}") from None
            datatype = (
                _config_datatype(spec.data_type) if spec.data_type else mv.inputs[in_name].datatype
            )
            inputs[in_name] = _make_array(datatype, shape, kind, data, where)
        samples.append(
            (label, InferRequest(mv.name, mv.version_str, inputs, id="warmup"), max(w.count, 1))
        )
    return samples


async def _run_on_instances(mv: ModelVersion, request: InferRequest, count: int) -> None:
    """Run ``request`` ``count`` times on every instance of ``mv``.

    Raises:
        InferError: the request does not fit the model, or an instance failed it.
    """
    exec_req = mv.prepare(request)
    for instance in mv.instances:
        for _ in range(count):
            (result,) = await instance.execute([exec_req])
            if isinstance(result, InferError):
                raise result


async def warmup(mv: ModelVersion) -> None:
    """Warm ``mv`` up (see the module docstring) before it is switched in.

    Raises:
        WarmupError: a configured sample failed (the load fails with its message).
    """
    if not mv.instances:
        return
    start = time.monotonic()
    samples = build_samples(mv)
    if not samples:
        return
    for label, request, count in samples:
        try:
            await _run_on_instances(mv, request, count)
        except WarmupError:
            raise
        except Exception as e:
            message = e.message if isinstance(e, InferError) else f"{type(e).__name__}: {e}"
            raise WarmupError(f"warm-up sample '{label}' failed: {message}") from e
    log.info(
        "warmed up %s version %d: %d sample%s on %d instance%s in %.0f ms",
        mv.name,
        mv.version,
        len(samples),
        "" if len(samples) == 1 else "s",
        len(mv.instances),
        "" if len(mv.instances) == 1 else "s",
        (time.monotonic() - start) * 1000,
    )
