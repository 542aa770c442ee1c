"""PyTorch backend (``platform: "pytorch_libtorch"`` / ``"torch_aoti"``, ``backend: "pytorch"``).

Three forms of model, as in Triton's PyTorch backend: **TorchScript** (``<version>/model.pt``
or ``default_model_filename``, ``torch.jit.load``), **PyTorch 2** (``runtime: "model.py"``:
one ``torch.nn.Module`` subclass built with no arguments, weights in the optional
``model.pt`` state dict) run eagerly, and **exported** models (``torch_aoti``, ``model.pt2``:
:mod:`~pdserve.backends.pytorch.exported`). The configuration lists every input and
output; tensors meet ``forward``'s arguments by Triton's naming
(:mod:`~pdserve.backends.pytorch.naming`); string tensors are refused at load.
``parameters``: :mod:`~pdserve.backends.pytorch.options`. ``instance_group``: ``KIND_CPU``; ``KIND_GPU`` one instance per listed GPU on ``cuda:<id>``
with its own stream and pinned host buffers (a GPU not visible fails the load);
``KIND_AUTO``; ``KIND_MODEL`` where the file put the module. Each instance runs batches
on its own thread (pinned to its host policy's cores) under ``torch.inference_mode()``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import importlib.util
import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass
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
from pdserve.backends.devices import visible_gpu_count, visible_gpus
from pdserve.backends.host_policy import instance_cores, name_current_thread, pin_current_thread
from pdserve.backends.pytorch.exported import (
    check_config_against,
    load_pt2,
    pt2_input_plan,
    pt2_output_plan,
)
from pdserve.backends.pytorch.naming import InputPlan, plan_inputs, plan_outputs
from pdserve.backends.pytorch.options import (
    JIT_SWITCHES,
    SETTINGS,
    Options,
    import_torch,
    parse_count,
    parse_flag,
)
from pdserve.config import ModelConfig
from pdserve.core import datatypes
from pdserve.core.errors import internal

if TYPE_CHECKING:
    import torch
    from torch import Tensor

log = logging.getLogger("pdserve.pytorch")

#: The pdserve extra that installs torch.
EXTRA = "pytorch"
#: ``runtime`` value of Triton's PyTorch 2 form.
PYTHON_RUNTIME = "model.py"
#: The weights file of the PyTorch 2 form.
WEIGHTS_FILENAME = "model.pt"

#: configuration ``data_type`` -> torch dtype attribute (Triton's PyTorch backend's set,
#: strings aside); torch names these dtypes as numpy does.
TORCH_DTYPES: dict[str, str] = {
    datatypes.V2_TO_CONFIG[v2]: datatypes.V2_TO_NUMPY[v2].name
    for v2 in ("BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "FP32", "FP64")
}

# --------------------------------------------------------------------------- checks


def check_config(cfg: ModelConfig, where: str | Path) -> None:
    """Triton's rules for a PyTorch model's configuration.

    Raises:
        pdserve.config.ConfigError: no inputs or no outputs (TorchScript has no
            metadata to complete them from), a datatype torch cannot take here,
            ``batch_input``/``batch_output`` (not served by this backend), naming
            indices that clash, or a malformed parameter.
    """
    for kind, ios in (("input", cfg.input), ("output", cfg.output)):
        if len(ios) == 0:
            raise cfgmod.ConfigError(
                where,
                kind,
                f"a PyTorch model's configuration must list its {kind}s (name, data_type, "
                "dims): a TorchScript file has no metadata to auto-complete them from "
                "(Triton's PyTorch backend requires them too)",
            )
        for i, io in enumerate(ios):
            type_name = cfgmod.model_config_pb2.DataType.Name(io.data_type)
            if type_name not in TORCH_DTYPES:
                raise cfgmod.ConfigError(
                    where,
                    f"{kind}[{i}].data_type",
                    f"{kind} '{io.name}' has data_type {type_name}, which the pytorch backend "
                    f"does not serve (it serves {', '.join(sorted(TORCH_DTYPES))})",
                )
    for field in ("batch_input", "batch_output"):
        if len(getattr(cfg, field)):
            raise cfgmod.ConfigError(
                where, field, f"{field} is not supported by the pytorch backend here"
            )
    for field, check in (
        ("output", lambda: plan_outputs([o.name for o in cfg.output])),
        ("input", lambda: plan_inputs([i.name for i in cfg.input], None)),
    ):
        try:
            check()
        except ValueError as e:
            raise cfgmod.ConfigError(where, field, str(e)) from None
    try:
        Options.from_config(cfg)
        for key in ("INTRA_OP_THREAD_COUNT", "INTER_OP_THREAD_COUNT"):
            parse_count(cfg, key)
        for key in (*JIT_SWITCHES, "ENABLE_TF32", "ENABLE_NVFUSER"):
            parse_flag(cfg, key, True)
    except ValueError as e:
        raise cfgmod.ConfigError(where, "parameters", str(e)) from None


def _gpu_message(model: str, group: str, gpus: list[int]) -> str | None:
    """Why ``cuda:<id>`` for ``gpus`` cannot be used here, or None when they can."""
    torch = import_torch()
    devices = ", ".join(f"cuda:{g}" for g in gpus)
    if torch.version.cuda is None:
        return (
            f"model '{model}' instance group '{group}' asks for KIND_GPU ({devices}), but the "
            f"installed torch {torch.__version__} is a CPU-only build; install a CUDA build "
            f"of torch=={torch.__version__.split('+')[0]} on a machine with an NVIDIA GPU, "
            "or use KIND_CPU"
        )
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    count = min(count, visible_gpu_count()) if count else 0
    missing = [g for g in gpus if not 0 <= g < count]
    if missing:
        return (
            f"model '{model}' instance group '{group}' asks for KIND_GPU on "
            f"{', '.join(f'cuda:{g}' for g in missing)}, but this process sees {count} "
            "CUDA GPU(s) (NVIDIA driver and CUDA_VISIBLE_DEVICES); use KIND_CPU or a "
            "GPU id below that"
        )
    return None


def load_error(model: str, path: Path, error: BaseException) -> RuntimeError:
    """A clear load error for a model file torch cannot read (names model and file)."""
    torch = import_torch()
    text = str(error).strip()
    first = text.splitlines()[0] if text else type(error).__name__
    if "maximum supported version" in text or "version of PyTorch" in text:
        hint = (
            f"it was saved by a newer torch than the {torch.__version__} installed here: "
            "save it again with this torch (or an older one), or upgrade pdserve[pytorch]"
        )
    elif "central directory" in text or "constants.pkl" in text or "zip archive" in text:
        hint = (
            "it is not a TorchScript archive: corrupt or truncated, or written with "
            "torch.save instead of torch.jit.save (trace or script the model, then "
            "torch.jit.save it)"
        )
    else:
        hint = "torch.jit.load refused it"
    return RuntimeError(f"model '{model}': cannot load {path}: {hint} ({first})")


# --------------------------------------------------------------------------- loading


@dataclass
class _Loaded:
    """A module ready to run, and how to call it."""

    module: Any  # a torch.nn.Module; the instance drops it (None) on close
    device: torch.device
    inputs: InputPlan
    scripted: bool


def _forward_signature(module: Any, scripted: bool) -> tuple[list[str] | None, bool]:
    """``forward``'s argument names (without ``self``) and whether it takes one
    ``Dict[str, Tensor]``; (None, False) when they cannot be read."""
    if scripted:
        try:
            args = list(module.forward.schema.arguments)[1:]
        except (AttributeError, RuntimeError):
            return None, False
        names = [a.name for a in args]
        is_dict = len(args) == 1 and str(args[0].type).replace(" ", "").startswith("Dict[str,")
        return names, is_dict
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None, False
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
        return None, False
    names = [p.name for p in params]
    ann = str(params[0].annotation) if len(params) == 1 else ""
    return names, ann.replace(" ", "").lower().startswith(("dict[str,", "typing.dict[str,"))


def _import_model_py(spec: ModelSpec, path: Path) -> type:
    """Import ``model.py`` and return the one ``torch.nn.Module`` subclass it defines.

    Raises:
        RuntimeError: importing raised, or it defines no / several module classes.
    """
    torch = import_torch()
    name = f"pdserve_pytorch_{spec.name}_{spec.version}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise RuntimeError(f"model '{spec.name}': cannot import {path}")
    mod = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(mod)
    except Exception as e:
        raise RuntimeError(
            f"model '{spec.name}': importing {path} raised {type(e).__name__}: {e}"
        ) from e
    classes = [
        c
        for c in vars(mod).values()
        if isinstance(c, type) and issubclass(c, torch.nn.Module) and c.__module__ == name
    ]
    if len(classes) != 1:
        found = ", ".join(c.__name__ for c in classes) or "none"
        raise RuntimeError(
            f"model '{spec.name}': {path} must define exactly one torch.nn.Module subclass "
            f"(found {found})"
        )
    return classes[0]


def _place(device: str | None) -> torch.device | None:
    torch = import_torch()
    return torch.device(device) if device is not None else None


def load_module(spec: ModelSpec, device: str | None) -> _Loaded:
    """Load the model's module onto ``device`` (``"cpu"``, ``"cuda:<id>"``; None:
    ``KIND_MODEL``, where the file put it) and match its arguments.

    Raises:
        RuntimeError: the file cannot be read (:func:`load_error`), ``model.py``
            cannot be imported or built, or the inputs do not match ``forward``.
    """
    torch = import_torch()
    cfg = spec.config
    target = _place(device)
    if cfg.runtime == PYTHON_RUNTIME:
        code = spec.version_dir / PYTHON_RUNTIME
        cls = _import_model_py(spec, code)
        try:
            module = cls()
        except Exception as e:
            raise RuntimeError(
                f"model '{spec.name}': {cls.__name__}() raised {type(e).__name__}: {e}"
            ) from e
        weights = spec.version_dir / WEIGHTS_FILENAME
        if weights.is_file():
            try:
                state = torch.load(str(weights), map_location="cpu", weights_only=True)
                module.load_state_dict(state)
            except Exception as e:
                raise RuntimeError(
                    f"model '{spec.name}': cannot load the weights {weights} into "
                    f"{cls.__name__}: {type(e).__name__}: {str(e).strip().splitlines()[0]}"
                ) from e
        if target is not None:
            module = module.to(target)
        scripted = False
    elif cfg.platform == cfgmod.TORCH_AOTI_PLATFORM:
        return _load_exported(spec, target or torch.device("cpu"))
    else:
        path = cfgmod.find_model_file(cfg, spec.version_dir)
        try:
            module = torch.jit.load(str(path), map_location=target)
        except Exception as e:
            raise load_error(spec.name, path, e) from e
        scripted = True
    module.eval()
    if target is None:  # KIND_MODEL: wherever its parameters are
        first = next(iter(module.parameters()), None)
        target = first.device if first is not None else torch.device("cpu")
    names, is_dict = _forward_signature(module, scripted)
    try:
        plan = plan_inputs([i.name for i in cfg.input], names, is_dict)
    except ValueError as e:
        raise RuntimeError(f"model '{spec.name}': {e}") from None
    log.info(
        "%s: %s on %s, inputs matched by %s",
        spec.name,
        "TorchScript" if scripted else f"{PYTHON_RUNTIME} module",
        target,
        plan.rule,
    )
    return _Loaded(module, target, plan, scripted)


def _load_exported(spec: ModelSpec, device: torch.device) -> _Loaded:
    """A ``torch_aoti`` model's ``.pt2`` (:mod:`~pdserve.backends.pytorch.exported`)."""
    path = cfgmod.find_model_file(spec.config, spec.version_dir)
    exported = load_pt2(spec.name, path, device)
    try:
        plan = pt2_input_plan([i.name for i in spec.config.input], exported.arguments)
    except ValueError as e:
        raise RuntimeError(f"model '{spec.name}': {e}") from None
    log.info(
        "%s: %s on %s, inputs matched by %s",
        spec.name,
        "AOTInductor package" if exported.aoti else "ExportedProgram",
        device,
        plan.rule,
    )
    return _Loaded(exported.module, device, plan, False)


