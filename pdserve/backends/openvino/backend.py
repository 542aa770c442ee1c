"""OpenVINO backend (``backend: "openvino"``), as Triton's openvino backend.

Reads ``<version>/model.xml`` (+ ``model.bin``) or ``default_model_filename`` (an ONNX
file, ``model.saved_model/``... whatever ``Core.read_model`` reads), auto-completes and
checks the configuration (:mod:`~pdserve.backends.openvino.model`), applies the
``parameters`` (:mod:`~pdserve.backends.openvino.options`) and compiles the model once
per device; each instance has its own infer request and runs batches on its own
thread (pinned to its host policy's cores), OpenVINO releasing the GIL while it runs.

``instance_group``: ``KIND_CPU`` on ``TARGET_DEVICE`` (default ``CPU``); ``KIND_GPU`` on
OpenVINO's ``GPU.<id>`` devices (Intel GPUs; NVIDIA GPUs are not OpenVINO devices), a
clear load error where OpenVINO sees none. Triton's backend takes ``KIND_CPU`` only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import (
    Backend,
    ExecRequest,
    ExecResult,
    ModelInstance,
    ModelSpec,
    execute_on_thread,
    gather_loads,
)
from pdserve.backends.host_policy import name_current_thread, pin_current_thread
from pdserve.backends.instance_plan import InstancePlan, instance_plans
from pdserve.backends.openvino.model import complete_config, pad_batch, prepare_model, read_model
from pdserve.backends.openvino.options import CPU_PRECISION, Options
from pdserve.core.errors import internal

if TYPE_CHECKING:
    import openvino as ov

log = logging.getLogger("pdserve.openvino")


def _core(opts: Options) -> ov.Core:
    import openvino

    core = openvino.Core()
    if opts.cpu_extension_path:
        core.add_extension(opts.cpu_extension_path)
    return core


def openvino_gpus(core: ov.Core | None = None) -> list[int]:
    """The ids of the GPU devices OpenVINO sees here (``GPU`` is ``GPU.0``)."""
    import openvino

    devices = (core or openvino.Core()).available_devices
    ids = []
    for d in devices:
        if d == "GPU":
            ids.append(0)
        elif d.startswith("GPU."):
            ids.append(int(d.split(".", 1)[1]))
    return sorted(set(ids))


def _gpu_problem(group: str, gpus: list[int]) -> str | None:
    import openvino

    core = openvino.Core()
    have = openvino_gpus(core)
    missing = [g for g in gpus if g not in have]
    if not missing:
        return None
    return (
        f"instance group '{group}' asks for KIND_GPU ({', '.join(f'GPU.{g}' for g in missing)}),"
        f" but OpenVINO sees no such GPU device here (its devices: "
        f"{', '.join(core.available_devices) or 'none'}); OpenVINO runs on CPUs and Intel "
        "GPUs (an NVIDIA GPU is not an OpenVINO device): use KIND_CPU, or serve the model "
        "through onnxruntime or pytorch on an NVIDIA GPU"
    )


def _device(plan: InstancePlan, opts: Options) -> str:
    return opts.target_device if plan.gpu is None else f"GPU.{plan.gpu}"


class OpenVinoBackend(Backend):
    """Loads OpenVINO IR (and ONNX, ...) models with the OpenVINO runtime."""

    name = cfgmod.OPENVINO_BACKEND

    def usable_gpus(self) -> list[int]:
        """OpenVINO's GPU devices (Intel GPUs), not CUDA's."""
        return openvino_gpus()

    async def auto_complete(self, spec: ModelSpec) -> None:
        """Complete and check the configuration against the model (on a worker thread:
        reading a large model takes seconds).

        Raises:
            pdserve.config.ConfigError: the configuration disagrees with the model.
            RuntimeError: OpenVINO cannot read the model file (names the file).
            FileNotFoundError: no model file.
        """

        def complete() -> None:
            path = cfgmod.find_model_file(spec.config, spec.version_dir)
            opts = Options.from_config(spec.config)
            model = read_model(_core(opts), path, spec.name)
            complete_config(spec.config, model, spec.model_dir / cfgmod.CONFIG_FILENAME)

        await asyncio.to_thread(complete)

    async def load(self, spec: ModelSpec) -> list[ModelInstance]:
        """Compile the model once per device, then one infer request per instance.

        Raises:
            RuntimeError: a file OpenVINO cannot read or compile, a reshape it refuses,
                or a KIND_GPU group with no OpenVINO GPU (messages name the model).
            ValueError: a malformed parameter.
        """
        cfg = spec.config
        opts = Options.from_config(cfg)
        plans = await asyncio.to_thread(
            instance_plans, spec, self.name, self.usable_gpus(), _gpu_problem
        )
        path = cfgmod.find_model_file(cfg, spec.version_dir)
        core = _core(opts)

        def compile_for(device: str) -> Any:
            model = prepare_model(read_model(core, path, spec.name), cfg, opts)
            props = dict(opts.properties)
            if device == "CPU":
                props = CPU_PRECISION | props
            props["ALLOW_AUTO_BATCHING"] = bool(
                cfg.max_batch_size and not opts.skip_dynamic_batchsize
            )
            try:
                return core.compile_model(model, device, props)
            except Exception as e:
                text = str(e).strip().splitlines()
                raise RuntimeError(
                    f"model '{spec.name}': OpenVINO cannot compile {path} for device "
                    f"{device}: {text[0] if text else type(e).__name__}"
                ) from e

        compiled: dict[str, Any] = {}
        for device in dict.fromkeys(_device(p, opts) for p in plans):
            compiled[device] = await asyncio.to_thread(compile_for, device)
        loop = asyncio.get_running_loop()
        executors: list[concurrent.futures.ThreadPoolExecutor] = []
        futures = []
        for i, plan in enumerate(plans):
            name = f"{spec.name}_{i}"
            executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
            executors.append(executor)
            target = compiled[_device(plan, opts)]

            def make(
                model: Any = target,
                cores: frozenset[int] | None = plan.cores,
                name: str = name,
            ) -> Any:
                if cores:
                    pin_current_thread(cores)
                    name_current_thread(name)
                return model.create_infer_request()

            futures.append(loop.run_in_executor(executor, make))
        requests = await gather_loads(futures, executors)
        log.info("%s: %s compiled for %s", spec.name, path.name, ", ".join(compiled))
        return [
            OpenVinoInstance(f"{spec.name}_{i}", plan.kind, request, spec, opts, executor)
            for i, (plan, request, executor) in enumerate(
                zip(plans, requests, executors, strict=True)
            )
        ]


class OpenVinoInstance(ModelInstance):
    """One infer request of a compiled model, run on its own thread.

    Args:
        name: instance name (``<model>_<n>``).
        kind: ``KIND_CPU`` / ``KIND_GPU``.
        request: the ``openvino.InferRequest``.
        spec: the model version.
        opts: the model's OpenVINO settings.
        executor: the instance's one-thread executor.
    """

    def __init__(
        self,
        name: str,
        kind: str,
        request: Any,
        spec: ModelSpec,
        opts: Options,
        executor: concurrent.futures.ThreadPoolExecutor,
    ) -> None:
        self.name = name
        self.kind = kind
        self.request = request
        self._model = spec.name
        self._executor = executor
        mbs = spec.config.max_batch_size
        #: the fixed batch size the graph takes (SKIP_OV_DYNAMIC_BATCHSIZE), or 0
        self._fixed_batch = mbs if mbs > 0 and opts.skip_dynamic_batchsize else 0
        self._padding = opts.enable_batch_padding
        self._closed = False

    def _run(self, feeds: dict[str, np.ndarray], wanted: list[str]) -> dict[str, np.ndarray]:
        rows = next(iter(feeds.values())).shape[0] if self._fixed_batch and feeds else 0
        if self._fixed_batch and rows != self._fixed_batch:
            if not self._padding:
                raise internal(
                    f"expected requests with batch size '{self._fixed_batch}', got '{rows}'... "
                    "this error can be avoided by setting 'ENABLE_BATCH_PADDING' parameter in "
                    "model configuration to 'YES' at a performance cost."
                )
            feeds = {n: pad_batch(a, self._fixed_batch) for n, a in feeds.items()}
        result = self.request.infer(feeds, share_inputs=False, share_outputs=False)
        out = {n: np.asarray(result[n]) for n in wanted}
        if self._fixed_batch and rows != self._fixed_batch:
            out = {n: a[:rows] for n, a in out.items()}
        return out

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        """Merge the batch, infer on the instance's thread, split the outputs.

        A batch that reaches an instance already closed gets a 503; an OpenVINO error
        a 500 naming the model.
        """
        return await execute_on_thread(
            batch, self._executor, self._closed, self.name, self._run, self._failure
        )

    def _failure(self, e: Exception) -> str:
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        last = lines[-1] if lines else type(e).__name__
        return f"openvino execution of model '{self._model}' failed: {last}"

    async def close(self) -> None:
        """Stop the instance's thread and drop its infer request."""
        self._closed = True
        self._executor.shutdown(wait=True)
        self.request = None


def model_path(spec: ModelSpec) -> Path:
    """The version's model file (``model.xml`` or ``default_model_filename``)."""
    return cfgmod.find_model_file(spec.config, spec.version_dir)
