"""ONNX Runtime backend (``platform: "onnxruntime_onnx"`` / ``backend: "onnxruntime"``).

Each model instance is one ``onnxruntime.InferenceSession``. ORT releases the GIL
while it runs, so an instance executes on its own thread and several instances
run concurrently (DESIGN.md). ``instance_group`` gives the count and kind:

- ``KIND_CPU``: ``CPUExecutionProvider``.
- ``KIND_GPU``: ``CUDAExecutionProvider`` on the listed ``gpus`` (default GPU 0).
  When this onnxruntime build or machine has no CUDA provider the model fails to
  load with that reason (no silent fallback to CPU).
- ``KIND_AUTO``: GPU when CUDA is available, else CPU.

Session options come from the model configuration, with Triton's onnxruntime
backend keys:

- ``parameters { key: "intra_op_thread_count" value { string_value: "1" } }``
  (absent: the process's CPUs shared among the model's instances, at least 1 —
  see :func:`default_intra_op_threads`),
- ``parameters { key: "inter_op_thread_count" ... }``,
- ``parameters { key: "execution_mode" ... }`` ``0`` sequential (default) / ``1`` parallel,
- ``optimization { graph { level: N } }``: ``-1`` basic, ``0`` (default) all,
  ``1`` extended — or the parameter ``graph_optimization_level`` with
  ``disable`` / ``basic`` / ``extended`` / ``all``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from typing import Any

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import (
    Backend,
    ExecRequest,
    ExecResult,
    ModelInstance,
    ModelSpec,
    batch_input_tensors,
    merge_batch,
    split_batch,
)
from pdserve.datatypes import ORT_TO_V2, to_bytes_object_array
from pdserve.types import InferError, unavailable

log = logging.getLogger("pdserve.onnxruntime")

#: ``auto`` runs a session inline on the event loop while its average run is shorter.
INLINE_RUN_MAX_S = 0.0002
#: an inline run longer than this switches the instance to its thread for good.
INLINE_STICKY_LIMIT_S = 0.002


class _Closed(Exception):
    """The instance was closed before a batch could start on its thread."""


_LEVELS = {"disable": 0, "basic": 1, "extended": 2, "all": 99}


def _ort() -> Any:
    import onnxruntime

    return onnxruntime


def session_options(config: Any) -> Any:
    """Build ``onnxruntime.SessionOptions`` from a model configuration.

    Raises:
        ValueError: a parameter value is not an integer / known level name.
    """
    ort = _ort()
    so = ort.SessionOptions()
    intra = cfgmod.get_parameter(config, "intra_op_thread_count")
    inter = cfgmod.get_parameter(config, "inter_op_thread_count")
    mode = cfgmod.get_parameter(config, "execution_mode")
    try:
        if intra:
            so.intra_op_num_threads = int(intra)
        if inter:
            so.inter_op_num_threads = int(inter)
        if mode:
            so.execution_mode = (
                ort.ExecutionMode.ORT_PARALLEL
                if int(mode) == 1
                else ort.ExecutionMode.ORT_SEQUENTIAL
            )
    except ValueError as e:
        raise ValueError(f"session option parameter is not an integer: {e}") from None
    level_name = cfgmod.get_parameter(config, "graph_optimization_level")
    gol = ort.GraphOptimizationLevel
    by_value = {
        0: gol.ORT_DISABLE_ALL,
        1: gol.ORT_ENABLE_BASIC,
        2: gol.ORT_ENABLE_EXTENDED,
        99: gol.ORT_ENABLE_ALL,
    }
    if level_name:
        if level_name not in _LEVELS:
            raise ValueError(
                f"graph_optimization_level '{level_name}' is not one of {sorted(_LEVELS)}"
            )
        so.graph_optimization_level = by_value[_LEVELS[level_name]]
    elif config.HasField("optimization") and config.optimization.HasField("graph"):
        level = config.optimization.graph.level
        so.graph_optimization_level = {-1: gol.ORT_ENABLE_BASIC, 1: gol.ORT_ENABLE_EXTENDED}.get(
            level, gol.ORT_ENABLE_ALL
        )
    return so


def default_intra_op_threads(instances: int) -> int:
    """Intra-op threads per session when the config sets none: the CPUs this
    process may use (its affinity mask), shared among the model's instances, at
    least 1.

    ORT's own default (one thread per core for every session) oversubscribes the
    cores as soon as a model has several instances — Triton's default for a CPU
    ONNX model is two — and its spinning threads then fight over them.
    """
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, instances))


def _shape_of(arg: Any) -> list[int | None]:
    return [d if isinstance(d, int) and d >= 0 else None for d in arg.shape]


class OnnxRuntimeBackend(Backend):
    """Loads ``model.onnx`` (or ``default_model_filename``) into ORT sessions."""

    name = "onnxruntime"

    def _model_path(self, spec: ModelSpec) -> str:
        filename = spec.config.default_model_filename or "model.onnx"
        path = spec.version_dir / filename
        if not path.exists():
            raise FileNotFoundError(f"model file {path} does not exist")
        return str(path)

    def auto_complete(self, spec: ModelSpec) -> None:
        """Complete and check the config against the graph's inputs and outputs.

        Raises:
            pdserve.config.ConfigError: dims/datatypes disagree, unknown tensors,
                or batching asked of a graph whose first dim is fixed.
        """
        ort = _ort()
        sess = ort.InferenceSession(self._model_path(spec), providers=["CPUExecutionProvider"])

        def io(args: list[Any]) -> list[tuple[str, str, list[int | None]]]:
            out = []
            for a in args:
                if a.type not in ORT_TO_V2:
                    raise cfgmod.ConfigError(
                        str(spec.version_dir), a.name, f"unsupported ONNX type {a.type}"
                    )
                out.append((a.name, ORT_TO_V2[a.type], _shape_of(a)))
            return out

        inputs, outputs = io(sess.get_inputs()), io(sess.get_outputs())
        batching = all(s and s[0] is None for _, _, s in inputs + outputs)
        cfgmod.autocomplete_from_io(
            spec.config, inputs, outputs, batching, str(spec.model_dir / "config.pbtxt")
        )

    async def load(self, spec: ModelSpec) -> list[ModelInstance]:
        """Create one ORT session per instance in ``instance_group``.

        Raises:
            RuntimeError: KIND_GPU asked but no CUDAExecutionProvider is available.
            ValueError: bad session option parameters.
        """
        ort = _ort()
        path = self._model_path(spec)
        available = ort.get_available_providers()
        groups = list(spec.config.instance_group) or [None]
        plans: list[tuple[str, list[Any]]] = []
        for group in groups:
            count = group.count if group is not None and group.count > 0 else 1
            kind_name = "KIND_CPU"
            gpus: list[int] = [0]
            if group is not None:
                from tritonclient.grpc import model_config_pb2 as mc

                kind_name = mc.ModelInstanceGroup.Kind.Name(group.kind)
                gpus = list(group.gpus) or [0]
            if kind_name == "KIND_AUTO":
                kind_name = "KIND_GPU" if "CUDAExecutionProvider" in available else "KIND_CPU"
            if kind_name == "KIND_GPU":
                if "CUDAExecutionProvider" not in available:
                    raise RuntimeError(
                        "instance_group asks for KIND_GPU but this onnxruntime has no "
                        f"CUDAExecutionProvider (available: {', '.join(available)}); install "
                        "onnxruntime-gpu on a machine with a CUDA GPU, or use KIND_CPU"
                    )
                for gpu in gpus:
                    for _ in range(count):
                        plans.append(
                            (
                                "KIND_GPU",
                                [
                                    ("CUDAExecutionProvider", {"device_id": gpu}),
                                    "CPUExecutionProvider",
                                ],
                            )
                        )
            elif kind_name in ("KIND_CPU", "KIND_MODEL"):
                plans.extend(("KIND_CPU", ["CPUExecutionProvider"]) for _ in range(count))
            else:
                raise RuntimeError(
                    f"instance_group kind {kind_name} is not supported by onnxruntime"
                )
        so = session_options(spec.config)
        if not cfgmod.get_parameter(spec.config, "intra_op_thread_count"):
            so.intra_op_num_threads = default_intra_op_threads(len(plans))
        loop = asyncio.get_running_loop()

        def make(providers: list[Any]) -> Any:
            return ort.InferenceSession(path, sess_options=so, providers=providers)

        sessions = await asyncio.gather(
            *(loop.run_in_executor(None, make, providers) for _, providers in plans)
        )
        return [
            OnnxRuntimeInstance(f"{spec.name}_{i}", kind, sess, spec)
            for i, ((kind, _), sess) in enumerate(zip(plans, sessions, strict=True))
        ]


class OnnxRuntimeInstance(ModelInstance):
    """One ORT session running on its own thread."""

    def __init__(self, name: str, kind: str, session: Any, spec: ModelSpec) -> None:
        self.name = name
        self.kind = kind
        self.session = session
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
        cfg = spec.config
        self._batching = cfg.max_batch_size > 0
        self._string_inputs = {a.name for a in session.get_inputs() if a.type == "tensor(string)"}
        self._string_outputs = {a.name for a in session.get_outputs() if a.type == "tensor(string)"}
        self._reshape: dict[str, list[int]] = {
            i.name: list(i.reshape.shape) for i in cfg.input if i.HasField("reshape")
        }
        self._out_reshape: dict[str, list[int]] = {
            o.name: list(o.dims) for o in cfg.output if o.HasField("reshape")
        }
        self._all_outputs = [o.name for o in session.get_outputs()]
        #: allow_ragged_batch inputs (flattened, concatenated) and batch_input entries.
        self._ragged = frozenset(i.name for i in cfg.input if i.allow_ragged_batch)
        self._batch_inputs = list(cfg.batch_input)
        mode = cfgmod.get_parameter(cfg, "execution_thread", "auto")
        if mode not in ("auto", "loop", "thread"):
            raise ValueError(f"execution_thread '{mode}' is not one of auto, loop, thread")
        self._mode = mode
        #: moving average of a run's duration, seconds (drives ``auto``).
        self._avg_run_s = 0.0
        self._closed = False

    def _run(self, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        values = self.session.run(names, feeds)
        return dict(zip(names, values, strict=True))

    def _note_duration(self, seconds: float) -> None:
        avg = self._avg_run_s
        self._avg_run_s = seconds if avg == 0.0 else avg * 0.9 + seconds * 0.1

    def _timed_run(self, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        # CPU time of this thread, not wall time: waiting to get the GIL back from a
        # busy event loop must not make a tiny model look slow.
        start = time.thread_time()
        try:
            return self._run(feeds, names)
        finally:
            self._note_duration(time.thread_time() - start)

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        """Merge the batch, run the session, split the outputs per request.

        Where the session runs (config parameter ``execution_thread``):
        ``thread`` — always on this instance's own thread (ORT releases the GIL, so
        the event loop keeps accepting requests); ``loop`` — on the event loop
        thread; ``auto`` (default) — on the thread, except while the moving average
        run time is under ``INLINE_RUN_MAX_S`` (a sub-0.2 ms model), where handing
        the batch to a thread and back costs more than the run itself.

        A request whose string (``tensor(string)``) input is not UTF-8 gets a 400
        naming the input, without running; the others of the batch run. A batch
        that reaches an instance already closed (shutdown, unload) gets a 503.
        """
        if self._string_inputs:
            bad = self._check_strings(batch)
            if bad:
                good = [r for r in batch if id(r) not in bad]
                results = await self._execute(good) if good else []
                it = iter(results)
                return [bad[id(r)] if id(r) in bad else next(it) for r in batch]
        return await self._execute(batch)

    def _check_strings(self, batch: list[ExecRequest]) -> dict[int, InferError]:
        """Requests whose string inputs are not UTF-8 -> their 400 (ORT would 500)."""
        bad: dict[int, InferError] = {}
        for r in batch:
            for name in self._string_inputs:
                arr = r.inputs.get(name)
                if arr is None or not arr.size:
                    continue
                for i, item in enumerate(arr.reshape(-1)):
                    if not isinstance(item, bytes):
                        continue
                    try:
                        item.decode("utf-8")
                    except UnicodeDecodeError as e:
                        bad[id(r)] = InferError(
                            f"input '{name}' element {i} is not valid UTF-8 (byte {e.start}: "
                            f"{item[e.start : e.start + 4]!r}); this model's string inputs "
                            "must be UTF-8 text",
                            400,
                        )
                        break
                if id(r) in bad:
                    break
        return bad

    async def _execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        inputs = merge_batch(batch, self._ragged)
        if self._batch_inputs:
            inputs = {**inputs, **batch_input_tensors(self._batch_inputs, batch)}
        feeds: dict[str, np.ndarray] = {}
        rows = sum(r.batch_size for r in batch)
        for name, arr in inputs.items():
            if name in self._reshape:
                shape = ([rows] if self._batching else []) + self._reshape[name]
                arr = arr.reshape(shape)
            if name in self._string_inputs:
                arr = (
                    np.vectorize(
                        lambda b: b.decode("utf-8") if isinstance(b, bytes) else b,
                        otypes=[object],
                    )(arr)
                    if arr.size
                    else arr
                )
            feeds[name] = arr
        wanted: list[str] = []
        for r in batch:
            for n in r.output_names:
                if n not in wanted:
                    wanted.append(n)
        try:
            if self._mode == "loop" or (
                self._mode == "auto" and 0.0 < self._avg_run_s < INLINE_RUN_MAX_S
            ):
                start = time.perf_counter()
                outputs = self._run(feeds, wanted)
                took = time.perf_counter() - start
                self._note_duration(took)
                if self._mode == "auto" and took > INLINE_STICKY_LIMIT_S:
                    # an input-dependent model just blocked the loop: never again
                    self._mode = "thread"
                    log.info("%s: a %.1f ms run moved it to its own thread", self.name, took * 1e3)
            else:
                if self._closed:
                    raise _Closed
                loop = asyncio.get_running_loop()
                try:
                    outputs = await loop.run_in_executor(
                        self._executor, self._timed_run, feeds, wanted
                    )
                except RuntimeError as e:
                    if "shutdown" in str(e) and self._executor._shutdown:  # type: ignore[attr-defined]
                        raise _Closed from None
                    raise
        except _Closed:
            raise unavailable(
                f"model instance '{self.name}' is unloading: the request did not run"
            ) from None
        except Exception as e:  # ORT raises its own exception types
            raise InferError(f"onnxruntime execution failed: {e}", 500) from e
        for n in wanted:
            if n in self._string_outputs:
                outputs[n] = to_bytes_object_array(np.asarray(outputs[n], dtype=object))
            if n in self._out_reshape:
                dims = self._out_reshape[n]
                outputs[n] = outputs[n].reshape(([rows] if self._batching else []) + dims)
        return split_batch(batch, outputs)

    async def close(self) -> None:
        """Stop the instance's thread and drop the session."""
        self._closed = True
        self._executor.shutdown(wait=True)
        self.session = None
