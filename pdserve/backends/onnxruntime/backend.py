"""ONNX Runtime backend (``platform: "onnxruntime_onnx"`` / ``backend: "onnxruntime"``).

Each model instance is one ``onnxruntime.InferenceSession``, run on its own thread
(ORT releases the GIL) or, for a sub-millisecond model, on the event loop. Instance
kinds: ``KIND_CPU``, ``KIND_GPU`` (``CUDAExecutionProvider`` on the listed GPUs; no
CUDA provider or a GPU not visible fails the load, never falls back to CPU) and
``KIND_AUTO``. Session options come from Triton's onnxruntime-backend keys:
``intra_op_thread_count`` (default: the CPUs, or the host policy's cores, shared among
the model's instances), ``inter_op_thread_count``, ``execution_mode`` and the graph
optimization level (:func:`session_options`).

An instance with a host policy runs on its own thread, pinned to the policy's cores
before it creates the session; its intra-op threads stay inside them
(:func:`intra_op_affinities`; the count is always set, as ORT pins a 0-count pool itself).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
from collections.abc import Collection
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import (
    Backend,
    ExecRequest,
    ExecResult,
    InlineRuns,
    ModelInstance,
    ModelSpec,
    batch_input_tensors,
    gather_loads,
    merge_batch,
    run_on_thread,
    split_batch,
    wanted_outputs,
)
from pdserve.backends.devices import check_gpu_ids, visible_gpus
from pdserve.backends.host_policy import (
    format_cpu_list,
    instance_cores,
    name_current_thread,
    pin_current_thread,
)
from pdserve.backends.onnxruntime.autocomplete import complete_from_session
from pdserve.config import ModelConfig
from pdserve.core import tracing
from pdserve.core.datatypes import to_bytes_object_array
from pdserve.core.errors import InferError, internal

if TYPE_CHECKING:
    import onnxruntime

log = logging.getLogger("pdserve.onnxruntime")

#: The ONNX Runtime execution provider that runs a session on a CUDA GPU.
CUDA_PROVIDER = "CUDAExecutionProvider"
#: An execution provider as ``InferenceSession`` takes it: its name, or (name, options).
Provider = str | tuple[str, dict[str, int]]

#: ``auto`` runs a session inline on the event loop while its average run is shorter.
INLINE_RUN_MAX_S = 0.0002


_LEVELS = {"disable": 0, "basic": 1, "extended": 2, "all": 99}


def _ort() -> ModuleType:
    import onnxruntime

    return onnxruntime


def session_options(config: ModelConfig) -> onnxruntime.SessionOptions:
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


def default_intra_op_threads(instances: int, cores: Collection[int] | None = None) -> int:
    """Intra-op threads per session when the config sets none: the CPUs this
    process may use (its affinity mask), shared among the model's instances, at
    least 1.

    ORT's own default (one thread per core for every session) oversubscribes the
    cores as soon as a model has several instances — Triton's default for a CPU
    ONNX model is two — and its spinning threads then fight over them.

    Args:
        instances: how many sessions share the CPUs.
        cores: the host policy's cores when the instances are pinned; then those
            are shared instead of the process's CPUs.
    """
    if cores:
        return max(1, len(cores) // max(1, instances))
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, instances))


#: ORT session config key giving each intra-op pool thread its processors.
INTRA_OP_AFFINITIES_KEY = "session.intra_op_thread_affinities"


def intra_op_affinities(cores: Collection[int], threads: int) -> str:
    """The ``session.intra_op_thread_affinities`` value that keeps every intra-op
    pool thread on ``cores``.

    ORT's format (checked with onnxruntime 1.32 on Linux): one entry per pool
    thread, i.e. ``threads - 1`` entries (the calling thread is the first of the
    ``intra_op_num_threads``), separated by ``;``; each entry a ``,`` list of
    processor ids or ``a-b`` ranges, **1-based** (``1`` is CPU 0; ``0`` is refused:
    "Processor id must start from 1"). ``cores={1}, threads=3`` -> ``"2;2"``.

    Returns:
        the value, or ``""`` when ``threads <= 1`` (no pool thread: set nothing).
    """
    if threads <= 1:
        return ""
    entry = ",".join(str(c + 1) for c in sorted(cores))
    return ";".join([entry] * (threads - 1))


class OnnxRuntimeBackend(Backend):
    """Loads ``model.onnx`` (or ``default_model_filename``) into ORT sessions."""

    name = cfgmod.ONNXRUNTIME_BACKEND

    def usable_gpus(self) -> list[int]:
        """The visible GPUs (:func:`pdserve.backends.devices.visible_gpus`) when this
        onnxruntime build has the CUDA execution provider, else none."""
        if CUDA_PROVIDER not in _ort().get_available_providers():
            return []
        return visible_gpus()

    def _model_path(self, spec: ModelSpec) -> str:
        return str(cfgmod.find_model_file(spec.config, spec.version_dir))

    async def auto_complete(self, spec: ModelSpec) -> None:
        """Complete and check the config against the graph's inputs and outputs
        (:mod:`pdserve.backends.onnxruntime.autocomplete`).

        The session (import of onnxruntime, graph load: seconds for a large model)
        is built in a worker thread, so the event loop keeps answering health and
        inference requests while a model loads.

        Raises:
            pdserve.config.ConfigError: dims/datatypes disagree, unknown tensors,
                or batching asked of a graph whose first dim is fixed.
        """

        def complete() -> None:
            ort = _ort()
            sess = ort.InferenceSession(self._model_path(spec), providers=["CPUExecutionProvider"])
            complete_from_session(
                spec.config, sess, spec.model_dir / cfgmod.CONFIG_FILENAME, str(spec.version_dir)
            )

        await asyncio.to_thread(complete)

    def _instance_plans(
        self, spec: ModelSpec, available: list[str]
    ) -> list[tuple[str, list[Provider], frozenset[int] | None]]:
        """(kind, execution providers, host policy cores or None) of each instance of
        ``instance_group``, in order.

        Raises:
            RuntimeError: KIND_GPU without a CUDAExecutionProvider, a GPU this process
                cannot see, or a kind onnxruntime does not run.
        """
        groups = list(spec.config.instance_group) or [None]
        plans: list[tuple[str, list[Provider], frozenset[int] | None]] = []
        for group in groups:
            count = group.count if group is not None and group.count > 0 else 1
            kind_name = "KIND_CPU"
            gpus: list[int] = [0]
            gname = spec.name
            if group is not None:
                from tritonclient.grpc import model_config_pb2 as mc

                kind_name = mc.ModelInstanceGroup.Kind.Name(group.kind)
                gpus = list(group.gpus) or [0]
                gname = group.name or gname
            if kind_name == "KIND_AUTO":
                kind_name = "KIND_GPU" if self.usable_gpus() else "KIND_CPU"
            if kind_name == "KIND_GPU":
                if CUDA_PROVIDER not in available:
                    raise RuntimeError(
                        "instance_group asks for KIND_GPU but this onnxruntime has no "
                        f"CUDAExecutionProvider (available: {', '.join(available)}); install "
                        "onnxruntime-gpu on a machine with a CUDA GPU, or use KIND_CPU"
                    )
                check_gpu_ids(gname, gpus)
                for gpu in gpus:
                    cores = instance_cores(spec.host_policies, group, gpu)
                    for _ in range(count):
                        plans.append(
                            (
                                "KIND_GPU",
                                [
                                    (CUDA_PROVIDER, {"device_id": gpu}),
                                    "CPUExecutionProvider",
                                ],
                                cores,
                            )
                        )
            elif kind_name in ("KIND_CPU", "KIND_MODEL"):
                cores = instance_cores(spec.host_policies, group, 0)
                plans.extend(("KIND_CPU", ["CPUExecutionProvider"], cores) for _ in range(count))
            else:
                raise RuntimeError(
                    f"instance_group kind {kind_name} is not supported by onnxruntime"
                )
        return plans

    async def load(self, spec: ModelSpec) -> list[ModelInstance]:
        """Create one ORT session per instance in ``instance_group``.

        Raises:
            RuntimeError: KIND_GPU asked but no CUDAExecutionProvider is available,
                or on a GPU this process cannot see
                (:func:`pdserve.backends.devices.check_gpu_ids`).
            ValueError: bad session option parameters.
        """
        ort = _ort()
        path = self._model_path(spec)
        plans = self._instance_plans(spec, ort.get_available_providers())
        configured = cfgmod.get_parameter(spec.config, "intra_op_thread_count")
        loop = asyncio.get_running_loop()
        executors: list[concurrent.futures.ThreadPoolExecutor | None] = []
        futures = []
        for i, (_, providers, cores) in enumerate(plans):
            so = session_options(spec.config)
            if cores:
                # ORT pins a 0-count pool to cores of its own choosing: always set it.
                if not configured or so.intra_op_num_threads <= 0:
                    sharing = sum(1 for p in plans if p[2] == cores)
                    so.intra_op_num_threads = default_intra_op_threads(sharing, cores)
                value = intra_op_affinities(cores, so.intra_op_num_threads)
                if value:
                    so.add_session_config_entry(INTRA_OP_AFFINITIES_KEY, value)
                # pinned by make() below, not by an initializer: a refused pin then
                # fails the load with its own message (not "the thread pool is not
                # usable anymore"); the executor's one thread runs every later batch
                executor = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix=f"{spec.name}_{i}"
                )
            else:
                if not configured:
                    so.intra_op_num_threads = default_intra_op_threads(len(plans))
                executor = None
            executors.append(executor)

            def make(
                providers: list[Provider] = providers,
                so: onnxruntime.SessionOptions = so,
                cores: frozenset[int] | None = cores,
                name: str = f"{spec.name}_{i}",
            ) -> onnxruntime.InferenceSession:
                if cores:
                    _start_pinned_thread(name, cores)
                return ort.InferenceSession(path, sess_options=so, providers=providers)

            # A pinned instance creates its session on its own (pinned) thread: the
            # pool threads ORT starts there inherit the mask.
            futures.append(loop.run_in_executor(executor, make))
        sessions = await gather_loads(futures, executors)
        return [
            OnnxRuntimeInstance(f"{spec.name}_{i}", kind, sess, spec, cores, executor)
            for i, ((kind, _, cores), sess, executor) in enumerate(
                zip(plans, sessions, executors, strict=True)
            )
        ]


def _start_pinned_thread(name: str, cores: frozenset[int]) -> None:
    pin_current_thread(cores)
    name_current_thread(name)


def _pinned_executor(name: str, cores: frozenset[int]) -> concurrent.futures.ThreadPoolExecutor:
    """A one-thread executor whose thread pins itself to ``cores`` when it starts.

    The thread also takes the instance name as its kernel name (``comm``), which
    the ORT pool threads it creates inherit: ``/proc/<pid>/task/*/status`` (or
    ``top -H``) shows which threads belong to which instance.
    """
    return concurrent.futures.ThreadPoolExecutor(
        1, thread_name_prefix=name, initializer=_start_pinned_thread, initargs=(name, cores)
    )


class OnnxRuntimeInstance(ModelInstance):
    """One ORT session, run on its own thread, or on the event loop while its runs are
    shorter than :data:`INLINE_RUN_MAX_S` (``execution_thread`` ``auto``, the default).

    Args:
        cores: the host policy's cores, or None. With cores the session always
            runs on the instance's thread, pinned to them (``execution_thread``
            ``auto``/``loop`` are overridden).
        executor: the instance's one-thread executor (for a pinned instance, the
            one whose thread created the session); None creates one.

    Raises:
        ValueError: ``execution_thread`` is not ``auto``, ``loop`` or ``thread``.
    """

    def __init__(
        self,
        name: str,
        kind: str,
        session: onnxruntime.InferenceSession,
        spec: ModelSpec,
        cores: frozenset[int] | None = None,
        executor: concurrent.futures.ThreadPoolExecutor | None = None,
    ) -> None:
        self.name = name
        self.kind = kind
        self.session = session
        #: the CPU ids this instance's thread is pinned to (host policy), or None.
        self.cores = cores
        if executor is None:
            executor = (
                _pinned_executor(name, cores)
                if cores
                else concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
            )
        self._executor = executor
        cfg = spec.config
        self._batching = cfg.max_batch_size > 0
        self._string_inputs = {a.name for a in session.get_inputs() if a.type == "tensor(string)"}
        self._string_outputs = {a.name for a in session.get_outputs() if a.type == "tensor(string)"}
        # ``reshape`` is applied for every backend: inputs when the request is checked
        # (ModelVersion.prepare), outputs by the scheduler's output check
        # (pdserve.scheduling.base.OutputCheck). A scalar graph output of a non-batching model gets
        # the configured shape (all 1s), as in Triton's onnxruntime backend.
        self._scalar_outputs: dict[str, tuple[int, ...]] = {}
        if not self._batching:
            for o in cfg.output:
                shape = tuple(o.reshape.shape) if o.HasField("reshape") else tuple(o.dims)
                if shape and all(d == 1 for d in shape):
                    self._scalar_outputs[o.name] = shape
        self._all_outputs = [o.name for o in session.get_outputs()]
        #: allow_ragged_batch inputs (flattened, concatenated) and batch_input entries.
        self._ragged = frozenset(i.name for i in cfg.input if i.allow_ragged_batch)
        self._batch_inputs = list(cfg.batch_input)
        mode = cfgmod.get_parameter(cfg, "execution_thread", "auto")
        if mode not in ("auto", "loop", "thread"):
            raise ValueError(f"execution_thread '{mode}' is not one of auto, loop, thread")
        if cores and mode != "thread":
            if mode == "loop":
                log.warning(
                    "%s: execution_thread 'loop' is overridden by its host policy: the "
                    "session runs on the instance's own thread, pinned to cpu-cores %s",
                    name,
                    format_cpu_list(cores),
                )
            mode = "thread"
        #: where a batch runs (``execution_thread``)
        self.runs = InlineRuns(name, mode, INLINE_RUN_MAX_S)
        self._closed = False

    def _run(self, feeds: dict[str, np.ndarray], names: list[str]) -> dict[str, np.ndarray]:
        values = self.session.run(names, feeds)
        return dict(zip(names, values, strict=True))

    def _timed_run(  # on the instance's thread
        self, feeds: dict[str, np.ndarray], names: list[str]
    ) -> dict[str, np.ndarray]:
        mark = self.runs.start_on_thread()
        try:
            return self._run(feeds, names)
        finally:
            self.runs.ran_on_thread(mark)

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        """Merge the batch, run the session, split the outputs per request.

        Where the session runs (config parameter ``execution_thread``):
        ``thread`` — always on this instance's own thread (ORT releases the GIL, so
        the event loop keeps accepting requests); ``loop`` — on the event loop
        thread; ``auto`` (default) — on the thread, except while the moving average
        run time is under ``INLINE_RUN_MAX_S`` (a sub-0.2 ms model), where handing
        the batch to a thread and back costs more than the run itself. An instance
        under a host policy always runs on its (pinned) thread.

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
                            "must be UTF-8 text"
                        )
                        break
                if id(r) in bad:
                    break
        return bad

    async def _execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        single = len(batch) == 1 and not self._ragged and not self._batch_inputs
        if single:  # one request: its inputs are the feeds, the outputs all its own
            inputs = batch[0].inputs
            wanted = batch[0].output_names
        else:
            inputs = merge_batch(batch, self._ragged)
            if self._batch_inputs:
                inputs = {**inputs, **batch_input_tensors(self._batch_inputs, batch)}
            wanted = wanted_outputs(batch)
        feeds: dict[str, np.ndarray] = {}
        for name, arr in inputs.items():
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
        traced = tracing.state.enabled  # (compute marks exist only in a traced batch)
        if traced:
            tracing.mark_input_end()
        try:
            runs = self.runs
            if runs.inline():
                mark = runs.start(self._closed)
                try:
                    outputs = self._run(feeds, wanted)
                finally:
                    runs.ran_inline(mark)
            else:
                outputs = await run_on_thread(
                    self._executor, self._closed, self.name, self._timed_run, feeds, wanted
                )
        except InferError:
            raise  # unloading: the batch reached a closed instance
        except Exception as e:  # ORT raises its own exception types
            raise internal(f"onnxruntime execution failed: {e}") from e
        if traced:
            tracing.mark_output_start()
        for n in wanted:
            if n in self._string_outputs:
                outputs[n] = to_bytes_object_array(np.asarray(outputs[n], dtype=object))
            if n in self._scalar_outputs and outputs[n].ndim == 0:
                outputs[n] = outputs[n].reshape(self._scalar_outputs[n])
        return [outputs] if single else split_batch(batch, outputs)

    async def close(self) -> None:
        """Stop the instance's thread and drop the session."""
        self._closed = True
        self._executor.shutdown(wait=True)
        self.session = None
