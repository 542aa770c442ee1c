"""The ModelConfig field table: complete, applied at load, and the reference page fresh."""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from tritonclient.grpc import model_config_pb2

from pdserve import config as cfgmod
from pdserve.backends.base import ModelSpec
from pdserve.config import reference_page
from pdserve.config.field_support import FIELDS, Status, _is_repeated, descriptor_paths
from pdserve.repository import layout
from pdserve.repository.prepare import backend_for, complete_config, read_config
from tests.conftest import EXAMPLE_REPO, ROOT, require_examples

PAGE = ROOT / "docs" / "reference" / "model-config.md"


def test_every_field_of_the_protobuf_is_classified() -> None:
    """A field Triton adds to ModelConfig (at any depth) fails here until classified."""
    paths = list(descriptor_paths())
    assert len(paths) == len(set(paths))
    missing = [p for p in paths if p not in FIELDS]
    assert missing == [], f"classify these in pdserve/config/field_support.py: {missing}"
    stale = sorted(set(FIELDS) - set(paths))
    assert stale == [], f"not fields of ModelConfig: {stale}"
    for leaf in ("instance_group.rate_limiter.resources.global", "parameters.string_value"):
        assert leaf in paths


def test_every_entry_has_a_reason_and_a_sane_backend_rule() -> None:
    for path, support in FIELDS.items():
        assert support.reason.strip(), path
        if support.otherwise is not None:
            assert support.backends, path
            assert support.otherwise in (Status.REFUSED, Status.IGNORED), path


def _set_path(msg: Message, parts: list[str]) -> None:
    """Set the field at ``parts`` below ``msg`` to a value that is not its default."""
    field = msg.DESCRIPTOR.fields_by_name[parts[0]]
    value = getattr(msg, parts[0])
    sub = field.message_type
    is_map = sub is not None and sub.GetOptions().map_entry
    repeated = _is_repeated(field)
    if is_map:
        vfield = sub.fields_by_name["value"]
        if vfield.type == FieldDescriptor.TYPE_MESSAGE:
            item = value["k"]
            if len(parts) > 1:
                _set_path(item, parts[1:])
            else:
                item.SetInParent()
        else:
            value["k"] = "v"
        return
    if sub is not None:
        item = value.add() if repeated else value
        if len(parts) > 1:
            _set_path(item, parts[1:])
        elif not repeated and sub.fields:  # an empty single message asks nothing: fill it
            _set_path(item, [sub.fields[0].name])
        else:
            item.SetInParent()
        return
    scalar = {
        FieldDescriptor.TYPE_BOOL: True,
        FieldDescriptor.TYPE_STRING: "x",
        FieldDescriptor.TYPE_FLOAT: 0.5,
        FieldDescriptor.TYPE_DOUBLE: 0.5,
        FieldDescriptor.TYPE_ENUM: 1,
    }.get(field.type, 1)
    if repeated:
        value.append(scalar)
    else:
        setattr(msg, parts[0], scalar)


def _config(backend: str = "onnxruntime") -> cfgmod.ModelConfig:
    cfg = cfgmod.ModelConfig(name="m", backend=backend, max_batch_size=4)
    if backend == "onnxruntime":
        cfg.platform = "onnxruntime_onnx"
    cfg.input.add(name="IN", data_type=model_config_pb2.TYPE_FP32, dims=[4])
    cfg.output.add(name="OUT", data_type=model_config_pb2.TYPE_FP32, dims=[4])
    return cfg


def _bare(path: str) -> str:
    return re.sub(r"\[[^\]]*\]", "", path)


REFUSED = [
    (path, backend)
    for path, s in FIELDS.items()
    for backend in ("onnxruntime", "python")
    if s.status_for(backend) is Status.REFUSED
]


@pytest.mark.parametrize(("path", "backend"), REFUSED)
def test_a_refused_field_fails_validation_naming_it(path: str, backend: str) -> None:
    """Each refusal is real: the table cannot say 'refused' for a field that loads."""
    cfg = _config(backend)
    _set_path(cfg, path.split("."))
    errors: list[cfgmod.ConfigError] = []
    cfgmod.validate_config(cfg, "m/config.pbtxt", errors=errors)
    named = [
        e
        for e in errors
        if _bare(e.field) == path
        or (path.startswith(_bare(e.field) + ".") and path.rsplit(".", 1)[1] in e.message)
        or (_bare(e.field).startswith(path + "."))
    ]
    assert named, f"{path} on {backend}: {[str(e) for e in errors]}"
    with pytest.raises(cfgmod.ConfigError):
        cfgmod.validate_config(cfg, "m/config.pbtxt")


def test_an_ignored_field_warns_once_per_model_and_a_quiet_default_does_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = _config()
    cfg.name = "warn_once_model"
    cfg.optimization.cuda.graphs = True
    cfg.optimization.input_pinned_memory.enable = True  # Triton's default: no warning
    cfg.instance_group.add(count=1, kind=model_config_pb2.ModelInstanceGroup.KIND_CPU)
    cfg.instance_group[0].profile.append("0")
    with caplog.at_level(logging.WARNING, logger="pdserve.config"):
        first = cfgmod.validate_config(cfg, "m/config.pbtxt")
        again = cfgmod.validate_config(cfg, "m/config.pbtxt")
    assert first == again
    assert [w.split(" ", 1)[0] for w in first] == [
        "instance_group.profile",
        "optimization.cuda.graphs",
    ]
    assert "optimization.cuda.graphs is ignored: CUDA graphs (TensorRT)" in first[1]
    logged = [r.getMessage() for r in caplog.records if r.name == "pdserve.config"]
    assert len(logged) == 2, logged
    assert logged[1].startswith("model 'warn_once_model': optimization.cuda.graphs is ignored")


