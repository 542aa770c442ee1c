"""Backends: turn a model version's files into model instances.

:func:`get_backend` maps a configuration's ``backend`` name to its implementation,
imported on first use so that a server without, say, torch still serves ONNX.
"""

from __future__ import annotations

import importlib

from pdserve.backends.base import Backend

#: backend name -> "module:Class"
BACKENDS: dict[str, str] = {
    "onnxruntime": "pdserve.backends.onnxruntime.backend:OnnxRuntimeBackend",
    "python": "pdserve.backends.python.backend:PythonBackend",
    "pytorch": "pdserve.backends.pytorch:PyTorchBackend",
    "ensemble": "pdserve.scheduling.ensemble:EnsembleBackend",
}

_instances: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """Return the (shared) backend object for ``name``.

    Raises:
        ValueError: no such backend, or its module cannot be imported here.
    """
    if name in _instances:
        return _instances[name]
    target = BACKENDS.get(name)
    if target is None:
        raise ValueError(f"unknown backend '{name}'; known: {sorted(BACKENDS)}")
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"backend '{name}' is not available: {e}") from e
    backend = getattr(module, cls_name)()
    _instances[name] = backend
    return backend
