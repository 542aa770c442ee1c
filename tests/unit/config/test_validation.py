"""Unit tests for pdserve.config: parsing, platform, validation, defaults, JSON.

ONNX auto-complete is tested in test_onnxruntime_autocomplete.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.config import defaults, json_form, loading, schema, validation
from pdserve.config.schema import ConfigError

# --------------------------------------------------------------------------- helpers


def make_model_dir(tmp_path: Path, name: str, pbtxt: str | None) -> Path:
    """A model folder with an optional config.pbtxt and an empty version 1."""
    d = tmp_path / name
    (d / "1").mkdir(parents=True)
    if pbtxt is not None:
        (d / "config.pbtxt").write_text(pbtxt)
    return d


def parse(pbtxt: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(pbtxt, model_config_pb2.ModelConfig())


# --------------------------------------------------------------------------- loading


def test_load_parses_config(tmp_path: Path) -> None:
    d = make_model_dir(
        tmp_path,
        "simple",
        """
        name: "simple"
        platform: "onnxruntime_onnx"
        max_batch_size: 8
        input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]
        output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 64 ] } ]
        parameters { key: "intra_op_thread_count" value: { string_value: "2" } }
        """,
    )
    cfg = loading.load_model_config(d)
    assert cfg.name == "simple"
    assert cfg.platform == "onnxruntime_onnx"
    assert cfg.max_batch_size == 8
    assert [i.name for i in cfg.input] == ["INPUT0"]
    assert list(cfg.input[0].dims) == [64]
    assert schema.get_parameter(cfg, "intra_op_thread_count") == "2"
    assert schema.get_parameter(cfg, "missing") is None
    assert schema.get_parameter(cfg, "missing", "x") == "x"


def test_load_without_config_uses_folder_name(tmp_path: Path) -> None:
    cfg = loading.load_model_config(make_model_dir(tmp_path, "noconf", None))
    assert cfg.name == "noconf"
    assert cfg.platform == "" and len(cfg.input) == 0


def test_load_empty_name_becomes_folder_name(tmp_path: Path) -> None:
    cfg = loading.load_model_config(make_model_dir(tmp_path, "m1", 'backend: "python"'))
    assert cfg.name == "m1"


def test_load_name_mismatch(tmp_path: Path) -> None:
    d = make_model_dir(tmp_path, "folder_name", 'name: "other"\nbackend: "python"')
    with pytest.raises(ConfigError) as e:
        loading.load_model_config(d)
    assert e.value.field == "name"
    assert e.value.path == str(d / "config.pbtxt")
    assert "folder_name" in e.value.message and "other" in e.value.message


def test_load_parse_error_names_file_line_and_column(tmp_path: Path) -> None:
    d = make_model_dir(tmp_path, "bad", 'name: "bad"\nmax_batch_size: 8\nbogus_field: 3\n')
    with pytest.raises(ConfigError) as e:
        loading.load_model_config(d)
    assert e.value.path == str(d / "config.pbtxt")
    assert e.value.field == "3:1"
    assert "bogus_field" in e.value.message
    assert str(e.value).startswith(f"{d / 'config.pbtxt'}: 3:1: ")


def test_config_error_str() -> None:
    err = ConfigError("/r/m/config.pbtxt", "input[1].dims", "bad dims")
    assert str(err) == "/r/m/config.pbtxt: input[1].dims: bad dims"
    assert (err.path, err.field, err.message) == ("/r/m/config.pbtxt", "input[1].dims", "bad dims")


# --------------------------------------------------------------------------- platform


@pytest.mark.parametrize(
    ("pbtxt", "platform", "backend", "filename"),
    [
        ('platform: "onnxruntime_onnx"', "onnxruntime_onnx", "onnxruntime", "model.onnx"),
        ('backend: "onnxruntime"', "onnxruntime_onnx", "onnxruntime", "model.onnx"),
        ('platform: "pytorch_libtorch"', "pytorch_libtorch", "pytorch", "model.pt"),
        ('backend: "pytorch"', "pytorch_libtorch", "pytorch", "model.pt"),
        ('backend: "python"', "", "python", "model.py"),
        ('platform: "ensemble"', "ensemble", "", ""),
        ('backend: "openvino"', "", "openvino", "model.xml"),
        ('platform: "torch_aoti"', "torch_aoti", "pytorch", "model.pt2"),
        ('backend: "pytorch" default_model_filename: "m.pt2"', "torch_aoti", "pytorch", "m.pt2"),
        (
            'platform: "tensorflow_savedmodel"',
            "tensorflow_savedmodel",
            "tensorflow",
            "model.savedmodel",
        ),
        ('backend: "tensorflow"', "tensorflow_savedmodel", "tensorflow", "model.savedmodel"),
        (
            'backend: "onnxruntime" default_model_filename: "net.onnx"',
            "onnxruntime_onnx",
            "onnxruntime",
            "net.onnx",
        ),
    ],
)
def test_normalize_platform_pairs(pbtxt: str, platform: str, backend: str, filename: str) -> None:
    cfg = parse(pbtxt)
    loading.normalize_platform(cfg, "m/config.pbtxt")
    assert (cfg.platform, cfg.backend, cfg.default_model_filename) == (platform, backend, filename)


@pytest.mark.parametrize(
    ("files", "backend"),
    [
        (["model.onnx"], "onnxruntime"),
        (["model.pt"], "pytorch"),
        (["model.py", "helper.py"], "python"),
        (["model.xml", "model.bin"], "openvino"),
        (["model.savedmodel"], "tensorflow"),
        (["model.pt2"], "pytorch"),
    ],
)
def test_normalize_platform_guesses_from_files(files: list[str], backend: str) -> None:
    cfg = model_config_pb2.ModelConfig(name="m")
    loading.normalize_platform(cfg, "m/config.pbtxt", guess_from_files=files)
    assert cfg.backend == backend


def test_a_pt2_file_is_a_torch_aoti_model() -> None:
    cfg = model_config_pb2.ModelConfig(name="m")
    loading.normalize_platform(cfg, "m/config.pbtxt", guess_from_files=["model.pt2"])
    assert (cfg.platform, cfg.default_model_filename) == ("torch_aoti", "model.pt2")


@pytest.mark.parametrize(
    ("pbtxt", "field"),
    [
        ('platform: "tensorrt_plan"', "platform"),
        ('backend: "tensorrt"', "backend"),
        ('platform: "onnxruntime_onnx" backend: "pytorch"', "backend"),
        ('platform: "ensemble" backend: "python"', "backend"),
        ("", "platform"),
    ],
)
def test_normalize_platform_errors(pbtxt: str, field: str) -> None:
    cfg = parse(pbtxt)
    with pytest.raises(ConfigError) as e:
        loading.normalize_platform(cfg, "m/config.pbtxt", guess_from_files=["README.md"])
    assert e.value.field == field
    assert e.value.path == "m/config.pbtxt"


# --------------------------------------------------------------------------- validation

VALID = """
name: "m"
backend: "onnxruntime"
platform: "onnxruntime_onnx"
max_batch_size: 8
input [
  { name: "a" data_type: TYPE_FP32 dims: [ 4 ] },
  { name: "b" data_type: TYPE_INT64 dims: [ -1, 2 ] }
]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def test_validate_accepts_valid(tmp_path: Path) -> None:
    assert validation.validate_config(parse(VALID), str(tmp_path / "config.pbtxt")) == []


