"""Tests of ``pdserve check`` (pdserve.app.check): broken repositories built in tmp_path,
one per kind of error and all of them at once, the example repository (clean,
goldens included), the rules file, the JSON and JUnit reports and the exit codes."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper

from pdserve.app.check import CheckOptions, check_repository
from pdserve.app.check_output import render
from pdserve.app.check_report import Report
from pdserve.app.check_rules import RulesError, load_rules, parse_rules
from pdserve.app.cli import main
from tests.conftest import EXAMPLE_REPO, require_examples

ROOT = Path(__file__).resolve().parents[3]
CHECK_MODELS = ROOT / "tests" / "data" / "check_models"
F32, I32 = TensorProto.FLOAT, TensorProto.INT32

# --------------------------------------------------------------------------- builders


def write_onnx(
    path: Path,
    inputs: list[tuple[str, int, list]],
    outputs: list[tuple[str, int, list]],
    op: str = "Identity",
) -> bytes:
    """An ONNX model whose i-th output is ``op`` of its i-th input; returns its bytes."""
    graph = helper.make_graph(
        [helper.make_node(op, [i[0]], [o[0]]) for i, o in zip(inputs, outputs, strict=True)],
        "g",
        [helper.make_tensor_value_info(*i) for i in inputs],
        [helper.make_tensor_value_info(*o) for o in outputs],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    data = model.SerializeToString()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return data


TINY_IO = """input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
output [ { name: "OUTPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]
"""


def onnx_model(
    repo: Path,
    name: str,
    extra: str = "",
    *,
    io: str = TINY_IO,
    mbs: int = 8,
    shape: list | None = None,
    dtype: int = F32,
) -> Path:
    """``<repo>/<name>``: an ONNX Identity INPUT0 -> OUTPUT0 and its config.pbtxt."""
    d = repo / name
    shape = shape or ["batch", 4]
    write_onnx(d / "1" / "model.onnx", [("INPUT0", dtype, shape)], [("OUTPUT0", dtype, shape)])
    text = f'platform: "onnxruntime_onnx"\nmax_batch_size: {mbs}\n{io}{extra}\n'
    (d / "config.pbtxt").write_text(text)
    return d


def params(**values: str) -> str:
    """config.pbtxt ``parameters`` entries (quotes in values escaped)."""
    return "".join(
        f'parameters {{ key: "{k}" value {{ string_value: "{v.replace(chr(34), chr(92) + chr(34))}" }} }}\n'
        for k, v in values.items()
    )


def python_model(repo: Path, name: str, config: str, source: str = "plain_python") -> Path:
    """``<repo>/<name>``: ``tests/data/check_models/<source>``'s model.py with ``config``."""
    d = repo / name
    (d / "1").mkdir(parents=True)
    shutil.copy(CHECK_MODELS / source / "1" / "model.py", d / "1" / "model.py")
    (d / "config.pbtxt").write_text(config)
    return d


def copy_check_model(repo: Path, name: str) -> None:
    shutil.copytree(CHECK_MODELS / name, repo / name)


def steps(repo: Path) -> None:
    """Step models shared by the ensemble cases (written once per repository)."""
    if not (repo / "step_f32").exists():
        onnx_model(repo, "step_f32")
    if not (repo / "step_i32").exists():
        io = TINY_IO.replace("TYPE_FP32", "TYPE_INT32")
        onnx_model(repo, "step_i32", io=io, dtype=I32)


def step(model: str, inp: str, out: str) -> str:
    return (
        f'step [ {{ model_name: "{model}", model_version: -1, '
        f'input_map {{ key: "INPUT0", value: "{inp}" }}, '
        f'output_map {{ key: "OUTPUT0", value: "{out}" }} }} ]'
    )


def ensemble(
    repo: Path,
    name: str,
    body: str,
    inputs: str = 'input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]',
    outputs: str = 'output [ { name: "OUT", data_type: TYPE_FP32, dims: [ 4 ] } ]',
) -> None:
    steps(repo)
    d = repo / name
    (d / "1").mkdir(parents=True)
    (d / "config.pbtxt").write_text(
        f'platform: "ensemble"\nmax_batch_size: 8\n{inputs}\n{outputs}\n'
        f"ensemble_scheduling {{ {body} }}\n"
    )


def identity(
    repo: Path, name: str, record: dict | None = None, golden: tuple[dict, dict] | None = None
) -> None:
    """An ONNX model with MODEL_IDENTITY.json (true sha256 unless ``record`` says otherwise)."""
    d = onnx_model(repo, name)
    data = (d / "1" / "model.onnx").read_bytes()
    entry = {"model": name, "version": 1, "model_file": "model.onnx"}
    entry["sha256"] = hashlib.sha256(data).hexdigest()
    entry["size_bytes"] = len(data)
    if golden is not None:
        arrays = {"input_0": golden[0]["INPUT0"], "output_0": golden[1]["OUTPUT0"]}
        np.savez(d / "1" / "golden.npz", **arrays)
        entry["golden"] = {
            "file": "golden.npz",
            "inputs": {"INPUT0": "input_0"},
            "outputs": {"OUTPUT0": "output_0"},
            "atol": 1e-6,
            "rtol": 0.0,
        }
    entry.update(record or {})
    (d / "1" / "MODEL_IDENTITY.json").write_text(json.dumps(entry))


X = np.arange(8, dtype=np.float32).reshape(2, 4)


def warm(
    repo: Path, name: str, inputs: str, batch_size: int = 1, files: dict[str, bytes] | None = None
) -> None:
    """An ONNX model (INPUT0 FP32 [4], max_batch_size 8) with one ``model_warmup`` sample
    whose ``inputs`` map is ``inputs``, and ``<model>/warmup/<file>`` files."""
    d = onnx_model(
        repo,
        name,
        f'model_warmup [ {{ name: "s", batch_size: {batch_size}, {inputs} }} ]',
    )
    for file_name, data in (files or {}).items():
        (d / "warmup").mkdir(exist_ok=True)
        (d / "warmup" / file_name).write_bytes(data)


def warm_input(key: str = "INPUT0", data: str = "zero_data: true", dims: str = "4") -> str:
    return f'inputs {{ key: "{key}" value: {{ data_type: TYPE_FP32, dims: [ {dims} ], {data} }} }}'


def mutual_ensembles(repo: Path, a: str, b: str) -> None:
    """Ensemble ``a`` steps into ensemble ``b``, which steps into ``a``."""
    ensemble(repo, a, step(b, "IN", "OUT"))
    ensemble(repo, b, step(a, "IN", "OUT"))


#: kind -> (builder, expected problems: (model, check, field fragment, message fragment)).
#: Every model name is unique across kinds, so that all of them fit in one repository.
Expect = list[tuple[str, str, str, str]]
CASES: dict[str, tuple[Callable[[Path], None], Expect]] = {
    # --- configuration: parse, name, platform/backend, versions (read_config, as serve)
    "syntax": (
        lambda r: onnx_model(r, "c_syntax", "max_batch_size: [ oops"),
        [("c_syntax", "config", ":", "")],
    ),
    "name_differs": (
        lambda r: onnx_model(r, "c_name", 'name: "other"'),
        [("c_name", "config", "name", "differs from its folder name")],
    ),
    "unknown_platform": (
        lambda r: python_model(r, "c_platform", 'platform: "tensorrt_plan"'),
        [("c_platform", "config", "platform", "unknown platform 'tensorrt_plan'")],
    ),
    "pytorch_without_model_pt": (
        lambda r: python_model(r, "c_pytorch", 'backend: "pytorch"'),
        [("c_pytorch", "model-file", "", "model.pt does not exist")],
    ),
    "pytorch_without_inputs": (
        lambda r: (
            python_model(r, "c_pytorch_io", 'backend: "pytorch"'),
            (r / "c_pytorch_io" / "1" / "model.pt").write_bytes(b"not checked before the config"),
        ),
        [("c_pytorch_io", "pytorch-config", "input", "must list its inputs")],
    ),
    "platform_backend_pair": (
        lambda r: python_model(r, "c_pair", 'platform: "onnxruntime_onnx"\nbackend: "python"'),
        [("c_pair", "config", "backend", "unexpected 'platform' and 'backend' pair")],
    ),
    "nothing_to_infer_backend": (
        lambda r: (r / "c_infer" / "1").mkdir(parents=True),
        [("c_infer", "config", "platform", "must specify 'platform' or 'backend'")],
    ),
    "no_version_folder": (
        lambda r: (
            (r / "c_noversion").mkdir()
            or (r / "c_noversion" / "config.pbtxt").write_text('backend: "python"\n')
        ),
        [("c_noversion", "config", "", "no version folder")],
    ),
    "policy_selects_nothing": (
        lambda r: onnx_model(r, "c_policy", "version_policy { specific { versions: [ 7 ] } }"),
        [("c_policy", "config", "version_policy", "no version folder selected")],
    ),
    # --- validation (validate_config after auto-complete, as serve)
    "instance_count_absurd": (
        lambda r: onnx_model(r, "v_count", "instance_group [ { count: 100000 } ]"),
        [("v_count", "onnx-config", "instance_group[0].count", "limit of 128 instances")],
    ),
    "negative_max_batch_size": (
        lambda r: python_model(r, "v_mbs", 'backend: "python"\nmax_batch_size: -1\n' + TINY_IO),
        [("v_mbs", "python-import", "max_batch_size", "must be non-negative")],
    ),
    "unnamed_input": (
        lambda r: python_model(
            r, "v_noname", 'backend: "python"\ninput [ { data_type: TYPE_FP32, dims: [ 4 ] } ]'
        ),
        [("v_noname", "python-import", "input[0].name", "must specify 'name'")],
    ),
    "duplicate_input": (
        lambda r: onnx_model(
            r,
            "v_dup",
            io=TINY_IO.replace(
                'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]',
                'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] },'
                ' { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]',
            ),
        ),
        [("v_dup", "onnx-config", "input[1].name", "duplicate input name 'INPUT0'")],
    ),
    "missing_data_type": (
        lambda r: python_model(
            r, "v_dtype", 'backend: "python"\ninput [ { name: "IN", dims: [4] } ]'
        ),
        [("v_dtype", "python-import", "input[0].data_type", "must specify 'data_type'")],
    ),
    "missing_dims": (
        lambda r: python_model(
            r, "v_dims", 'backend: "python"\ninput [ { name: "IN", data_type: TYPE_FP32 } ]'
        ),
        [("v_dims", "python-import", "input[0].dims", "must specify 'dims'")],
    ),
    "bad_dim": (
        lambda r: python_model(
            r,
            "v_dim0",
            'backend: "python"\n'
            + TINY_IO.replace("dims: [ 4 ] } ]\noutput", "dims: [ 0 ] } ]\noutput"),
        ),
        [("v_dim0", "python-import", "input[0].dims", "dimension 0 of 'INPUT0'")],
    ),
    "reshape_count": (
        lambda r: python_model(
            r,
            "v_reshape",
            'backend: "python"\ninput [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ], '
            "reshape { shape: [ 5 ] } } ]",
        ),
        [("v_reshape", "python-import", "input[0].reshape", "different element count")],
    ),
    "image_format_dims": (
        lambda r: onnx_model(
            r,
            "v_nhwc",
            io=TINY_IO.replace(
                "dims: [ 4 ] } ]\noutput", "dims: [ 4 ], format: FORMAT_NHWC } ]\noutput"
            ),
        ),
        [("v_nhwc", "onnx-config", "input[0].format", "require 3 dims")],
    ),
    "shape_tensor": (
        lambda r: onnx_model(
            r,
            "v_shape",
            io=TINY_IO.replace(
                "dims: [ 4 ] } ]\noutput", "dims: [ 4 ], is_shape_tensor: true } ]\noutput"
            ),
        ),
        [("v_shape", "onnx-config", "input[0].is_shape_tensor", "TensorRT")],
    ),
    "label_file_missing": (
        lambda r: onnx_model(
            r,
            "v_label",
            io=TINY_IO.replace(
                "dims: [ 4 ] } ]\n", 'dims: [ 4 ], label_filename: "labels.txt" } ]\n'
            ).replace(
                'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ], label_filename: "labels.txt" } ]',
                'input [ { name: "INPUT0", data_type: TYPE_FP32, dims: [ 4 ] } ]',
            ),
        ),
        [
            (
                "v_label",
                "onnx-config",
                "output[0].label_filename",
                "label file 'labels.txt' not found",
            )
        ],
    ),
    "preferred_batch_size": (
        lambda r: onnx_model(r, "v_preferred", "dynamic_batching { preferred_batch_size: [ 16 ] }"),
        [("v_preferred", "onnx-config", "preferred_batch_size", "must be <= max_batch_size 8")],
    ),
    "priority_level": (
        lambda r: onnx_model(
            r, "v_priority", "dynamic_batching { priority_levels: 2, default_priority_level: 3 }"
        ),
        [("v_priority", "onnx-config", "default_priority_level", "range [1, 2]")],
    ),
    "preserve_ordering_delay": (
        lambda r: onnx_model(
            r,
            "v_ordering",
            "dynamic_batching { preserve_ordering: true, default_queue_policy { "
            "timeout_action: DELAY, default_timeout_microseconds: 100 } }",
        ),
        [("v_ordering", "onnx-config", "timeout_action", "cannot have DELAY")],
    ),
    "cpu_group_with_gpus": (
        lambda r: onnx_model(r, "v_cpugpu", "instance_group [ { kind: KIND_CPU, gpus: [ 0 ] } ]"),
        [("v_cpugpu", "onnx-config", "instance_group[0].gpus", "specifies one or more GPUs")],
    ),
    "ensemble_scheduling_not_ensemble": (
        lambda r: onnx_model(r, "v_notens", 'ensemble_scheduling { step [ { model_name: "x" } ] }'),
        [("v_notens", "onnx-config", "ensemble_scheduling", "only for platform 'ensemble'")],
    ),
    "host_policy_not_given": (
        lambda r: onnx_model(
            r, "v_hostpol", 'instance_group [ { kind: KIND_CPU, host_policy: "numa9" } ]'
        ),
        [
            (
                "v_hostpol",
                "onnx-config",
                "instance_group",
                "host policy 'numa9', which was not given",
            )
        ],
    ),
    # --- ONNX files
    "onnx_dims_disagree": (
        lambda r: onnx_model(
            r, "o_dims", io=TINY_IO.replace("dims: [ 4 ] } ]\noutput", "dims: [ 5 ] } ]\noutput")
        ),
        [("o_dims", "onnx-config", "input[0].dims", "disagree with the model file")],
    ),
    "onnx_datatype_disagree": (
        lambda r: onnx_model(
            r,
            "o_dtype",
            io=TINY_IO.replace(
                "TYPE_FP32, dims: [ 4 ] } ]\noutput", "TYPE_INT32, dims: [ 4 ] } ]\noutput"
            ),
        ),
        [("o_dtype", "onnx-config", "input[0].data_type", "disagrees with the model file")],
    ),
    "onnx_unknown_tensor": (
        lambda r: onnx_model(r, "o_name", io=TINY_IO.replace('"INPUT0"', '"IMAGE"')),
        [("o_name", "onnx-config", "input[0].name", "unknown input 'IMAGE'")],
    ),
    "onnx_cannot_batch": (
        lambda r: onnx_model(r, "o_batch", shape=[1, 4]),
        [("o_batch", "onnx-config", "dims", "not a variable-size batch dimension")],
    ),
    "onnx_corrupt": (
        lambda r: (
            onnx_model(r, "o_corrupt")
            and (r / "o_corrupt" / "1" / "model.onnx").write_bytes(b"\x08\x01garbage" * 100)
        ),
        [
            ("o_corrupt", "onnx-checker", "", "Unable to parse proto"),
            ("o_corrupt", "onnx-config", "", "INVALID_PROTOBUF"),
        ],
    ),
    "onnx_invalid_graph": (
        lambda r: (
            write_onnx(
                r / "o_graph" / "1" / "model.onnx",
                [("INPUT0", F32, ["batch", 4])],
                [("OUTPUT0", F32, ["batch", 4])],
                op="NoSuchOperator",
            )
            and (r / "o_graph" / "config.pbtxt").write_text('platform: "onnxruntime_onnx"\n')
        ),
        [("o_graph", "onnx-checker", "", "NoSuchOperator"), ("o_graph", "onnx-config", "", "")],
    ),
    "model_file_missing": (
        lambda r: onnx_model(r, "o_missing") and (r / "o_missing" / "1" / "model.onnx").unlink(),
        [("o_missing", "model-file", "", "does not exist")],
    ),
    # --- python models (imported in a worker process)
    "python_raises_on_import": (
        lambda r: copy_check_model(r, "raises_on_import"),
        [("raises_on_import", "python-import", "import", "a_package_that_is_not_installed")],
    ),
    "python_autocomplete_raises": (
        lambda r: copy_check_model(r, "autocomplete_raises"),
        [
            (
                "autocomplete_raises",
                "python-import",
                "auto_complete_config",
                "tensor list is not ready",
            )
        ],
    ),
    "python_no_model_class": (
        lambda r: copy_check_model(r, "no_model_class"),
        [("no_model_class", "python-import", "import", "does not define class TritonPythonModel")],
    ),
    "python_hangs_on_import": (
        lambda r: copy_check_model(r, "hangs_on_import"),
        [("hangs_on_import", "python-import", "auto_complete_config", "did not answer within")],
    ),
    # --- ensembles (validate_ensemble, as serve)
    # --- health parameters (health_params, as a load)
    "health_hang_bound_type": (
        lambda r: onnx_model(r, "h_hang", params(instance_hang_timeout="soon")),
        [("h_hang", "health", "parameters.instance_hang_timeout", "number of seconds >= 0")],
    ),
    "health_probe_unknown_input": (
        lambda r: onnx_model(
            r, "h_input", params(probe_interval="1", probe_input='{"IMAGE": [[1, 2, 3, 4]]}')
        ),
        [("h_input", "health", "parameters.probe_input", "names input 'IMAGE'")],
    ),
    "health_probe_input_shape": (
        lambda r: onnx_model(
            r, "h_shape", params(probe_interval="1", probe_input='{"INPUT0": [[1, 2, 3]]}')
        ),
        [("h_shape", "health", "parameters.probe_input", "shape")],
    ),
    "health_probe_without_input": (
        lambda r: onnx_model(r, "h_none", params(probe_interval="1", probe_failures="two")),
        [
            ("h_none", "health", "parameters.probe_failures", "integer >= 1"),
        ],
    ),
    "health_probe_on_ensemble": (
        lambda r: (
            ensemble(r, "e_probe", step("step_f32", "IN", "OUT"))
            or (r / "e_probe" / "config.pbtxt").open("a").write(params(probe_interval="2"))
        ),
        [("e_probe", "health", "parameters.probe_interval", "canary probes need a model")],
    ),
    "ensemble_no_steps": (
        lambda r: ensemble(r, "e_nosteps", ""),
        [("e_nosteps", "ensemble", "ensemble_scheduling.step", "at least one")],
    ),
    "ensemble_instance_group": (
        lambda r: (
            ensemble(r, "e_group", step("step_f32", "IN", "OUT"))
            or (r / "e_group" / "config.pbtxt").open("a").write("instance_group [ { count: 1 } ]\n")
        ),
        [("e_group", "ensemble", "instance_group", "must not be specified for an ensemble")],
    ),
    "ensemble_step_missing": (
        lambda r: ensemble(r, "e_missing", step("nowhere", "IN", "OUT")),
        [
            (
                "e_missing",
                "ensemble",
                "step[0].model_name",
                "'nowhere', which is not in the repository",
            )
        ],
    ),
    "ensemble_produced_twice": (
        lambda r: ensemble(
            r, "e_twice", step("step_f32", "IN", "OUT") + " " + step("step_f32", "IN", "OUT")
        ),
        [("e_twice", "ensemble", "output_map", "produced twice")],
    ),
    "ensemble_input_not_read": (
        lambda r: ensemble(
            r,
            "e_unread",
            step("step_f32", "IN", "OUT"),
            inputs='input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] },'
            ' { name: "EXTRA", data_type: TYPE_FP32, dims: [ 4 ] } ]',
        ),
        [("e_unread", "ensemble", "input", "ensemble input 'EXTRA' is not read by any step")],
    ),
    "ensemble_output_not_produced": (
        lambda r: ensemble(r, "e_noout", step("step_f32", "IN", "OTHER")),
        [("e_noout", "ensemble", "output", "ensemble output 'OUT' is not produced")],
    ),
    # --- warm-up samples (model_warmup), as serve checks them before running them
    "warmup_unknown_input": (
        lambda r: warm(r, "w_unknown", warm_input("NOPE")),
        [("w_unknown", "warmup", "model_warmup[0].inputs[NOPE]", "the model has no such input")],
    ),
    "warmup_file_leaves_folder": (
        lambda r: warm(r, "w_escape", warm_input(data='input_data_file: "../config.pbtxt"')),
        [
            (
                "w_escape",
                "warmup",
                "model_warmup[0].inputs[INPUT0].input_data_file",
                "input_data_file '../config.pbtxt' leaves the model's warmup/ folder",
            )
        ],
    ),
    "warmup_file_missing": (
        lambda r: warm(r, "w_missing", warm_input(data='input_data_file: "absent.bin"')),
        [
            (
                "w_missing",
                "warmup",
                "model_warmup[0].inputs[INPUT0].input_data_file",
                "cannot read input_data_file 'absent.bin'",
            )
        ],
    ),
    "warmup_file_short": (
        lambda r: warm(
            r,
            "w_short",
            warm_input(data='input_data_file: "short.bin"'),
            files={"short.bin": bytes(8)},
        ),
        [
            (
                "w_short",
                "warmup",
                "model_warmup[0].inputs[INPUT0].input_data_file",
                "input_data_file 'short.bin' holds 8 bytes, shape needs 16",
            )
        ],
    ),
    "warmup_dims_mismatch": (
        lambda r: warm(r, "w_dims", warm_input(dims="5")),
        [("w_dims", "warmup", "model_warmup[0]", "unexpected shape for input 'INPUT0'")],
    ),
    "warmup_batch_too_big": (
        lambda r: warm(r, "w_batch", warm_input(data="random_data: true"), batch_size=16),
        [("w_batch", "warmup", "model_warmup[0]", "batch-size must be <= 8")],
    ),
    "ensemble_cycle": (
        lambda r: ensemble(
            r,
            "e_cycle",
            step("step_f32", "T2", "T1") + " " + step("step_f32", "T1", "T2"),
            inputs="",
            outputs='output [ { name: "T1", data_type: TYPE_FP32, dims: [ 4 ] } ]',
        ),
        [("e_cycle", "ensemble", "ensemble_scheduling.step", "cycle")],
    ),
    "ensemble_mutual_cycle": (
        lambda r: mutual_ensembles(r, "e_mutual_a", "e_mutual_b"),
        [
            (
                "e_mutual_a",
                "ensemble",
                "ensemble_scheduling.step[0].model_name",
                "circular dependency between ensembles: e_mutual_a -> e_mutual_b -> e_mutual_a",
            ),
            (
                "e_mutual_b",
                "ensemble",
                "ensemble_scheduling.step[0].model_name",
                "circular dependency between ensembles: e_mutual_b -> e_mutual_a -> e_mutual_b",
            ),
        ],
    ),
    "ensemble_datatype_mismatch": (
        lambda r: ensemble(
            r,
            "e_dtype",
            step("step_i32", "IN", "OUT"),
            outputs='output [ { name: "OUT", data_type: TYPE_INT32, dims: [ 4 ] } ]',
        ),
        [("e_dtype", "ensemble", "input_map", "datatype mismatch")],
    ),
    "ensemble_shape_mismatch": (
        lambda r: ensemble(
            r,
            "e_shape",
            step("step_f32", "IN", "OUT"),
            inputs='input [ { name: "IN", data_type: TYPE_FP32, dims: [ 5 ] } ]',
        ),
        [("e_shape", "ensemble", "input_map", "shape mismatch")],
    ),
    "ensemble_unknown_model_input": (
        lambda r: ensemble(
            r, "e_badkey", step("step_f32", "IN", "OUT").replace('key: "INPUT0"', 'key: "NOPE"')
        ),
        [("e_badkey", "ensemble", "input_map", "'NOPE', which is not an input of the model")],
    ),
    # --- MODEL_IDENTITY.json and goldens
    "identity_sha256": (
        lambda r: identity(r, "i_sha", {"sha256": "0" * 64}),
        [("i_sha", "identity", "sha256", "is not the one recorded")],
    ),
    "identity_size": (
        lambda r: identity(r, "i_size", {"size_bytes": 3}),
        [("i_size", "identity", "size_bytes", "records 3")],
    ),
    "identity_not_json": (
        lambda r: (
            identity(r, "i_json")
            or (r / "i_json" / "1" / "MODEL_IDENTITY.json").write_text("{oops")
        ),
        [("i_json", "identity", "", "not valid JSON")],
    ),
    "identity_other_model": (
        lambda r: identity(r, "i_other", {"model": "tiny", "version": 2}),
        [
            ("i_other", "identity", "model", "records model 'tiny'"),
            ("i_other", "identity", "version", "records version 2"),
        ],
    ),
    "identity_other_file": (
        lambda r: identity(r, "i_file", {"model_file": "model_v0.onnx"}),
        [
            ("i_file", "identity", "model_file", "the configuration loads 'model.onnx'"),
            ("i_file", "identity", "model_file", "does not exist"),
        ],
    ),
    "identity_outside_version_folder": (
        lambda r: identity(r, "i_escape", {"model_file": "../../i_sha/1/model.onnx"}),
        [("i_escape", "identity", "model_file", "is not a file of the version folder")],
    ),
    "golden_differs": (
        lambda r: identity(r, "g_differs", golden=({"INPUT0": X}, {"OUTPUT0": X + 1e-3})),
        [("g_differs", "golden", "OUTPUT0", "8 of 8 values differ by more than atol")],
    ),
    "golden_shape": (
        lambda r: identity(r, "g_shape", golden=({"INPUT0": X}, {"OUTPUT0": X[:1]})),
        [("g_shape", "golden", "OUTPUT0", "shape [2, 4], golden [1, 4]")],
    ),
    "golden_file_missing": (
        lambda r: (
            identity(r, "g_nofile", golden=({"INPUT0": X}, {"OUTPUT0": X}))
            or (r / "g_nofile" / "1" / "golden.npz").unlink()
        ),
        [("g_nofile", "golden", "", "cannot read golden.npz")],
    ),
    "golden_malformed": (
        lambda r: identity(
            r, "g_bad", {"golden": {"file": "golden.npz", "inputs": [], "atol": -1}}
        ),
        [
            (
                "g_bad",
                "golden",
                "golden.inputs",
                "malformed golden entry: golden.inputs, golden.outputs, golden.atol",
            )
        ],
    ),
}


def build(repo: Path, kinds: list[str]) -> Expect:
    repo.mkdir(parents=True, exist_ok=True)
    expected: Expect = []
    for kind in kinds:
        builder, expect = CASES[kind]
        builder(repo)
        expected.extend(expect)
    return expected


def check(repo: Path, **options: Any) -> Report:
    options.setdefault("timeout_s", 2.0)
    return check_repository(repo, CheckOptions(**options))


def assert_found(report: Report, expected: Expect) -> None:
    problems = [p for p in report.problems if p.severity == "error"]
    for model, check_name, field, fragment in expected:
        hits = [
            p
            for p in problems
            if p.model == model
            and p.check == check_name
            and field in p.field
            and fragment in p.message
        ]
        assert hits, (
            f"no {check_name} problem on {model} with field ~{field!r} and {fragment!r}; got:\n"
            + "\n".join(f"  {p.model} {p.check} {p.field!r}: {p.message}" for p in problems)
        )


# --------------------------------------------------------------------------- one kind each


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_kind_of_problem_is_reported(tmp_path: Path, kind: str) -> None:
    repo = tmp_path / "repo"
    expected = build(repo, [kind])
    report = check(repo)
    assert_found(report, expected)
    assert report.exit_code == 1
    # the models the case did not break (shared ensemble steps) are clean
    broken = {m for m, *_ in expected}
    for m in report.models:
        if m.name not in broken:
            assert m.ok, (m.name, [p.message for p in m.problems])


def test_every_problem_of_a_broken_repository_is_reported_in_one_run(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    expected = build(repo, sorted(CASES))
    onnx_model(repo, "z_clean")  # a clean model among them stays clean
    report = check(repo)
    assert_found(report, expected)
    assert {m.name for m in report.models if not m.ok} == {m for m, *_ in expected}
    assert next(m for m in report.models if m.name == "z_clean").ok
    # every result renders in every format
    assert json.loads(render(report, "json"))["summary"]["errors"] == report.errors
    root = ET.fromstring(render(report, "junit"))
    assert int(root.get("failures", "0")) == sum(r.status == "failed" for r in report.all_results)
    assert "FAILED" in render(report, "human")


def test_several_errors_in_one_configuration_are_all_reported(tmp_path: Path) -> None:
    onnx_model(
        tmp_path,
        "many",
        "dynamic_batching { preferred_batch_size: [ 16 ], priority_levels: 2, "
        "default_priority_level: 5 }\ninstance_group [ { kind: KIND_CPU, gpus: [ 1 ] } ]",
    )
    report = check(tmp_path)
    fields = sorted(p.field for p in report.problems)
    assert fields == [
        "dynamic_batching.default_priority_level",
        "dynamic_batching.preferred_batch_size",
        "instance_group[0].gpus",
    ]


def test_validation_still_runs_when_auto_complete_fails(tmp_path: Path) -> None:
    # dims disagree with the model (auto-complete) AND a preferred size too big (validation)
    io = TINY_IO.replace("dims: [ 4 ] } ]\noutput", "dims: [ 5 ] } ]\noutput")
    onnx_model(tmp_path, "both", "dynamic_batching { preferred_batch_size: [ 32 ] }", io=io)
    report = check(tmp_path)
    assert {p.field for p in report.problems} == {
        "input[0].dims",
        "dynamic_batching.preferred_batch_size",
    }


def test_same_messages_as_serve(tmp_path: Path) -> None:
    """The check's message is the one the model manager logs when the load fails."""
    import asyncio

    from pdserve.repository.manager import ModelManager

    onnx_model(tmp_path, "m", "dynamic_batching { preferred_batch_size: [ 16 ] }")
    report = check(tmp_path)
    (problem,) = report.problems
    manager = ModelManager(tmp_path)
    with pytest.raises(Exception) as e:
        asyncio.run(manager.load_model("m"))
    assert f"{problem.path}: {problem.field}: {problem.message}" in str(e.value)


def test_every_warmup_problem_is_reported_with_serves_message(tmp_path: Path) -> None:
    """Several bad samples and inputs in one model: each is reported with its field, and the
    first is the message serve fails the load with (serve stops there)."""
    import asyncio

    from pdserve.server import InferenceServer

    absolute = warm_input(data='input_data_file: "/etc/passwd"')
    ok_file = warm_input(data='input_data_file: "ok.bin"')
    d = onnx_model(
        tmp_path,
        "m",
        f'model_warmup [ {{ name: "a", batch_size: 1, {absolute} {warm_input("EXTRA")} }}, '
        '{ name: "b", batch_size: 2, inputs { key: "INPUT0" value: '
        "{ data_type: TYPE_INT32, dims: [ 4 ], zero_data: true } } }, "
        f'{{ name: "c", batch_size: 1, {ok_file} }} ]',
    )
    (d / "warmup").mkdir()
    (d / "warmup" / "ok.bin").write_bytes(np.arange(4, dtype="<f4").tobytes())
    onnx_model(tmp_path, "fine", f'model_warmup [ {{ name: "z", {warm_input()} }} ]')
    report = check(tmp_path)
    fine = next(m for m in report.models if m.name == "fine")
    assert fine.ok and [r.status for r in fine.results if r.check == "warmup"] == ["passed"]
    got = [(p.check, p.field, p.message) for p in report.problems]
    assert got == [
        (
            "warmup",
            "model_warmup[0].inputs[EXTRA]",
            "warm-up sample 'a' input 'EXTRA': the model has no such input",
        ),
        (
            "warmup",
            "model_warmup[0].inputs[INPUT0].input_data_file",
            "warm-up sample 'a' input 'INPUT0': input_data_file must be a path relative to "
            "the model's warmup/ folder",
        ),
        (
            "warmup",
            "model_warmup[1]",
            "warm-up sample 'b' failed: inference input 'INPUT0' data-type is 'INT32', but "
            "model 'm' expects 'FP32'",
        ),
    ]
    assert all(p.path == str(d / "config.pbtxt") for p in report.problems)

    async def serve_load() -> str:
        server = InferenceServer(tmp_path)
        await server.start()
        try:
            with pytest.raises(Exception) as e:
                await server.manager.load_model("m")
            return str(e.value)
        finally:
            await server.stop(5)

    assert got[0][2] in asyncio.run(serve_load())


def test_every_ensemble_of_a_cycle_and_every_step_problem_is_reported(tmp_path: Path) -> None:
    """A 3-cycle between ensembles, a self-loop, missing steps and generic errors in one
    repository: each ensemble of a cycle reports it, with its other problems; an ensemble
    stepping into the cycle is skipped (its step has problems), not reported as in it."""
    ensemble(
        tmp_path,
        "ea",
        step("eb", "IN", "OUT"),
        inputs='input [ { name: "IN", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
        "instance_group [ { count: 1 } ]",
    )
    ensemble(
        tmp_path,
        "eb",
        step("ec", "IN", "T") + " " + step("gone1", "T", "U") + " " + step("gone2", "U", "OUT"),
    )
    ensemble(tmp_path, "ec", step("ea", "IN", "OUT"))
    ensemble(tmp_path, "loop", step("loop", "IN", "OUT"))
    ensemble(tmp_path, "user", step("eb", "IN", "OUT") + " " + step("step_f32", "IN", "X"))
    report = check(tmp_path)
    got = {(p.model, p.field, p.message) for p in report.problems if p.severity == "error"}
    step0 = "ensemble_scheduling.step[0].model_name"
    cycle = "circular dependency between ensembles: "
    assert got == {
        ("ea", step0, cycle + "ea -> eb -> ec -> ea"),
        ("ea", "instance_group", "instance groups must not be specified for an ensemble"),
        ("eb", step0, cycle + "eb -> ec -> ea -> eb"),
        (
            "eb",
            "ensemble_scheduling.step[1].model_name",
            "ensemble 'eb': step 1 uses model 'gone1', which is not in the repository",
        ),
        (
            "eb",
            "ensemble_scheduling.step[2].model_name",
            "ensemble 'eb': step 2 uses model 'gone2', which is not in the repository",
        ),
        ("ec", step0, cycle + "ec -> ea -> eb -> ec"),
        ("loop", step0, cycle + "loop -> loop"),
    }
    user = next(m for m in report.models if m.name == "user")
    (result,) = [r for r in user.results if r.check == "ensemble"]
    assert result.status == "skipped"
    assert (
        result.skipped == "step 0 uses model 'eb', which has problems of its own (fix them first)"
    )


def test_a_broken_step_model_skips_its_ensemble(tmp_path: Path) -> None:
    steps(tmp_path)
    (tmp_path / "step_f32" / "1" / "model.onnx").write_bytes(b"not onnx")
    ensemble(tmp_path, "pipe", step("step_f32", "IN", "OUT"))
    report = check(tmp_path)
    pipe = next(m for m in report.models if m.name == "pipe")
    (result,) = [r for r in pipe.results if r.check == "ensemble"]
    assert result.status == "skipped"
    assert "'step_f32', which has problems of its own" in result.skipped
    assert pipe.ok and report.exit_code == 1


def test_served_only_skips_versions_the_policy_does_not_load(tmp_path: Path) -> None:
    onnx_model(tmp_path, "m")
    write_onnx(
        tmp_path / "m" / "2" / "model.onnx",
        [("INPUT0", F32, ["b", 4])],
        [("OUTPUT0", F32, ["b", 4])],
    )
    (tmp_path / "m" / "1" / "model.onnx").write_bytes(b"broken old version")
    assert check(tmp_path).exit_code == 1
    report = check(tmp_path, served_only=True)
    assert report.exit_code == 0
    assert {r.version for r in report.models[0].results} == {None, 2}


def test_onnx_checker_says_which_extra_when_onnx_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "onnx" else real(name, *a)
    )
    onnx_model(tmp_path, "m")
    report = check(tmp_path)
    (result,) = [r for r in report.models[0].results if r.check == "onnx-checker"]
    assert result.status == "skipped"
    assert "pip install 'pdserve[check]'" in result.skipped
    assert report.exit_code == 0 and report.warnings == 1


def test_a_good_python_model_and_its_auto_complete(tmp_path: Path) -> None:
    copy_check_model(tmp_path, "good_python")
    report = check(tmp_path)
    assert report.exit_code == 0, [p.message for p in report.problems]
    (m,) = report.models
    version, cfg = m.default_config() or (0, None)
    assert version == 1 and [i.name for i in cfg.input] == ["IN"]


def test_an_empty_repository_is_a_warning(tmp_path: Path) -> None:
    report = check(tmp_path)
    assert report.exit_code == 0 and report.warnings == 1


# --------------------------------------------------------------------------- rules

RULES = """
[[rule]]
name = "batch-cap"
field = "max_batch_size"
max = 4

[[rule]]
name = "dynamic-batching"
field = "dynamic_batching"
required = true
exclude_backends = ["ensemble"]
message = "the team batches every model"

[[rule]]
name = "instances"
field = "instance_group[*].count"
min = 1
max = 1

[[rule]]
name = "allowed-backends"
field = "backend"
one_of = ["onnxruntime"]
exclude_backends = ["ensemble"]
severity = "warning"

[[rule]]
name = "no-gpu"
field = "instance_group[*].kind"
none_of = ["KIND_GPU"]
models = ["m*"]
"""


def test_rules_are_applied_to_the_completed_configuration(tmp_path: Path) -> None:
    rules_file = tmp_path / "rules.toml"
    rules_file.write_text(RULES)
    repo = tmp_path / "repo"
    onnx_model(repo, "m_onnx")  # max_batch_size 8, no dynamic_batching, 2 CPU instances by default
    onnx_model(repo, "m_good", "dynamic_batching { }\ninstance_group [ { count: 1 } ]", mbs=4)
    copy_check_model(repo, "good_python")  # python: 1 instance, dynamic_batching set
    report = check(repo, rules=load_rules(rules_file))
    got = sorted((p.model, p.check, p.severity, p.message) for p in report.problems)
    assert got == [
        (
            "good_python",
            "rule:allowed-backends",
            "warning",
            'backend is "python": must be one of "onnxruntime"',
        ),
        ("good_python", "rule:batch-cap", "error", "max_batch_size is 8: must be <= 4"),
        ("m_onnx", "rule:batch-cap", "error", "max_batch_size is 8: must be <= 4"),
        (
            "m_onnx",
            "rule:dynamic-batching",
            "error",
            "dynamic_batching is required but not set (the team batches every model)",
        ),
        ("m_onnx", "rule:instances", "error", "instance_group[0].count is 2: must be <= 1"),
    ]


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[[rule]]\nfield = 'max_batch_size'\nmaxx = 3\n", "unknown key(s) maxx"),
        ("[[rule]]\nfield = 'max_batch_size'\n", "no test"),
        ("[[rule]]\nmax = 3\n", "'field' (a dotted path) is required"),
        ("[[rule]]\nfield = 'a..b'\nrequired = true\n", "segment ''"),
        ("[[rule]]\nfield = 'x'\nmax = 'big'\n", "'max' must be a number"),
        ("[[rule]]\nfield = 'x'\nrequired = true\nseverity = 'fatal'\n", "'severity'"),
        ("[[rule]]\nfield = 'x'\nrequired = true\nmodels = 'a'\n", "list of strings"),
        ("[checks]\nx = 1\n", "unknown top-level key(s) checks"),
        ("[[rule]\n", "not valid TOML"),
    ],
)
def test_a_bad_rules_file_is_a_usage_error(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "rules.toml"
    path.write_text(text)
    with pytest.raises(RulesError, match=None) as e:
        load_rules(path)
    assert fragment in str(e.value)


def test_rule_field_paths() -> None:
    (rule,) = parse_rules({"rule": [{"field": "input[*].dims", "max": 64}]})
    cfg = {"input": [{"dims": [3, 224]}, {"dims": [-1]}]}
    assert rule.evaluate(cfg) == ["input[0].dims is 224: must be <= 64"]
    (rule,) = parse_rules({"rule": [{"field": "input[1].name", "equals": "b"}]})
    assert rule.evaluate({"input": [{"name": "a"}, {"name": "c"}]}) == [
        'input[1].name is "c": must equal "b"'
    ]


# --------------------------------------------------------------------------- examples


@pytest.fixture(scope="module")
def example_report() -> Report:
    require_examples()
    return check_repository(EXAMPLE_REPO)


def test_the_example_repository_checks_clean_goldens_included(example_report: Report) -> None:
    report = example_report
    assert report.exit_code == 0, render(report, "human")
    assert report.warnings == 0
    assert all(r.status == "passed" for r in report.all_results)
    names = {m.name for m in report.models}
    assert {"image_classifier", "text_embedding", "tiny", "efficientnet_lite0"} <= names
    # every ONNX version's golden outputs were reproduced, every python model imported
    for m in report.models:
        checks = {(r.check, r.version) for r in m.results}
        for v in m.versions:
            if m.backend == "onnxruntime":
                assert {("onnx-checker", v), ("identity", v), ("golden", v)} <= checks, m.name
            if m.backend == "python":
                assert ("python-import", v) in checks
            if m.platform == "ensemble":
                assert ("ensemble", v) in checks


def test_json_and_junit_reports_parse(example_report: Report) -> None:
    data = json.loads(render(example_report, "json"))
    assert data["ok"] is True
    assert data["summary"]["errors"] == 0
    assert data["summary"]["models"] == len(example_report.models)
    assert data["problems"] == []
    tiny = next(m for m in data["models"] if m["name"] == "tiny")
    assert tiny["versions"] == [1, 2] and tiny["served_versions"] == [2]
    root = ET.fromstring(render(example_report, "junit"))
    assert root.tag == "testsuites"
    assert int(root.get("tests", "0")) == len(example_report.all_results)
    assert root.get("failures") == "0"
    suites = {s.get("name"): s for s in root.iter("testsuite")}
    assert {c.get("name") for c in suites["tiny"].iter("testcase")} >= {"golden v1", "golden v2"}


# --------------------------------------------------------------------------- CLI


def test_help_and_usage_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["check", "--help"])
    assert e.value.code == 0
    assert "--rules" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["check", str(tmp_path), "--format", "yaml"])
    assert e.value.code == 2
    assert main(["check", str(tmp_path / "nowhere")]) == 2
    bad = tmp_path / "rules.toml"
    bad.write_text("[[rule]]\nfield = 'x'\n")
    assert main(["check", str(tmp_path), "--rules", str(bad)]) == 2
    assert main(["check", str(tmp_path), "--timeout", "0"]) == 2