class PyTorchBackend(Backend):
    """Loads TorchScript (or ``runtime: "model.py"``) models onto CPU or CUDA GPUs."""

    name = cfgmod.PYTORCH_BACKEND

    def usable_gpus(self) -> list[int]:
        """The visible GPUs when torch is a CUDA build that finds them, else none."""
        torch = import_torch()
        if torch.version.cuda is None or not torch.cuda.is_available():
            return []
        return visible_gpus()[: torch.cuda.device_count()]

    async def auto_complete(self, spec: ModelSpec) -> None:
        """No auto-complete (as in Triton): check what the configuration must give, and
        for a ``torch_aoti`` model the tensors against the program's own signature
        (:func:`~pdserve.backends.pytorch.exported.check_config_against`).

        Also imports torch (seconds, the first time) on a worker thread, so that neither
        :meth:`usable_gpus` (Triton's defaults, next) nor :meth:`load` blocks the event
        loop with it.

        Raises:
            pdserve.config.ConfigError: see :func:`check_config`.
        """
        where = spec.model_dir / cfgmod.CONFIG_FILENAME
        check_config(spec.config, where)
        await asyncio.to_thread(import_torch)
        if spec.config.platform == cfgmod.TORCH_AOTI_PLATFORM:
            path = cfgmod.find_model_file(spec.config, spec.version_dir)
            await asyncio.to_thread(check_config_against, spec.config, path, spec.name, str(where))

    async def load(self, spec: ModelSpec) -> list[ModelInstance]:
        """Create the instances of ``instance_group``; each loads the module on its
        own thread (pinned to its host policy's cores, if any).

        Raises:
            RuntimeError: a GPU that cannot be used (CPU-only torch, id not visible),
                a file torch cannot read, or inputs that do not match ``forward``;
                the message names the model.
            ValueError: a malformed parameter.
        """
        from tritonclient.grpc import model_config_pb2 as mc

        cfg = spec.config
        options = Options.from_config(cfg)
        await asyncio.to_thread(SETTINGS.apply, spec.name, cfg)
        #: (kind, device or None, cores) per instance
        plans: list[tuple[str, str | None, frozenset[int] | None]] = []
        for group in list(cfg.instance_group) or [None]:
            count = group.count if group is not None and group.count > 0 else 1
            kind = mc.ModelInstanceGroup.Kind.Name(group.kind) if group is not None else "KIND_CPU"
            gname = group.name if group is not None and group.name else spec.name
            if kind == "KIND_AUTO":
                kind = "KIND_GPU" if self.usable_gpus() else "KIND_CPU"
            if kind == "KIND_GPU":
                gpus = (list(group.gpus) if group is not None else []) or [0]
                problem = await asyncio.to_thread(_gpu_message, spec.name, gname, gpus)
                if problem:
                    raise RuntimeError(problem)
                for gpu in gpus:
                    cores = instance_cores(spec.host_policies, group, gpu)
                    plans.extend(("KIND_GPU", f"cuda:{gpu}", cores) for _ in range(count))
            elif kind == "KIND_CPU":
                cores = instance_cores(spec.host_policies, group, 0)
                plans.extend(("KIND_CPU", "cpu", cores) for _ in range(count))
            elif kind == "KIND_MODEL":
                cores = instance_cores(spec.host_policies, group, 0)
                has_cuda = await asyncio.to_thread(lambda: bool(self.usable_gpus()))
                device = None if has_cuda else "cpu"
                plans.extend(("KIND_MODEL", device, cores) for _ in range(count))
            else:
                raise RuntimeError(f"instance_group kind {kind} is not supported by pytorch")
        loop = asyncio.get_running_loop()
        executors: list[concurrent.futures.ThreadPoolExecutor] = []
        shared: dict[str | None, asyncio.Future[_Loaded]] = {}
        futures: list[asyncio.Future[_Loaded]] = []
        for i, (_, device, cores) in enumerate(plans):
            name = f"{spec.name}_{i}"
            executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)
            executors.append(executor)
            if options.weight_sharing and device in shared:
                futures.append(shared[device])
                continue

            def make(
                device: str | None = device, cores: frozenset[int] | None = cores, name: str = name
            ) -> _Loaded:
                if cores:
                    pin_current_thread(cores)
                    name_current_thread(name)
                return load_module(spec, device)

            future = loop.run_in_executor(executor, make)
            shared.setdefault(device, future)
            futures.append(future)
        loaded = await gather_loads(futures, executors)
        return [
            PyTorchInstance(f"{spec.name}_{i}", kind, item, spec, options, executor, cores)
            for i, ((kind, _, cores), item, executor) in enumerate(
                zip(plans, loaded, executors, strict=True)
            )
        ]