@pytest.mark.parametrize(
    ("edit", "field", "words"),
    [
        (
            'input [ { name: "a" data_type: TYPE_FP32 dims: [ 1 ] } ]',
            "input[2].name",
            "duplicate input",
        ),
        (
            'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]',
            "output[1].name",
            "duplicate output",
        ),
        ('input [ { name: "c" data_type: TYPE_FP32 dims: [ 0 ] } ]', "input[2].dims", ">= 1"),
        ('input [ { name: "c" data_type: TYPE_FP32 dims: [ -2 ] } ]', "input[2].dims", ">= 1"),
        ('input [ { name: "c" dims: [ 3 ] } ]', "input[2].data_type", "data_type"),
        ('output [ { name: "z" data_type: TYPE_FP32 } ]', "output[1].dims", "dims"),
        ("max_batch_size: -1", "max_batch_size", "non-negative"),
        (
            "dynamic_batching { preferred_batch_size: [ 4, 16 ] }",
            "dynamic_batching.preferred_batch_size",
            "<= max_batch_size 8",
        ),
        (
            "dynamic_batching { preferred_batch_size: [ 0 ] }",
            "dynamic_batching.preferred_batch_size",
            "positive",
        ),
        (
            'input [ { name: "c" data_type: TYPE_FP32 dims: [ 2, 3 ] reshape { shape: [ 5 ] } } ]',
            "input[2].reshape",
            "element count",
        ),
        (
            'input [ { name: "c" data_type: TYPE_FP32 dims: [ 2, -1, 3 ] '
            "reshape { shape: [ 3, -1, 2 ] } } ]",
            "input[2].reshape",
            "variable-size",
        ),
        (
            'output [ { name: "z" data_type: TYPE_FP32 dims: [ 3 ] label_filename: "nope.txt" } ]',
            "output[1].label_filename",
            "nope.txt",
        ),
        (
            "instance_group [ { kind: KIND_CPU gpus: [ 0 ] } ]",
            "instance_group[0].gpus",
            "KIND_CPU",
        ),
        (
            "dynamic_batching { priority_levels: 2 default_priority_level: 3 }",
            "dynamic_batching.default_priority_level",
            "[1, 2]",
        ),
        (
            'input [ { name: "c" data_type: TYPE_FP32 format: FORMAT_NCHW dims: [ 3, 4 ] } ]',
            "input[2].format",
            "3 dims",
        ),
        ('ensemble_scheduling { step [ { model_name: "x" } ] }', "ensemble_scheduling", "only"),
        (
            "model_transaction_policy { decoupled: true }",
            "model_transaction_policy.decoupled",
            "python backend only",
        ),
        (
            "sequence_batching { iterative_sequence: true }",
            "sequence_batching.iterative_sequence",
            "not supported by pdserve",
        ),
    ],
)
def test_validate_errors_name_file_and_field(
    tmp_path: Path, edit: str, field: str, words: str
) -> None:
    cfg = parse(VALID)
    text_format.Merge(edit, cfg)
    path = str(tmp_path / "m" / "config.pbtxt")
    with pytest.raises(ConfigError) as e:
        validation.validate_config(cfg, path)
    assert e.value.path == path
    assert e.value.field == field
    assert words in e.value.message
    assert str(e.value).startswith(f"{path}: {field}: ")