def test_cli_subprocess_exit_codes_and_reports(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    build(repo, ["onnx_dims_disagree", "identity_sha256"])
    copy_check_model(repo, "good_python")  # prints on stdout when imported
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pdserve", "check", str(repo)]
    junit_path = tmp_path / "report.xml"
    run = subprocess.run(
        [*cmd, "--format", "junit", "-o", str(junit_path)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
    )
    assert run.returncode == 1, run.stderr
    assert "2 errors" in run.stderr and "FAILED" in run.stderr
    root = ET.parse(junit_path).getroot()
    failures = {
        (c.get("classname"), c.get("name"))
        for c in root.iter("testcase")
        if c.find("failure") is not None
    }
    assert failures == {
        ("pdserve.check.o_dims", "onnx-config v1"),
        ("pdserve.check.i_sha", "identity v1"),
    }
    run = subprocess.run(
        [*cmd, "--format", "json"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120
    )
    assert run.returncode == 1
    data = json.loads(run.stdout)
    assert sorted(p["field"] for p in data["problems"]) == ["input[0].dims", "sha256"]
    assert "good_python: imported" in run.stderr  # not in the report on stdout
    shutil.rmtree(repo / "o_dims")
    shutil.rmtree(repo / "i_sha")
    assert main(["check", str(repo)]) == 0


def test_a_malformed_traffic_file_is_reported(tmp_path: Path) -> None:
    onnx_model(tmp_path, "m")
    (tmp_path / "m" / "traffic.yaml").write_text("weights: {1: 60}\n")
    report = check(tmp_path)
    assert report.exit_code == 1
    problems = [p for p in report.problems if p.severity == "error"]
    assert any("weights sum to 60" in p.message for p in problems), problems
    (tmp_path / "m" / "traffic.yaml").write_text("weights: {1: 100}\n")
    assert check(tmp_path).exit_code == 0


def test_ensemble_cycles_and_order() -> None:
    from pdserve.app.check_ensembles import ensemble_cycles, ensemble_order
    from pdserve.repository.layout import ModelDir

    steps = {"a": ["b", "m"], "b": ["a"], "c": ["a", "m"], "d": ["m"]}
    cycles = ensemble_cycles(steps)
    assert cycles == {"a": [(0, ["a", "b", "a"])], "b": [(0, ["b", "a", "b"])]}
    dirs = [ModelDir(name, Path(name)) for name in ("c", "a", "b", "d")]
    order = [m.name for m in ensemble_order(dirs, steps, cycles)]
    assert order.index("c") > order.index("a")  # c steps into a: checked after it


def test_golden_compare_says_what_differs() -> None:
    from pdserve.app.check_golden import compare

    want = np.array([1.0, 2.0, 3.0], np.float32)
    assert compare(want.copy(), want, 0.0, 0.0) is None
    assert compare(want + 1e-6, want, 1e-3, 0.0) is None
    off = want + np.array([0, 0, 1], np.float32)
    assert "1 of 3 values differ" in (compare(off, want, 1e-3, 0.0) or "")
    assert compare(want.astype(np.float64), want, 0, 0) == "datatype float64, golden float32"
    assert compare(np.array([1, 2]), np.array([1, 3]), 0, 0) == (
        "1 of 2 values differ from the golden ones (exact match required)"
    )


def test_identity_file_guess_and_inside(tmp_path: Path) -> None:
    from pdserve.app.check_files import guess_model_file, inside, read_identity

    (tmp_path / "model.onnx").write_bytes(b"")
    assert guess_model_file(tmp_path, None) == tmp_path / "model.onnx"
    assert guess_model_file(tmp_path, {"model_file": "other.onnx"}) == tmp_path / "other.onnx"
    (tmp_path / "MODEL_IDENTITY.json").write_text("[1]")
    assert read_identity(tmp_path / "MODEL_IDENTITY.json") is None
    assert inside(tmp_path, tmp_path / "a" / "b") and not inside(tmp_path, tmp_path / "..")


def test_monitoring_settings_and_reference_file_are_checked(tmp_path: Path) -> None:
    """A drift reference file that is missing or lacks the tensor is an error of
    ``parameters``, with the message a load gives; a good one is clean."""
    require_examples()
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLE_REPO / "tiny", repo / "tiny")
    config = repo / "tiny" / "config.pbtxt"
    config.write_text(
        config.read_text()
        + 'parameters { key: "drift" value { string_value: "reference=ref.npz,bins=4" } }\n'
    )

    def monitoring_problems() -> list[str]:
        report = check(repo)
        return [p.message for p in report.problems if p.field == "parameters"]

    assert monitoring_problems() == [
        "monitoring: drift: reference file ref.npz not found beside config.pbtxt"
    ]
    np.savez(repo / "tiny" / "ref.npz", OTHER=np.zeros(100))
    assert monitoring_problems() == [
        "monitoring: drift: reference file ref.npz has no array 'OUTPUT0' (it has ['OTHER'])"
    ]
    np.savez(repo / "tiny" / "ref.npz", OUTPUT0=np.linspace(0, 1, 100))
    assert monitoring_problems() == []


def test_health_parameters_a_load_accepts_pass_and_a_probe_needs_an_input(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    onnx_model(
        repo,
        "h_good",
        params(
            instance_hang_timeout="0.5",
            is_ready_interval="2",
            probe_interval="1",
            probe_failures="2",
            probe_input='{"INPUT0": [[1, 2, 3, 4]]}',
        ),
    )
    onnx_model(repo, "h_noinput", params(probe_interval="1"))
    onnx_model(repo, "h_plain")
    report = check(repo)
    by_model = {m.name: m for m in report.models}
    health = [r for r in by_model["h_good"].results if r.check == "health"]
    assert len(health) == 1 and not health[0].problems and by_model["h_good"].ok
    assert not [r for r in by_model["h_plain"].results if r.check == "health"]
    assert_found(report, [("h_noinput", "health", "parameters.probe_interval", "needs an input")])
