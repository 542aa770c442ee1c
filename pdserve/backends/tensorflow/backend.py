"""TensorFlow backend (``platform: "tensorflow_savedmodel"`` / ``backend: "tensorflow"``).

Serves a SavedModel folder (``<version>/model.savedmodel/`` or ``default_model_filename``)
through its signature (:mod:`~pdserve.backends.tensorflow.savedmodel`), auto-completing
the configuration from it with Triton's rules (every tensor with a variable first
dimension: the model can batch). TensorFlow is imported when the first such model
loads. The SavedModel is loaded once per device and shared by that device's instances
(Triton's ``MAX_SESSION_SHARE_COUNT`` sharing); each instance runs batches on its own
thread, or inline on the event loop while its runs are short
(:class:`~pdserve.backends.base.InlineRuns`; always on its thread under a host policy). ``TF_NUM_INTRA_THREADS`` / ``TF_NUM_INTER_THREADS`` set TensorFlow's
process-wide thread pools (before TensorFlow first runs; later values are ignored).
``instance_group``: ``KIND_CPU``; ``KIND_GPU`` on ``/GPU:<id>`` when TensorFlow sees that
GPU (``tensorflow-cpu`` never does: the load then fails saying so).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from typing import Any

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import (
    Backend,
    ExecRequest,
    ExecResult,
    InlineRuns,
    ModelInstance,
    ModelSpec,
    execute_on_thread,
    gather_loads,
    merge_batch,
    split_batch,
    wanted_outputs,
)
from pdserve.backends.host_policy import name_current_thread, pin_current_thread
from pdserve.backends.instance_plan import instance_plans
from pdserve.backends.onnxruntime.autocomplete import autocomplete_from_io
from pdserve.backends.tensorflow.savedmodel import Signature, import_tf, load_signature
from pdserve.core.errors import internal

log = logging.getLogger("pdserve.tensorflow")

_THREADS = {
    "TF_NUM_INTRA_THREADS": "set_intra_op_parallelism_threads",
    "TF_NUM_INTER_THREADS": "set_inter_op_parallelism_threads",
}


#: A batch runs inline on the event loop while the instance's average run is shorter
#: (seconds). Longer than the default: handing a signature call to the instance's
#: thread and back costs about as much as a small Keras model's whole run.
INLINE_RUN_MAX_S = 0.001


def apply_threads(cfg: cfgmod.ModelConfig) -> None:
    """Set TensorFlow's thread pools from ``TF_NUM_INTRA_THREADS`` / ``TF_NUM_INTER_THREADS``.

    Raises:
        ValueError: a value that is not a non-negative number.
    """
    tf = import_tf()
    for key, setter in _THREADS.items():
        value = (cfgmod.get_parameter(cfg, key) or "").strip()
        if not value:
            continue
        if not value.isdigit():
            raise ValueError(f"parameter '{key}' must be a non-negative number, got '{value}'")
        try:
            getattr(tf.config.threading, setter)(int(value))
        except RuntimeError:
            log.warning(
                "%s: %s=%s ignored: TensorFlow's thread pools are set once per process, "
                "before it first runs",
                cfg.name,
                key,
                value,
            )


def tf_gpus() -> list[int]:
    """The GPU ids TensorFlow sees (none with ``tensorflow-cpu``)."""
    tf = import_tf()
    return list(range(len(tf.config.list_physical_devices("GPU"))))


def _gpu_problem(group: str, gpus: list[int]) -> str | None:
    tf = import_tf()
    have = tf_gpus()
    missing = [g for g in gpus if g not in have]
    if not missing:
        return None
    build = "" if tf.test.is_built_with_cuda() else " (this is a CPU-only build)"
    return (
        f"instance group '{group}' asks for KIND_GPU on {', '.join(f'/GPU:{g}' for g in missing)},"
        f" but TensorFlow {tf.__version__}{build} sees {len(have)} GPU(s); install "
        "tensorflow[and-cuda] on a machine with an NVIDIA GPU, or use KIND_CPU"
    )


class TensorFlowBackend(Backend):
    """Loads TensorFlow SavedModels."""

    name = cfgmod.TENSORFLOW_BACKEND

    def usable_gpus(self) -> list[int]:
        """The GPUs TensorFlow sees."""
        return tf_gpus()

    async def auto_complete(self, spec: ModelSpec) -> None:
        """Complete and check the configuration from the signature (Triton's rules),
        TensorFlow's import and the load on a worker thread.

        Raises:
            pdserve.config.ConfigError: the configuration disagrees with the signature.
            RuntimeError: TensorFlow cannot load the SavedModel (names the folder).
        """

        def complete() -> None:
            path = cfgmod.find_model_file(spec.config, spec.version_dir)
            sig = load_signature(spec.config, path, spec.name)
            batching = all(s and s[0] in (None, -1) for _, _, s in sig.inputs + sig.outputs)
            autocomplete_from_io(
                spec.config,
                sig.inputs,
                sig.outputs,
                batching,
                str(spec.model_dir / cfgmod.CONFIG_FILENAME),
            )

        await asyncio.to_thread(complete)

    async def load(self, spec: ModelSpec) -> list[ModelInstance]:
        """Load the SavedModel once per device; one thread per instance.

        Raises:
            RuntimeError: a SavedModel TensorFlow cannot load, a missing signature,
                or a KIND_GPU group TensorFlow cannot serve (messages name the model).
            ValueError: a malformed thread parameter.
        """
        cfg = spec.config
        await asyncio.to_thread(apply_threads, cfg)
        plans = await asyncio.to_thread(
            instance_plans, spec, self.name, await asyncio.to_thread(tf_gpus), _gpu_problem
        )
        path = cfgmod.find_model_file(cfg, spec.version_dir)
        signatures: dict[str | None, Signature] = {}
        for plan in plans:
            device = None if plan.gpu is None else f"/GPU:{plan.gpu}"
            if device not in signatures:
                signatures[device] = await asyncio.to_thread(
                    load_signature, cfg, path, spec.name, device
                )
        loop = asyncio.get_running_loop()
        executors: list[concurrent.futures.ThreadPoolExecutor] = []
        futures = []
        for i, plan in enumerate(plans):
            name = f"{spec.name}_{i}"
            executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
            executors.append(executor)

            def start(cores: frozenset[int] | None = plan.cores, name: str = name) -> None:
                if cores:
                    pin_current_thread(cores)
                    name_current_thread(name)

            futures.append(loop.run_in_executor(executor, start))
        await gather_loads(futures, executors)
        return [
            TensorFlowInstance(
                f"{spec.name}_{i}",
                plan.kind,
                signatures[None if plan.gpu is None else f"/GPU:{plan.gpu}"],
                None if plan.gpu is None else f"/GPU:{plan.gpu}",
                spec,
                executor,
                pinned=bool(plan.cores),
            )
            for i, (plan, executor) in enumerate(zip(plans, executors, strict=True))
        ]


class TensorFlowInstance(ModelInstance):
    """One instance of a SavedModel signature, run on its own thread or inline while its
    runs are short (:class:`~pdserve.backends.base.InlineRuns`).

    Args:
        name: instance name (``<model>_<n>``).
        kind: ``KIND_CPU`` / ``KIND_GPU``.
        signature: the loaded signature (shared by the device's instances).
        device: the TensorFlow device (``/GPU:0``) or None (CPU).
        spec: the model version.
        executor: the instance's one-thread executor.
        pinned: the thread is pinned by a host policy: every batch runs there.
    """

    def __init__(
        self,
        name: str,
        kind: str,
        signature: Signature,
        device: str | None,
        spec: ModelSpec,
        executor: concurrent.futures.ThreadPoolExecutor,
        pinned: bool = False,
    ) -> None:
        self.name = name
        self.kind = kind
        self.signature: Signature | None = signature
        self._device = device
        self._model = spec.name
        self._executor = executor
        self.runs = InlineRuns(name, "thread" if pinned else "auto", INLINE_RUN_MAX_S)
        self._closed = False
        self._tf = import_tf()
        #: inline runs use the single-threaded executor (until the graph turns out not to fit it)
        self.single_threaded = device is None

    def _run(
        self, feeds: dict[str, np.ndarray], wanted: list[str], inline: bool = False
    ) -> dict[str, np.ndarray]:
        assert self.signature is not None
        tf = self._tf
        with tf.device(self._device or "/CPU:0"):
            if inline and self.single_threaded:
                result = self._call_single_threaded(feeds)
            else:
                result = self.signature.run(feeds)
        out: dict[str, np.ndarray] = {}
        for n in wanted:
            value = result[n].numpy()
            out[n] = value.astype(object) if value.dtype.kind == "S" else value
        return out

    def _call_single_threaded(self, feeds: dict[str, np.ndarray]) -> Any:
        """An inline run on TensorFlow's single-threaded function executor, which runs
        every kernel on the calling thread (the default one hands each call's kernels
        to the inter-op pool and waits for them, which for a short run costs more than
        the kernels). A graph it cannot run (v1 control flow, ``tf.cond``, reference
        edges) moves the instance to the default executor for good."""
        assert self.signature is not None
        try:
            return self.signature.run(feeds, single_threaded=True)
        except self._tf.errors.OpError as e:
            if "Single-threaded executor" not in str(e):
                raise
        log.info("%s: the graph needs TensorFlow's default executor", self.name)
        self.single_threaded = False
        return self.signature.run(feeds)

    def _timed_run(  # on the instance's thread
        self, feeds: dict[str, np.ndarray], wanted: list[str]
    ) -> dict[str, np.ndarray]:
        mark = self.runs.start_on_thread()
        try:
            return self._run(feeds, wanted)
        finally:
            self.runs.ran_on_thread(mark)

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        """Merge the batch, call the signature (inline or on the instance's thread, as
        :attr:`runs` says), split the outputs.

        A batch that reaches an instance already closed gets a 503; a TensorFlow error a
        500 naming the model.
        """
        runs = self.runs
        if not runs.inline():
            return await execute_on_thread(
                batch, self._executor, self._closed, self.name, self._timed_run, self._failure
            )
        inputs, wanted = merge_batch(batch), wanted_outputs(batch)
        mark = runs.start(self._closed)
        try:
            outputs = self._run(inputs, wanted, inline=True)
        except Exception as e:
            raise internal(self._failure(e)) from e
        finally:
            runs.ran_inline(mark)
        return split_batch(batch, outputs)

    def _failure(self, e: Exception) -> str:
        text = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        first = text[0] if text else ""
        return f"tensorflow execution of model '{self._model}' failed: {type(e).__name__}: {first}"

    async def close(self) -> None:
        """Stop the instance's thread and drop its reference to the SavedModel."""
        self._closed = True
        self._executor.shutdown(wait=True)
        self.signature = None


def run_signature(sig: Signature, inputs: dict[str, np.ndarray]) -> dict[str, Any]:
    """Call ``sig`` once on ``inputs`` in the calling thread (numpy results by name)."""
    return {n: t.numpy() for n, t in sig.run(inputs).items()}