def test_validate_collects_every_error_with_errors_list() -> None:
    """``errors=`` (pdserve check): every broken rule, in order; without it the first raises."""
    cfg = parse(
        VALID
        + 'input [ { name: "a" data_type: TYPE_FP32 dims: [ 0, -2 ] } ]'
        + "dynamic_batching { preferred_batch_size: [ 0, 999 ] }"
        + "instance_group [ { kind: KIND_CPU gpus: [ 0 ] } ]"
    )
    cfg.max_batch_size = -1
    with pytest.raises(ConfigError) as first:
        validation.validate_config(cfg, "m/config.pbtxt")
    errors: list[ConfigError] = []
    assert validation.validate_config(cfg, "m/config.pbtxt", errors=errors) == []
    assert [(e.field, e.message) for e in errors][0] == (first.value.field, first.value.message)
    assert [e.field for e in errors] == [
        "max_batch_size",
        "input[2].name",  # duplicate of input[0] "a"
        "input[2].dims",  # one error for the field, not one per bad dim
        "dynamic_batching.preferred_batch_size",
        "dynamic_batching.preferred_batch_size",
        "instance_group[0].gpus",
    ]


def test_validate_refuses_an_absurd_instance_count() -> None:
    """``count: 100000`` (a typo) is refused with the limit in the message, per group and
    in total (a KIND_GPU group counts once per GPU); the limit is configurable."""
    cfg = parse(VALID + "instance_group [ { kind: KIND_CPU count: 100000 } ]")
    with pytest.raises(ConfigError) as e:
        validation.validate_config(cfg, "m/config.pbtxt")
    assert e.value.field == "instance_group[0].count"
    assert e.value.message == (
        "count 100000 is more than the limit of 128 instances per model "
        "(serve's --max-instance-count)"
    )
    at_limit = parse(VALID + "instance_group [ { kind: KIND_CPU count: 128 } ]")
    assert validation.validate_config(at_limit, "m/config.pbtxt") == []
    total = parse(
        VALID + "instance_group [ { kind: KIND_CPU count: 100 },"
        " { kind: KIND_GPU count: 20 gpus: [ 0, 1 ] } ]"
    )
    with pytest.raises(ConfigError) as e:
        validation.validate_config(total, "m/config.pbtxt")
    assert e.value.field == "instance_group"
    assert "ask for 140 instances, more than the limit of 128" in e.value.message
    try:
        defaults.set_max_instance_count(200)
        assert validation.validate_config(total, "m/config.pbtxt") == []
        defaults.set_max_instance_count(4)
        with pytest.raises(ConfigError, match="limit of 4 instances"):
            validation.validate_config(parse(VALID + "instance_group [ { count: 5 } ]"), "m")
        with pytest.raises(ValueError):
            defaults.set_max_instance_count(0)
    finally:
        defaults.set_max_instance_count(defaults.DEFAULT_MAX_INSTANCE_COUNT)