def test_backend_specific_rules() -> None:
    """graph.level is honoured by onnxruntime and ignored by python; batch_input is
    refused on python."""
    onnx = _config()
    onnx.optimization.graph.level = 1
    assert cfgmod.validate_config(onnx, "m") == []
    py = _config("python")
    py.optimization.graph.level = 1
    py.optimization.input_pinned_memory.SetInParent()  # enable: false, which changes nothing
    py.optimization.gather_kernel_buffer_threshold = 4
    warnings = cfgmod.validate_config(py, "m", errors=[])
    assert [w.split(" ", 1)[0] for w in warnings] == [
        "optimization.graph.level",
        "optimization.gather_kernel_buffer_threshold",
    ]
    py.batch_input.add(kind=0, target_name=["T"], source_input=["IN"])
    with pytest.raises(
        cfgmod.ConfigError,
        match=r"batch_input\.target_name: not supported by pdserve with backend 'python'",
    ):
        cfgmod.validate_config(py, "m")


def _load(repo: Path, name: str) -> list[str]:
    """The real loader's configuration steps for version 1 of ``name``."""
    mdir = layout.scan_repository(repo)[name]
    cfg = read_config(mdir)
    spec = ModelSpec(
        name=name,
        version=1,
        config=cfg,
        model_dir=mdir.path,
        version_dir=layout.version_path(mdir.path, 1),
        repository=repo,
    )
    return asyncio.run(complete_config(spec, backend_for(cfg)))


def test_the_loader_refuses_and_warns_on_a_real_repository(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    require_examples()
    for name in ("fs_refused", "fs_ignored"):
        shutil.copytree(EXAMPLE_REPO / "tiny", tmp_path / name, symlinks=True)
        text = (tmp_path / name / "config.pbtxt").read_text().replace('"tiny"', f'"{name}"')
        (tmp_path / name / "config.pbtxt").write_text(text)
    with open(tmp_path / "fs_refused" / "config.pbtxt", "a") as f:
        f.write('model_repository_agents { agents [ { name: "checksum" } ] }\n')
    with open(tmp_path / "fs_ignored" / "config.pbtxt", "a") as f:
        f.write("optimization { cuda { busy_wait_events: true } }\n")
    with pytest.raises(cfgmod.ConfigError) as info:
        _load(tmp_path, "fs_refused")
    assert str(info.value) == (
        "fs_refused/config.pbtxt: model_repository_agents.agents.name: not supported by "
        "pdserve: pdserve runs no repository agents"
    )
    with caplog.at_level(logging.WARNING, logger="pdserve.config"):
        warnings = _load(tmp_path, "fs_ignored")
    assert warnings == [
        "optimization.cuda.busy_wait_events is ignored: CUDA event busy-waiting; a GPU "
        "execution hint; pdserve's answers do not depend on it"
    ]
    assert f"model 'fs_ignored': {warnings[0]}" in caplog.text


def test_the_committed_reference_page_is_fresh() -> None:
    """Regenerate with: python -m pdserve.config.reference_page > docs/reference/model-config.md"""
    assert PAGE.read_text() == reference_page.markdown(), (
        "docs/reference/model-config.md is stale: run "
        "`python -m pdserve.config.reference_page > docs/reference/model-config.md`"
    )


def test_the_page_command_prints_every_field() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.config.reference_page"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert len(rows) == len(FIELDS)
    assert "| `instance_group.passive` | ignored |" in out
    assert "| `batch_input.kind` | honoured (onnxruntime); refused elsewhere |" in out
    bad = subprocess.run(
        [sys.executable, "-m", "pdserve.config.reference_page", "--bogus"],
        cwd=ROOT,
        capture_output=True,
    )
    assert bad.returncode == 2


def test_a_configuration_as_triton_serves_it_loads_without_a_word() -> None:
    """Triton writes empty messages and default values in every configuration it serves
    (GET /v2/models/<m>/config); fed back (a config override), nothing is refused or
    warned about."""
    served = {
        "name": "m",
        "platform": "onnxruntime_onnx",
        "backend": "onnxruntime",
        "max_batch_size": 4,
        "input": [{"name": "IN", "data_type": "TYPE_FP32", "dims": [4], "format": "FORMAT_NONE"}],
        "output": [{"name": "OUT", "data_type": "TYPE_FP32", "dims": [4]}],
        "batch_input": [],
        "batch_output": [],
        "optimization": {
            "priority": "PRIORITY_DEFAULT",
            "cuda": {"graphs": False, "busy_wait_events": False, "output_copy_stream": False},
            "input_pinned_memory": {"enable": True},
            "output_pinned_memory": {"enable": True},
            "gather_kernel_buffer_threshold": 0,
            "eager_batching": False,
        },
        "instance_group": [
            {
                "name": "m",
                "kind": "KIND_CPU",
                "count": 1,
                "gpus": [],
                "secondary_devices": [],
                "profile": [],
                "passive": False,
                "host_policy": "",
            }
        ],
        "default_model_filename": "model.onnx",
        "cc_model_filenames": {},
        "metric_tags": {},
        "parameters": {},
        "model_warmup": [],
        "model_transaction_policy": {"decoupled": False},
        "model_repository_agents": {"agents": []},
        "response_cache": {"enable": False},
        "model_metrics": {"metric_control": []},
    }
    cfg = cfgmod.config_from_json(served)
    assert cfgmod.validate_config(cfg, "m") == []
