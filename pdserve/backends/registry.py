"""The registry of the backends this server can run.

:data:`REGISTRY` is the one list of backends: name, implementation, and the
third-party modules it needs. Configuration validation asks it through
:func:`unavailable_reason` (the model manager hands that function to
:func:`pdserve.config.normalize_platform` and :func:`pdserve.config.validate_config`,
which sit below the backends and cannot import them), so a model naming a backend
pdserve does not have, or one whose Python packages are missing, fails to load with
that reason. :func:`get_backend` imports an implementation on first use, so that a
server without, say, a backend's optional packages still serves the others.

Triton's platform and backend names themselves are spelled once, in
:mod:`pdserve.config` (``ONNXRUNTIME_PLATFORM``, ``PYTHON_BACKEND``, ...).
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass

from pdserve import config as cfgmod
from pdserve.backends.base import Backend


@dataclass(frozen=True)
class BackendEntry:
    """One backend this server can run.

    Attributes:
        name: the ``backend`` name in config.pbtxt. Ensembles are not backends (as in
            Triton, the ensemble scheduler runs them): the model manager loads them.
        implementation: ``"module:Class"`` of its :class:`Backend`, imported by
            :func:`get_backend` on first use.
        requires: top-level third-party modules the implementation imports; checked
            with ``importlib.util.find_spec``, without importing them.
        extra: the pdserve extra that installs ``requires`` (``pip install
            'pdserve[<extra>]'``); None when they are pdserve dependencies.
    """

    name: str
    implementation: str
    requires: tuple[str, ...] = ()
    extra: str | None = None


#: backend name -> entry: every backend this server can run.
REGISTRY: dict[str, BackendEntry] = {
    entry.name: entry
    for entry in (
        BackendEntry(
            cfgmod.ONNXRUNTIME_BACKEND,
            "pdserve.backends.onnxruntime.backend:OnnxRuntimeBackend",
            requires=("onnxruntime",),
        ),
        BackendEntry(cfgmod.PYTHON_BACKEND, "pdserve.backends.python.backend:PythonBackend"),
        BackendEntry(
            cfgmod.PYTORCH_BACKEND,
            "pdserve.backends.pytorch.backend:PyTorchBackend",
            requires=("torch",),
            extra="pytorch",
        ),
        BackendEntry(
            cfgmod.FIL_BACKEND,
            "pdserve.backends.fil.backend:FilBackend",
            requires=("treelite", "tl2cgen", "xgboost", "lightgbm"),
            extra="fil",
        ),
        BackendEntry(
            cfgmod.OPENVINO_BACKEND,
            "pdserve.backends.openvino.backend:OpenVinoBackend",
            requires=("openvino",),
            extra="openvino",
        ),
        BackendEntry(
            cfgmod.TENSORFLOW_BACKEND,
            "pdserve.backends.tensorflow.backend:TensorFlowBackend",
            requires=("tensorflow",),
            extra="tensorflow",
        ),
        BackendEntry(
            cfgmod.REMOTE_BACKEND,
            "pdserve.backends.remote.backend:RemoteBackend",
            requires=("grpc", "aiohttp"),
        ),
    )
}

#: Triton backends pdserve does not run -> why, and what to do instead (the load
#: error says it; docs/user-guide/backends.md lists every Triton backend).
NOT_SERVED: dict[str, str] = {
    "tensorrt": (
        "TensorRT plans are built for one GPU and TensorRT version; serve the ONNX model the "
        "plan was built from (backend 'onnxruntime')"
    ),
    "dali": "DALI pipelines are not run; do the preprocessing in a python backend model",
    "vllm": (
        "vLLM engines are not run in the server; run vLLM's own server, or call it from a "
        "python backend model"
    ),
    "tensorrtllm": "TensorRT-LLM engines are not run; run them in Triton or TensorRT-LLM's server",
    "identity": "Triton's test backend; an ONNX Identity model does the same (backend 'onnxruntime')",
    "repeat": "Triton's test backend; a decoupled python backend model does the same",
    "square": "Triton's test backend; a decoupled python backend model does the same",
}

_instances: dict[str, Backend] = {}


def served_backends() -> list[str]:
    """The ``backend`` names a configuration may give here, sorted."""
    return sorted(REGISTRY)


def unavailable_reason(name: str) -> str | None:
    """Why backend ``name`` cannot run in this process, or None when it can.

    The reason names the backend and what to do: the backends served instead for an
    unknown name or a Triton backend pdserve does not implement (``tensorrt``); the
    missing Python modules and the ``pdserve[<extra>]`` to install for a backend
    whose packages are not installed (``pytorch`` without torch: ``pdserve[pytorch]``).
    Nothing is imported.
    """
    served = ", ".join(f"'{n}'" for n in served_backends())
    entry = REGISTRY.get(name)
    if entry is None and name in NOT_SERVED:
        return f"backend '{name}' is not served by pdserve: {NOT_SERVED[name]}"
    if entry is None:
        if name in cfgmod.KNOWN_BACKENDS:  # a Triton backend pdserve has no implementation of
            platform = cfgmod.BACKEND_TO_PLATFORM.get(name)
            also = f" (platform '{platform}')" if platform else ""
            return (
                f"backend '{name}'{also} is not available: pdserve has no {name} backend; "
                f"it serves {served} (export the model to ONNX, or call it from a "
                "python backend model)"
            )
        return f"unknown backend '{name}'; pdserve serves {served}"
    missing = [m for m in entry.requires if importlib.util.find_spec(m) is None]
    if missing:
        install = (
            f"install pdserve[{entry.extra}]"
            if entry.extra
            else "reinstall pdserve, which depends on it"
        )
        return (
            f"backend '{name}' is not available: it needs the Python package(s) "
            f"{', '.join(missing)}, which this environment lacks; {install}"
        )
    return None


def get_backend(name: str) -> Backend:
    """Return the (shared) backend object for ``name``.

    Raises:
        ValueError: no such backend, or it cannot run here; the message is
            :func:`unavailable_reason`'s, or the import error of its module.
    """
    if name in _instances:
        return _instances[name]
    reason = unavailable_reason(name)
    if reason is not None:
        raise ValueError(reason)
    module_name, cls_name = REGISTRY[name].implementation.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"backend '{name}' is not available: {e}") from e
    backend = getattr(module, cls_name)()
    _instances[name] = backend
    return backend