def test_validate_label_file_present(tmp_path: Path) -> None:
    d = make_model_dir(tmp_path, "m", None)
    (d / "labels.txt").write_text("cat\ndog\n")
    cfg = parse(VALID)
    cfg.output[0].label_filename = "labels.txt"
    assert validation.validate_config(cfg, str(d / "config.pbtxt")) == []


def test_validate_preferred_batch_on_non_batching_model() -> None:
    cfg = parse(VALID + "dynamic_batching { preferred_batch_size: [ 2 ] }")
    cfg.max_batch_size = 0
    with pytest.raises(ConfigError) as e:
        validation.validate_config(cfg, "m/config.pbtxt")
    assert e.value.field == "dynamic_batching.preferred_batch_size"
    assert "cannot batch" in e.value.message


def test_validate_dynamic_batching_without_batch_size_warns() -> None:
    # Triton accepts it (the dynamic batcher then only queues), so a warning.
    cfg = parse(VALID + "dynamic_batching { }")
    cfg.max_batch_size = 0
    warnings = validation.validate_config(cfg, "m/config.pbtxt")
    assert len(warnings) == 1 and "never batched" in warnings[0]


def test_validate_empty_reshape_needs_batching() -> None:
    cfg = parse(VALID + 'input [ { name: "s" data_type: TYPE_FP32 dims: [ 1 ] reshape { } } ]')
    assert validation.validate_config(cfg, "m/config.pbtxt") == []  # batching: a scalar per item
    cfg.max_batch_size = 0
    with pytest.raises(ConfigError) as e:
        validation.validate_config(cfg, "m/config.pbtxt")
    assert e.value.field == "input[2].reshape"


def test_validate_incomplete_io_allowed_before_autocomplete() -> None:
    cfg = parse('name: "m" backend: "python" input [ { name: "a" } ]')
    assert validation.validate_config(cfg, "m/config.pbtxt", complete=False) == []
    with pytest.raises(ConfigError):
        validation.validate_config(cfg, "m/config.pbtxt")


def test_validate_ensemble_needs_steps() -> None:
    cfg = parse('name: "e" platform: "ensemble"')
    with pytest.raises(ConfigError) as e:
        validation.validate_config(cfg, "e/config.pbtxt")
    assert e.value.field == "ensemble_scheduling.step"
    cfg = parse(
        'name: "e" platform: "ensemble" ensemble_scheduling { step [ { model_name: "x" '
        'input_map { key: "a" value: "b" } output_map { key: "c" value: "d" } } ] }'
    )
    assert validation.validate_config(cfg, "e/config.pbtxt") == []
    cfg.instance_group.add(count=1)
    with pytest.raises(ConfigError) as e:
        validation.validate_config(cfg, "e/config.pbtxt")
    assert e.value.field == "instance_group"


# --------------------------------------------------------------------------- defaults


def test_apply_defaults() -> None:
    cfg = parse(VALID + "dynamic_batching { }")
    defaults.apply_defaults(cfg)
    assert cfg.version_policy.WhichOneof("policy_choice") == "latest"
    assert cfg.version_policy.latest.num_versions == 1
    assert list(cfg.dynamic_batching.preferred_batch_size) == [8]
    assert len(cfg.instance_group) == 1
    group = cfg.instance_group[0]
    assert group.name == "m"
    assert model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind) == "KIND_CPU"
    assert group.count == 2  # Triton's default for onnxruntime on CPU
    assert cfg.optimization.input_pinned_memory.enable
    gpu = parse('name: "p" backend: "python" instance_group [ { }, { kind: KIND_GPU count: 3 } ]')
    defaults.apply_defaults(gpu, gpus=[0, 1])
    kinds = [model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind) for g in gpu.instance_group]
    assert kinds == ["KIND_GPU", "KIND_GPU"]
    assert [g.name for g in gpu.instance_group] == ["p_0", "p_1"]
    assert [g.count for g in gpu.instance_group] == [1, 3]
    assert [list(g.gpus) for g in gpu.instance_group] == [[0, 1], [0, 1]]


# --------------------------------------------------------------------------- JSON


