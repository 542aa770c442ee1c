"""The ``golden`` check of a model served in the server process by a framework backend
(OpenVINO, TensorFlow, PyTorch 2 ``torch_aoti``) in ``pdserve check``: the stored
inputs checked against the completed configuration as a request would be, run
through one CPU instance of the backend (its own loading, naming and conversions),
each stored output compared like an ONNX model's."""

from __future__ import annotations

import copy

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import ModelSpec
from pdserve.core.errors import InferError
from pdserve.repository.model import ModelVersion
from pdserve.repository.prepare import backend_for

from .check_golden import compare, golden_arrays, golden_request
from .check_report import CheckResult

#: The backends whose goldens this check runs (by ``backend``; pytorch only for
#: ``platform: "torch_aoti"``, TorchScript has its own check).
BACKENDS = (cfgmod.OPENVINO_BACKEND, cfgmod.TENSORFLOW_BACKEND)


def runs_golden(cfg: cfgmod.ModelConfig | None) -> bool:
    """Whether :func:`check_backend_golden` is the golden check of ``cfg``'s model."""
    if cfg is None:
        return False
    return cfg.backend in BACKENDS or cfg.platform == cfgmod.TORCH_AOTI_PLATFORM


async def check_backend_golden(r: CheckResult, golden: object, spec: ModelSpec) -> None:
    """Run the golden inputs through one CPU instance of the model's backend.

    Args:
        golden: MODEL_IDENTITY.json's ``golden`` entry.
        spec: the version, its configuration the completed one (not changed here).
    """
    from pdserve.backends.registry import unavailable_reason

    read = golden_arrays(r, golden, spec.version_dir)
    if read is None:
        return
    inputs, outputs, atol, rtol, arrays, npz_path = read
    reason = unavailable_reason(spec.config.backend)
    if reason:
        r.skip(reason)
        return
    spec = copy.copy(spec)
    spec.config = copy.deepcopy(spec.config)
    from tritonclient.grpc import model_config_pb2 as mc

    del spec.config.instance_group[:]
    spec.config.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)
    mv = ModelVersion(spec, spec.config.platform or spec.config.backend, spec.config.backend)
    exec_request = golden_request(r, mv, arrays, inputs, outputs, npz_path)
    if exec_request is None:
        return
    try:
        instances = await backend_for(spec.config).load(spec)
    except Exception as e:
        r.add(f"loading the model failed: {type(e).__name__}: {e}", npz_path)
        return
    try:
        (result,) = await instances[0].execute([exec_request])
    except InferError as e:
        result = e
    finally:
        for instance in instances:
            await instance.close()
    if isinstance(result, InferError):
        r.add(f"running the golden inputs failed: {result.message}", npz_path)
        return
    for name, key in outputs.items():
        if name not in result:
            r.add(f"output '{name}': the model did not return it", npz_path, name)
            continue
        problem = compare(np.asarray(result[name]), arrays[key], atol, rtol)
        if problem:
            r.add(f"output '{name}': {problem}", npz_path, name)