def run_on_cpu(
    model: str,
    cfg: ModelConfig,
    version_dir: Path,
    inputs: dict[str, np.ndarray],
    outputs: list[str],
) -> dict[str, np.ndarray]:
    """Run one batch of ``inputs`` through a version on the CPU, in the calling thread,
    as an instance would (``pdserve check``'s golden check).

    Args:
        model: the model name (messages).
        cfg: its completed configuration.
        version_dir: ``<repository>/<model>/<version>``.
        inputs: input name -> array, batch dim included when the model batches.
        outputs: the outputs to return.

    Raises:
        RuntimeError: the module cannot be loaded (see :func:`load_module`).
        pdserve.core.errors.InferError: an output the model does not return.
        Exception: what the model raised.
    """
    spec = ModelSpec(model, 0, cfg, version_dir.parent, version_dir, version_dir.parent.parent)
    loaded = load_module(spec, "cpu")
    executor = concurrent.futures.ThreadPoolExecutor(1)
    try:
        instance = PyTorchInstance(
            f"{model}_check", "KIND_CPU", loaded, spec, Options.from_config(cfg), executor
        )
        return instance._run(inputs, outputs)
    finally:
        executor.shutdown(wait=False)


class PyTorchInstance(ModelInstance):
    """One loaded module, run on its own thread.

    Args:
        name: instance name (``<model>_<n>``).
        kind: ``KIND_CPU`` / ``KIND_GPU`` / ``KIND_MODEL``.
        loaded: the module, its device and its input plan.
        spec: the model version.
        options: the model's switches.
        executor: the instance's one-thread executor (the thread that loaded it).
        cores: the host policy's cores, or None.
    """

    def __init__(
        self,
        name: str,
        kind: str,
        loaded: _Loaded,
        spec: ModelSpec,
        options: Options,
        executor: concurrent.futures.ThreadPoolExecutor,
        cores: frozenset[int] | None = None,
    ) -> None:
        torch = import_torch()
        self.name = name
        self.kind = kind
        self.module = loaded.module
        self.device = loaded.device
        self.cores = cores
        self._plan = loaded.inputs
        self._scripted = loaded.scripted
        names = [o.name for o in spec.config.output]
        if spec.config.platform == cfgmod.TORCH_AOTI_PLATFORM:
            self._outputs = pt2_output_plan(names)
        else:
            self._outputs, _ = plan_outputs(names)
        self._options = options
        self._executor = executor
        self._model = spec.name
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=self.device) if self._cuda else None
        self._dtypes = {
            i.name: getattr(torch, TORCH_DTYPES[cfgmod.model_config_pb2.DataType.Name(i.data_type)])
            for i in spec.config.input
        }
        self._closed = False

    # -- on the instance's thread -------------------------------------------------

    def _to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        torch = import_torch()
        if not array.flags.writeable or not array.flags.c_contiguous:
            array = np.ascontiguousarray(array).copy()  # torch.from_numpy wants writable
        host = torch.from_numpy(array)
        if host.dtype != self._dtypes[name]:
            host = host.to(self._dtypes[name])
        if not self._cuda:
            return host
        if self._options.input_pinned:
            pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
            pinned.copy_(host)
            return pinned.to(self.device, non_blocking=True)
        return host.to(self.device)

    def _to_host(self, tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        torch = import_torch()
        out: dict[str, Tensor] = {}
        for name, t in tensors.items():
            t = t.detach()
            if t.device.type == "cpu":
                out[name] = t
            elif self._options.output_pinned:
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                out[name] = host
            else:
                out[name] = t.cpu()
        if self._stream is not None:
            self._stream.synchronize()
        return {name: t.numpy() for name, t in out.items()}

    @contextlib.contextmanager
    def _modes(self) -> Iterator[None]:
        torch = import_torch()
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                torch.inference_mode() if self._options.inference_mode else torch.no_grad()
            )
            if self._scripted and not self._options.optimized_execution:
                stack.enter_context(torch.jit.optimized_execution(False))
            if self._stream is not None:
                stack.enter_context(torch.cuda.stream(self._stream))
            yield

    def _run(self, inputs: dict[str, np.ndarray], wanted: list[str]) -> dict[str, np.ndarray]:
        torch = import_torch()
        with self._modes():
            tensors = {n: self._to_device(n, a) for n, a in inputs.items()}
            if self._plan.as_dict:
                result = self.module(tensors)
            else:
                result = self.module(*(tensors[n] for n in self._plan.order))
            items = list(result) if isinstance(result, list | tuple) else [result]
            picked: dict[str, Tensor] = {}
            for n in wanted:
                index = self._outputs[n]
                if index >= len(items) or not isinstance(items[index], torch.Tensor):
                    what = (
                        f"{len(items)} result(s)"
                        if index >= len(items)
                        else f"a {type(items[index]).__name__} at index {index}"
                    )
                    raise internal(
                        f"model '{self._model}' output '{n}' is result element {index} of "
                        f"forward(), which returned {what}"
                    )
                picked[n] = items[index]
            outputs = self._to_host(picked)
        if self._cuda and self._options.cache_cleaning:
            torch.cuda.empty_cache()
        return outputs

    # -- on the event loop ----------------------------------------------------------

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        """Merge the batch, run ``forward`` on the instance's thread, split the outputs.

        A batch that reaches an instance already closed gets a 503; an exception
        in the model a 500 naming the model.
        """
        return await execute_on_thread(
            batch, self._executor, self._closed, self.name, self._run, self._failure
        )

    def _failure(self, e: Exception) -> str:
        return f"pytorch execution of model '{self._model}' failed: {_summary(e)}"

    async def close(self) -> None:
        """Stop the instance's thread and drop the module (and GPU memory it held)."""
        self._closed = True
        self._executor.shutdown(wait=True)
        self.module = None
        if self._cuda:
            torch = import_torch()
            with contextlib.suppress(RuntimeError):
                torch.cuda.empty_cache()


def _summary(error: BaseException) -> str:
    """One line of a torch exception: TorchScript's interpreter puts the traceback of
    the scripted code first and the error itself last."""
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    if not lines:
        return type(error).__name__
    line = lines[-1] if "TorchScript interpreter" in lines[0] else lines[0]
    return line if line.startswith(type(error).__name__) else f"{type(error).__name__}: {line}"