def test_config_to_json_numbers_and_enums() -> None:
    cfg = parse(
        VALID
        + """
        version_policy { specific { versions: [ 1, 3 ] } }
        dynamic_batching {
          max_queue_delay_microseconds: 100
          priority_levels: 2
          default_priority_level: 1
          priority_queue_policy {
            key: 2 value { default_timeout_microseconds: 5000 timeout_action: DELAY }
          }
        }
        instance_group [ { kind: KIND_CPU count: 2 } ]
        """
    )
    d = json_form.config_to_json(cfg)
    json.dumps(d)  # plain JSON
    assert d["max_batch_size"] == 8
    assert d["input"][0]["dims"] == [4]
    assert d["input"][1]["dims"] == [-1, 2]
    assert d["input"][0]["data_type"] == "TYPE_FP32"
    assert d["output"][0]["dims"] == [4]
    assert d["version_policy"]["specific"]["versions"] == [1, 3]
    db = d["dynamic_batching"]
    assert db["max_queue_delay_microseconds"] == 100
    assert db["priority_levels"] == 2
    policy = db["priority_queue_policy"]["2"]
    assert policy["default_timeout_microseconds"] == 5000
    assert policy["timeout_action"] == "DELAY"
    assert d["instance_group"][0]["kind"] == "KIND_CPU"
    # Default-valued fields without presence are printed, as Triton prints them.
    assert d["input"][0]["is_shape_tensor"] is False
    assert d["input"][0]["format"] == "FORMAT_NONE"
    assert d["batch_input"] == []
    assert d["default_model_filename"] == ""


def test_config_json_round_trip() -> None:
    cfg = parse(VALID + "version_policy { all { } } dynamic_batching { preferred_batch_size: 4 }")
    d = json_form.config_to_json(cfg)
    back = json_form.config_from_json(json.loads(json.dumps(d)))
    assert back == cfg


def test_config_from_json_error() -> None:
    with pytest.raises(ConfigError) as e:
        json_form.config_from_json({"name": "m", "max_batch_size": "lots"})
    assert e.value.field == "config"
    with pytest.raises(ConfigError):
        json_form.config_from_json({"no_such_field": 1})


def test_datatype_of() -> None:
    io = model_config_pb2.ModelInput(name="s", data_type=model_config_pb2.TYPE_STRING)
    assert schema.datatype_of(io) == "BYTES"
    io.data_type = model_config_pb2.TYPE_BF16
    assert schema.datatype_of(io) == "BF16"
    with pytest.raises(ValueError):
        schema.datatype_of(model_config_pb2.ModelInput(name="x"))


def test_validate_decoupled_false_is_fine() -> None:
    cfg = parse(VALID + "model_transaction_policy { decoupled: false }")
    assert validation.validate_config(cfg, "m/config.pbtxt") == []


def test_label_file_error_names_no_absolute_path(tmp_path: Path) -> None:
    cfg = parse(VALID)
    cfg.output[0].label_filename = "nope.txt"
    with pytest.raises(ConfigError) as e:
        validation.validate_config(cfg, "m/config.pbtxt", model_dir=tmp_path)
    assert str(tmp_path) not in str(e.value) and "nope.txt" in str(e.value)


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("", "empty"),
        ("  \n", "empty"),
        (b"\xff", "not UTF-8"),
        ("{nope", "not JSON"),
        ("[1, 2]", "not a JSON array"),
        ("null", "not JSON null"),
        ("true", "not a JSON boolean"),
        ("3", "not a JSON number"),
        ('"m"', "not a JSON string"),
        ("[" * 5000 + "]" * 5000, "nested too deeply"),
        ('{"parameters":' * 3000 + "{}" + "}" * 3000, "nested too deeply"),
        ('{"max_batch_size": "lots"}', "max_batch_size"),
    ],
)
def test_parse_config_override_errors(value: str | bytes, words: str) -> None:
    with pytest.raises(ConfigError) as e:
        json_form.parse_config_override(value)
    assert e.value.path == schema.OVERRIDE_PATH and e.value.field == "config"
    assert words in e.value.message


def test_parse_config_override_values() -> None:
    assert json_form.parse_config_override(None) is None
    cfg = json_form.parse_config_override('{"name": "m", "max_batch_size": 4}')
    assert cfg is not None and cfg.name == "m" and cfg.max_batch_size == 4
    assert json_form.parse_config_override(b'{"name": "m"}').name == "m"
    assert json_form.parse_config_override({"name": "m"}).name == "m"
    assert json_form.parse_config_override(cfg) is cfg
    # what GET .../config serves parses back to the same message
    assert json_form.parse_config_override(json.dumps(json_form.config_to_json(cfg))) == cfg
