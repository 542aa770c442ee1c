"""The ``golden`` check of ``pdserve check``: the inputs stored beside a model version
(``MODEL_IDENTITY.json``'s ``golden`` entry and its ``.npz``), run through the model
file on the CPU (ONNX Runtime, torch for PyTorch models, a CPU predictor for FIL models), must give the stored
outputs within the stored tolerance (``|got - want| <= atol + rtol * |want|``; other
datatypes exactly)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import ExecRequest
from pdserve.core.errors import InferError
from pdserve.core.types import InferRequest
from pdserve.repository.model import ModelVersion

from .check_files import IDENTITY_FILENAME, inside
from .check_report import CheckResult

#: A golden entry's tensor name -> npz key maps, its tolerances and its arrays.
Golden = tuple[dict[str, str], dict[str, str], float, float, dict[str, np.ndarray], Path]


def _load_npz(r: CheckResult, npz_path: Path, keys: list[str]) -> dict[str, np.ndarray] | None:
    """The arrays of ``npz_path``, None (problem recorded) when it cannot be read or
    lacks one of ``keys``."""
    try:
        with np.load(npz_path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as e:
        r.add(f"cannot read {npz_path.name}: {type(e).__name__}: {e}", npz_path)
        return None
    missing = [k for k in keys if k not in arrays]
    if missing:
        r.add(f"{npz_path.name} has no array(s) {', '.join(missing)}", npz_path)
        return None
    return arrays


def golden_arrays(r: CheckResult, golden: object, vdir: Path) -> Golden | None:
    """Read and check a golden entry and its npz; None (problem recorded) when unusable."""
    where = vdir / IDENTITY_FILENAME
    if not isinstance(golden, dict) or not isinstance(golden.get("file"), str):
        r.add("must be an object {file, inputs, outputs, atol, rtol}", where, "golden")
        return None
    inputs, outputs = golden.get("inputs"), golden.get("outputs")
    atol, rtol = golden.get("atol", 0.0), golden.get("rtol", 0.0)
    if not (_str_map(inputs) and _str_map(outputs) and outputs and _tolerance(atol)) or not (
        _tolerance(rtol) and isinstance(inputs, dict) and isinstance(outputs, dict)
    ):
        r.add("malformed golden entry (want file, inputs, outputs, atol, rtol)", where, "golden")
        return None
    npz_path = vdir / golden["file"]
    if not inside(vdir, npz_path):
        r.add(f"'{golden['file']}' is not a file of the version folder {vdir}", where)
        return None
    arrays = _load_npz(r, npz_path, [*inputs.values(), *outputs.values()])
    if arrays is None:
        return None
    return inputs, outputs, float(atol), float(rtol), arrays, npz_path


def check_torch_golden(
    r: CheckResult,
    golden: object,
    vdir: Path,
    model_path: Path | None,
    cfg: cfgmod.ModelConfig,
    model: str,
) -> None:
    """The golden check of a PyTorch model: the stored inputs through the model on the
    CPU (the backend's own loading and naming conventions), compared like ONNX's."""
    read = golden_arrays(r, golden, vdir)
    if read is None:
        return
    inputs, outputs, atol, rtol, arrays, npz_path = read
    if model_path is None:
        r.skip("no model file")
        return
    from pdserve.backends.registry import unavailable_reason

    reason = unavailable_reason(cfgmod.PYTORCH_BACKEND)
    if reason:
        r.skip(reason)
        return
    from pdserve.backends.pytorch.backend import run_on_cpu

    try:
        got = run_on_cpu(
            model, cfg, vdir, {name: arrays[key] for name, key in inputs.items()}, list(outputs)
        )
    except Exception as e:
        r.add(f"running the golden inputs failed: {type(e).__name__}: {e}", npz_path)
        return
    for name, key in outputs.items():
        problem = compare(np.asarray(got[name]), arrays[key], atol, rtol)
        if problem:
            r.add(f"output '{name}': {problem}", npz_path, name)


def check_fil_golden(
    r: CheckResult,
    golden: object,
    vdir: Path,
    model_path: Path | None,
    cfg: cfgmod.ModelConfig | None,
) -> None:
    """The golden check of a FIL model: the stored ``input__0`` rows through a CPU
    predictor of the completed configuration, ``output__0`` compared like ONNX's."""
    read = golden_arrays(r, golden, vdir)
    if read is None:
        return
    inputs, outputs, atol, rtol, arrays, npz_path = read
    if model_path is None or not model_path.is_file():
        r.skip("no model file")
        return
    if cfg is None:
        r.skip("the configuration did not pass the checks above")
        return
    from pdserve.backends.registry import unavailable_reason

    reason = unavailable_reason(cfgmod.FIL_BACKEND)
    if reason:
        r.skip(reason)
        return
    from pdserve.backends.fil.backend import INPUT_NAME, OUTPUT_NAME, predict_on_cpu

    unknown = [n for n in (*inputs, *outputs) if n not in (INPUT_NAME, OUTPUT_NAME)]
    if unknown or INPUT_NAME not in inputs:
        r.add(
            f"golden must name FIL's tensors {INPUT_NAME} / {OUTPUT_NAME}, got "
            f"{', '.join(unknown) or 'no ' + INPUT_NAME}",
            vdir / IDENTITY_FILENAME,
            "golden",
        )
        return
    try:
        got = predict_on_cpu(cfg, vdir, arrays[inputs[INPUT_NAME]])
    except Exception as e:
        r.add(f"running the golden inputs failed: {type(e).__name__}: {e}", npz_path)
        return
    if OUTPUT_NAME in outputs:
        problem = compare(got, arrays[outputs[OUTPUT_NAME]], atol, rtol)
        if problem:
            r.add(f"output '{OUTPUT_NAME}': {problem}", npz_path, OUTPUT_NAME)


def golden_request(
    r: CheckResult,
    mv: ModelVersion,
    arrays: dict[str, np.ndarray],
    inputs: dict[str, str],
    outputs: dict[str, str],
    npz_path: Path,
) -> ExecRequest | None:
    """The golden inputs as one request to ``mv``, checked against its configuration
    as a served request is (:meth:`ModelVersion.prepare`), asking for the golden's
    outputs; None (and an error on ``r``) when they do not fit.

    Args:
        inputs / outputs: tensor name -> key in ``arrays`` (the golden file's arrays).
    """
    request = InferRequest(
        mv.name, mv.version_str, {n: arrays[k] for n, k in inputs.items()}, id="golden"
    )
    try:
        exec_request = mv.prepare(request)
    except InferError as e:
        r.add(f"the golden inputs do not fit the configuration: {e.message}", npz_path)
        return None
    exec_request.output_names = list(outputs)
    return exec_request


def _golden_entry(
    r: CheckResult, golden: object, vdir: Path
) -> tuple[str, dict[str, str], dict[str, str], float, float] | None:
    """The golden entry's file, inputs, outputs, atol and rtol; None (a problem naming
    each malformed field recorded) when it is unusable."""
    where = vdir / IDENTITY_FILENAME
    if not isinstance(golden, dict):
        r.add("must be an object {file, inputs, outputs, atol, rtol}", where, "golden")
        return None
    file_name = golden.get("file")
    inputs, outputs = golden.get("inputs"), golden.get("outputs")
    atol, rtol = golden.get("atol", 0.0), golden.get("rtol", 0.0)
    bad = [
        f"golden.{k}"
        for k, ok in (
            ("file", isinstance(file_name, str) and file_name),
            ("inputs", _str_map(inputs)),
            ("outputs", _str_map(outputs) and outputs),
            ("atol", _tolerance(atol)),
            ("rtol", _tolerance(rtol)),
        )
        if not ok
    ]
    if (
        bad
        or not isinstance(file_name, str)
        or not isinstance(inputs, dict)
        or not isinstance(outputs, dict)
    ):
        r.add(
            f"malformed golden entry: {', '.join(bad)} (want file: name, inputs/outputs: "
            "{tensor: npz key}, atol/rtol: numbers >= 0)",
            where,
            bad[0] if bad else "golden",
        )
        return None
    if not inside(vdir, vdir / file_name):
        r.add(f"'{file_name}' is not a file of the version folder {vdir}", where, "golden.file")
        return None
    return file_name, inputs, outputs, float(atol), float(rtol)


def check_golden(
    r: CheckResult, golden: object, vdir: Path, model_path: Path | None, is_onnx: bool
) -> None:
    """Run the stored golden inputs through the model file; compare with the stored outputs.

    Args:
        golden: MODEL_IDENTITY.json's ``golden`` entry.
        model_path: the ONNX model file (None: missing).
        is_onnx: whether the model is an ONNX model (others are skipped).
    """
    entry = _golden_entry(r, golden, vdir)
    if entry is None:
        return
    file_name, inputs, outputs, atol, rtol = entry
    if not is_onnx:
        r.skip("golden outputs are run for ONNX, PyTorch and python models only")
        return
    if model_path is None:
        r.skip("no model file")
        return
    npz_path = vdir / file_name
    arrays = _load_npz(r, npz_path, [*inputs.values(), *outputs.values()])
    if arrays is None:
        return
    _run_onnx_golden(r, model_path, vdir, (inputs, outputs, atol, rtol, arrays, npz_path))


def _run_onnx_golden(r: CheckResult, model_path: Path, vdir: Path, read: Golden) -> None:
    """The golden inputs through ONNX Runtime on the CPU, each output compared."""
    import onnxruntime as ort

    inputs, outputs, atol, rtol, arrays, npz_path = read
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(
            str(model_path), sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception as e:
        r.skip(f"ONNX Runtime cannot open the model ({type(e).__name__})")
        return
    types = {i.name: i.type for i in session.get_inputs()}
    unknown = [n for n in inputs if n not in types]
    known_out = {o.name for o in session.get_outputs()}
    unknown += [n for n in outputs if n not in known_out]
    if unknown:
        r.add(
            f"golden names tensor(s) {', '.join(unknown)} the model does not have "
            f"(inputs {sorted(types)}, outputs {sorted(known_out)})",
            vdir / IDENTITY_FILENAME,
            "golden",
        )
        return
    feeds = {}
    for name, key in inputs.items():
        array = arrays[key]
        if types[name] == "tensor(string)":
            array = array.astype(object)
        feeds[name] = array
    try:
        got = session.run(list(outputs), feeds)
    except Exception as e:
        r.add(f"running the golden inputs failed: {type(e).__name__}: {e}", npz_path)
        return
    for (name, key), value in zip(outputs.items(), got, strict=True):
        problem = compare(np.asarray(value), arrays[key], atol, rtol)
        if problem:
            r.add(f"output '{name}': {problem}", npz_path, name)


def _str_map(value: object) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _tolerance(value: object) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def compare(got: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> str | None:
    """Why ``got`` does not reproduce ``want``, or None when it does."""
    if want.dtype.kind in "US":
        if got.shape != want.shape:
            return f"shape {list(got.shape)}, golden {list(want.shape)}"
        same = np.array_equal(got.astype(str), want.astype(str))
        return None if same else "strings differ from the golden ones"
    if got.dtype != want.dtype:
        return f"datatype {got.dtype}, golden {want.dtype}"
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, golden {list(want.shape)}"
    if want.dtype.kind in "fc":
        g, w = got.astype(np.float64), want.astype(np.float64)
        close = np.isclose(g, w, atol=atol, rtol=rtol, equal_nan=True)
        if close.all():
            return None
        diff = np.abs(g - w)
        diff[np.isnan(diff)] = np.inf
        worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
        return (
            f"{int((~close).sum())} of {close.size} values differ by more than atol {atol:g} + "
            f"rtol {rtol:g} * |golden|; the largest: {g[worst]:.6g} vs golden {w[worst]:.6g} "
            f"at {list(int(i) for i in worst)}"
        )
    if np.array_equal(got, want):
        return None
    wrong = int((got != want).sum())
    return f"{wrong} of {want.size} values differ from the golden ones (exact match required)"
