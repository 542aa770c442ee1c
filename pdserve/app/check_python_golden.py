"""The ``golden`` check of a python model in ``pdserve check``: the stored inputs run
through ``model.py`` in one worker process (as serve runs it, on the completed
configuration), each stored output compared like an ONNX model's, and each output
whose shape differs from the configuration reported: a warning (serve answers with
the shape the model produced, as Triton does, and warns), an error when the model
sets ``strict_output_shapes`` (serve fails such requests)."""

from __future__ import annotations

import asyncio
import copy

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import ExecRequest, ModelSpec
from pdserve.backends.python import output_shapes
from pdserve.core.errors import InferError
from pdserve.repository.model import ModelVersion
from pdserve.scheduling.base import OutputCheck

from .check_golden import Golden, compare, golden_arrays, golden_request
from .check_report import ERROR, WARNING, CheckResult


def _one_cpu_instance(cfg: cfgmod.ModelConfig) -> None:
    """One CPU instance: a check starts one worker, also where serve would start a
    GPU instance per device."""
    from tritonclient.grpc import model_config_pb2 as mc

    del cfg.instance_group[:]
    cfg.instance_group.add(count=1, kind=mc.ModelInstanceGroup.KIND_CPU)


async def check_python_golden(
    r: CheckResult, golden: object, spec: ModelSpec, timeout_s: float = 60.0
) -> None:
    """Run the golden inputs through a python model; compare shapes and values.

    Args:
        golden: MODEL_IDENTITY.json's ``golden`` entry.
        spec: the version, its configuration the completed one (not changed here).
        timeout_s: seconds the worker may take to initialize, and then to answer;
            past them it is killed and the check fails.
    """
    read = golden_arrays(r, golden, spec.version_dir)
    if read is None:
        return
    inputs, outputs, _, _, arrays, npz_path = read
    spec = copy.copy(spec)
    spec.config = copy.deepcopy(spec.config)
    _one_cpu_instance(spec.config)
    where = str(spec.model_dir / cfgmod.CONFIG_FILENAME)
    strict = output_shapes.strict_output_shapes(spec.config, where)
    mv = ModelVersion(spec, spec.config.backend, cfgmod.PYTHON_BACKEND)
    unknown = [n for n in [*inputs, *outputs] if n not in mv.inputs and n not in mv.outputs]
    if unknown:
        r.add(
            f"golden names tensor(s) {', '.join(unknown)} the configuration does not have "
            f"(inputs {sorted(mv.inputs)}, outputs {sorted(mv.outputs)})",
            spec.version_dir / "MODEL_IDENTITY.json",
            "golden",
        )
        return
    from pdserve.backends.python.backend import PythonBackend

    exec_request = golden_request(r, mv, arrays, inputs, outputs, npz_path)
    if exec_request is None:
        return
    try:
        instances = await asyncio.wait_for(PythonBackend().load(spec), timeout_s)
    except TimeoutError:
        r.add(f"the model did not initialize within {timeout_s:g} s (it was killed)", npz_path)
        return
    # not wait_for: a batch the worker runs keeps its instance until the worker answers,
    # so only killing the worker (abort) ends an execute that hangs
    running = asyncio.ensure_future(instances[0].execute([exec_request]))
    try:
        await asyncio.wait([running], timeout=timeout_s)
        if not running.done():
            await instances[0].abort(0.0)
            await asyncio.wait([running])
            running.exception()  # the worker's end, reported as the timeout below
            r.add(f"the model did not answer the golden inputs within {timeout_s:g} s", npz_path)
            return
    finally:
        for instance in instances:
            await instance.close()
    (result,) = running.result()
    if isinstance(result, InferError):
        r.add(f"running the golden inputs failed: {result.message}", npz_path)
        return
    _compare(r, read, mv, exec_request, result, strict)


def _compare(
    r: CheckResult,
    read: Golden,
    mv: ModelVersion,
    exec_request: ExecRequest,
    result: dict[str, np.ndarray],
    strict: bool,
) -> None:
    """Shapes against the configuration, then values against the golden ones."""
    _, outputs, atol, rtol, arrays, npz_path = read
    where = mv.spec.model_dir / cfgmod.CONFIG_FILENAME
    found: list[tuple[str, list[int], tuple[int, ...]]] = []
    check = OutputCheck(mv.config, lambda *mismatch: found.append(mismatch))
    checked = check.check(exec_request, result)
    if isinstance(checked, InferError):  # a datatype: an error in serve too
        r.add(checked.message, npz_path)
        return
    for name, expected, produced in found:
        dims = list(mv.outputs[name].dims)
        r.add(
            f"output '{name}': the model produced shape {_shape(produced)}, its configuration "
            f"says {_shape(expected)} (dims {_shape(dims)}); "
            + (
                f"{output_shapes.STRICT_PARAMETER} is set, so serve fails such requests"
                if strict
                else "serve answers with the produced shape and warns, as Triton does "
                f"(parameter {output_shapes.STRICT_PARAMETER}: fail instead)"
            ),
            where,
            f"output.{name}.dims",
            ERROR if strict else WARNING,
        )
    for name, key in outputs.items():
        problem = compare(np.asarray(checked[name]), arrays[key], atol, rtol)
        if problem:
            r.add(f"output '{name}': {problem}", npz_path, name)


def _shape(dims: list[int] | tuple[int, ...]) -> str:
    return "[" + ",".join(str(int(d)) for d in dims) + "]"
