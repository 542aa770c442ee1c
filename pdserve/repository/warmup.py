"""Model warm-up: run sample requests on every instance of a version before it serves,
so the first real requests after a swap do not pay for lazy initialisation.

Samples come from the configuration's ``model_warmup`` (Triton's ``ModelWarmup``: per
input ``zero_data`` / ``random_data`` / ``input_data_file``, the file read from
``<model>/warmup/``, never outside it, only the bytes the input needs, off the event
loop). Each sample runs ``count`` times (at least once) on each model instance directly,
so warm-up never shows in statistics; a failing sample fails the load. As in Triton, a
configuration without ``model_warmup`` gets no warm-up: no request the model did not ask
for ever reaches it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2

from pdserve.core.datatypes import CONFIG_TO_V2, V2_TO_NUMPY, deserialize_bytes_tensor
from pdserve.core.errors import InferError
from pdserve.core.types import InferRequest
from pdserve.repository.model import ModelVersion

log = logging.getLogger("pdserve.warmup")

__all__ = [
    "WarmupError",
    "build_samples",
    "check_samples",
    "read_input_data_file",
    "warmup",
    "warmup_file_path",
]

#: Most bytes read for a BYTES input's ``input_data_file`` (its size is not known
#: from the shape); fixed-size inputs read exactly what their shape needs.
MAX_BYTES_WARMUP_FILE = 64 * 1024 * 1024


class WarmupError(Exception):
    """A configured warm-up sample failed; the version must not serve.

    Attributes:
        field: the configuration field at fault (``model_warmup[0].inputs[IN].dims``;
            ``""`` when unknown), for ``pdserve check``'s report. The message does
            not repeat it.
    """

    def __init__(self, message: str, field: str = "") -> None:
        super().__init__(message)
        self.field = field


def _config_datatype(enum_value: int) -> str:
    """V2 datatype name of a ``DataType`` enum value (``TYPE_FP32`` -> ``FP32``)."""
    name = model_config_pb2.DataType.Name(enum_value)
    try:
        return CONFIG_TO_V2[name]
    except KeyError:
        raise WarmupError(f"unsupported warm-up data_type {name}") from None


def warmup_file_path(model_dir: Path, name: str, where: str) -> Path:
    """The file ``input_data_file`` = ``name`` names: ``<model_dir>/warmup/<name>``.

    Triton reads warm-up data files from the model's ``warmup`` folder; the name
    must stay inside it once resolved (symlinks followed).

    Raises:
        WarmupError: ``name`` is empty, absolute, or leaves ``<model>/warmup/``; the
            message names the field, never the server's absolute paths.
    """
    if not name or os.path.isabs(name) or Path(name).is_absolute():
        raise WarmupError(
            f"{where}: input_data_file must be a path relative to the model's warmup/ folder"
        )
    folder = (model_dir / "warmup").resolve()
    path = (folder / name).resolve()
    if not path.is_relative_to(folder):
        raise WarmupError(f"{where}: input_data_file '{name}' leaves the model's warmup/ folder")
    return path


def read_input_data_file(path: Path, limit: int, exact: bool, where: str, name: str) -> bytes:
    """Read at most ``limit`` bytes of the regular file ``path`` (blocking: call it in a thread).

    Opened non-blocking and checked with ``fstat`` before any read, so a FIFO or
    device never blocks and a huge file is never read whole.

    Args:
        exact: the input needs exactly ``limit`` bytes (fixed-size datatype): a
            shorter file is an error, a longer one is cut. Otherwise ``limit`` is
            a cap (BYTES): a larger file is an error.

    Raises:
        WarmupError: the file is missing, not a regular file, or of the wrong size.
    """
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise WarmupError(f"{where}: cannot read input_data_file '{name}': {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise WarmupError(f"{where}: input_data_file '{name}' is not a regular file")
        if exact and st.st_size < limit:
            raise WarmupError(
                f"{where}: input_data_file '{name}' holds {st.st_size} bytes, shape needs {limit}"
            )
        if not exact and st.st_size > limit:
            raise WarmupError(
                f"{where}: input_data_file '{name}' holds {st.st_size} bytes, more than {limit}"
            )
        return f.read(limit)


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


async def _build_input(
    mv: ModelVersion,
    index: int,
    label: str,
    in_name: str,
    spec: model_config_pb2.ModelWarmup.Input,
) -> np.ndarray:
    """The array of input ``in_name`` of sample ``index`` (``spec``: its ``ModelWarmup.Input``).

    Raises:
        WarmupError: with ``field`` set (see :func:`build_samples`).
    """
    w = mv.config.model_warmup[index]
    where = f"warm-up sample '{label}' input '{in_name}'"
    field = f"model_warmup[{index}].inputs[{in_name}]"
    if in_name not in mv.inputs:
        raise WarmupError(f"{where}: the model has no such input", field)
    dims = [int(d) for d in spec.dims]
    if any(d < 0 for d in dims):
        raise WarmupError(f"{where}: dims {dims} must be concrete", f"{field}.dims")
    batch = max(int(w.batch_size), 1)
    shape = ([batch] if mv.max_batch_size > 0 else []) + dims
    choice = spec.WhichOneof("input_data_type")
    data = None
    kind = "zero"
    data_type = int(spec.data_type)
    try:
        datatype = _config_datatype(data_type) if data_type else mv.inputs[in_name].datatype
    except WarmupError as e:
        raise WarmupError(str(e), f"{field}.data_type") from None
    if choice == "random_data":
        kind = "random"
    elif choice == "input_data_file":
        kind = "file"
        name = spec.input_data_file
        try:
            path = warmup_file_path(mv.spec.model_dir, name, where)
            np_dtype = V2_TO_NUMPY.get(datatype)
            if datatype == "BYTES" or np_dtype is None:
                limit, exact = MAX_BYTES_WARMUP_FILE, False
            else:
                count = int(np.prod(shape)) if shape else 1
                limit, exact = count * np_dtype.itemsize, True
            data = await asyncio.to_thread(read_input_data_file, path, limit, exact, where, name)
        except WarmupError as e:
            raise WarmupError(str(e), f"{field}.input_data_file") from None
    try:
        return _make_array(datatype, shape, kind, data, where)
    except WarmupError as e:
        what = "input_data_file" if kind == "file" else "data_type"
        raise WarmupError(str(e), f"{field}.{what}") from None


def _request(mv: ModelVersion, inputs: dict[str, np.ndarray]) -> InferRequest:
    return InferRequest(mv.name, mv.version_str, inputs, id="warmup")


def _label(mv: ModelVersion, index: int) -> str:
    return mv.config.model_warmup[index].name or f"model_warmup[{index}]"


async def build_samples(mv: ModelVersion) -> list[tuple[str, InferRequest, int]]:
    """The configured ``model_warmup`` samples as ``(name, request, count)``.

    Data files are read in a worker thread (:func:`read_input_data_file`).

    Raises:
        WarmupError: a sample names an unknown input, a missing, misplaced or
            non-regular data file, or data that does not fit its shape (the first
            such problem; :func:`check_samples` finds them all). Its ``field`` names
            the configuration field (``model_warmup[0].inputs[IN].input_data_file``).
    """
    samples = []
    for i, w in enumerate(mv.config.model_warmup):
        label = _label(mv, i)
        inputs: dict[str, np.ndarray] = {}
        for in_name, spec in sorted(w.inputs.items()):
            inputs[in_name] = await _build_input(mv, i, label, in_name, spec)
        samples.append((label, _request(mv, inputs), max(w.count, 1)))
    return samples


async def check_samples(mv: ModelVersion) -> list[WarmupError]:
    """Every problem of ``mv``'s ``model_warmup`` that would fail its load in ``serve``.

    What :func:`warmup` does before it runs a sample, without running one: each
    input of each sample is built (:func:`build_samples`: names, dims, data_type,
    ``input_data_file`` confined to ``<model>/warmup/``, present, a regular file of
    the right size) and each sample whose inputs all build is checked against the
    model's inputs as a request would be (:meth:`ModelVersion.prepare`: datatypes,
    dims, batch size, required inputs). Messages are serve's; unlike serve, which
    stops at the first, every problem is returned (``pdserve check``).

    Returns:
        one :class:`WarmupError` per problem (empty: warm-up would pass these checks;
        the model could still fail a sample when it runs it).
    """
    problems: list[WarmupError] = []
    for i, w in enumerate(mv.config.model_warmup):
        label = _label(mv, i)
        inputs: dict[str, np.ndarray] = {}
        failed = False
        for in_name, spec in sorted(w.inputs.items()):
            try:
                inputs[in_name] = await _build_input(mv, i, label, in_name, spec)
            except WarmupError as e:
                problems.append(e)
                failed = True
        if failed:
            continue
        try:
            mv.prepare(_request(mv, inputs))
        except InferError as e:
            problems.append(
                WarmupError(f"warm-up sample '{label}' failed: {e.message}", f"model_warmup[{i}]")
            )
    return problems


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
    samples = await build_samples(mv)
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
