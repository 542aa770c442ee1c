"""pdserve.backends.registry: the backend registry, the one list of backends, and how configuration
validation asks it."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve import config as cfgmod
from pdserve.backends import registry as backends
from pdserve.backends.registry import (
    NOT_SERVED,
    REGISTRY,
    BackendEntry,
    get_backend,
    served_backends,
    unavailable_reason,
)
from pdserve.config import ConfigError


def parse(pbtxt: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(pbtxt, model_config_pb2.ModelConfig(name="m"))


def test_registry_serves_onnxruntime_python_pytorch_and_remote() -> None:
    assert served_backends() == [
        "fil",
        "onnxruntime",
        "openvino",
        "python",
        "pytorch",
        "remote",
        "tensorflow",
    ]
    # an ensemble is not a backend
    assert sorted(REGISTRY) == served_backends()
    for name in REGISTRY:
        assert unavailable_reason(name) is None
        assert get_backend(name).name == name
        assert get_backend(name) is get_backend(name)  # one shared object per backend
    # every backend a configuration can name is one Triton's configuration knows
    assert set(served_backends()) <= cfgmod.KNOWN_BACKENDS


PYTORCH_REASON = (
    "backend 'pytorch' is not available: it needs the Python package(s) torch, which this "
    "environment lacks; install pdserve[pytorch]"
)


@pytest.mark.parametrize(
    ("pbtxt", "field"),
    [
        ('backend: "pytorch"', "backend"),
        ('platform: "pytorch_libtorch"', "platform"),
        ('platform: "pytorch_libtorch" backend: "pytorch"', "backend"),
        ("", "platform"),  # guessed from model.pt
    ],
)
def test_pytorch_without_torch_fails_validation_naming_the_extra(
    pbtxt: str, field: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find_spec = backends.importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:  # torch "not installed"
        return None if name == "torch" else real_find_spec(name)

    monkeypatch.setattr(backends.importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(backends, "_instances", {})
    assert unavailable_reason("pytorch") == PYTORCH_REASON
    cfg = parse(pbtxt)
    with pytest.raises(ConfigError) as e:
        cfgmod.normalize_platform(
            cfg, "m/config.pbtxt", guess_from_files=["model.pt"], backends=unavailable_reason
        )
    assert (e.value.path, e.value.field, e.value.message) == (
        "m/config.pbtxt",
        field,
        PYTORCH_REASON,
    )
    assert cfg.platform == parse(pbtxt).platform  # nothing filled in
    # validate_config asks the same registry
    cfg = parse('backend: "pytorch" platform: "pytorch_libtorch"')
    assert cfgmod.validate_config(cfg, "m/config.pbtxt") == []  # Triton's rules alone
    with pytest.raises(ConfigError) as e:
        cfgmod.validate_config(cfg, "m/config.pbtxt", backends=unavailable_reason)
    assert (e.value.field, e.value.message) == ("backend", PYTORCH_REASON)
    with pytest.raises(ValueError, match=r"install pdserve\[pytorch\]"):
        get_backend("pytorch")


def test_pytorch_is_served_when_torch_is_installed() -> None:
    assert unavailable_reason("pytorch") is None
    cfg = parse('platform: "pytorch_libtorch"')
    cfgmod.normalize_platform(cfg, "m/config.pbtxt", backends=unavailable_reason)
    assert (cfg.backend, cfg.default_model_filename) == ("pytorch", "model.pt")


def test_unknown_backend_names_the_served_ones() -> None:
    reason = (
        "unknown backend 'mxnet'; pdserve serves 'fil', 'onnxruntime', 'openvino', "
        "'python', 'pytorch', 'remote', 'tensorflow'"
    )
    assert unavailable_reason("mxnet") == reason
    with pytest.raises(ConfigError) as e:
        cfgmod.normalize_platform(
            parse('backend: "mxnet"'), "m/config.pbtxt", backends=unavailable_reason
        )
    assert (e.value.field, e.value.message) == ("backend", reason)
    with pytest.raises(ConfigError) as e:  # without the registry: Triton's names
        cfgmod.normalize_platform(parse('backend: "mxnet"'), "m/config.pbtxt")
    assert e.value.message == (
        "unknown backend 'mxnet'; pdserve knows 'fil', 'onnxruntime', 'openvino', "
        "'python', 'pytorch', 'remote', 'tensorflow'"
    )
    with pytest.raises(ValueError, match="unknown backend 'mxnet'"):
        get_backend("mxnet")


def test_missing_optional_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    entry = BackendEntry(
        "python", "pdserve.backends.python.backend:PythonBackend", ("pdserve_no_such_pkg",), "fancy"
    )
    monkeypatch.setitem(REGISTRY, "python", entry)
    monkeypatch.setattr(backends, "_instances", {})
    reason = (
        "backend 'python' is not available: it needs the Python package(s) "
        "pdserve_no_such_pkg, which this environment lacks; install pdserve[fancy]"
    )
    assert unavailable_reason("python") == reason
    with pytest.raises(ConfigError) as e:
        cfgmod.normalize_platform(
            parse('backend: "python"'), "m/config.pbtxt", backends=unavailable_reason
        )
    assert (e.value.field, e.value.message) == ("backend", reason)
    with pytest.raises(ValueError) as v:
        get_backend("python")
    assert str(v.value) == reason
    # a package pdserve itself depends on: reinstall
    monkeypatch.setitem(REGISTRY, "python", BackendEntry("python", "x:Y", ("pdserve_no_such_pkg",)))
    assert unavailable_reason("python").endswith(
        "which this environment lacks; reinstall pdserve, which depends on it"
    )


def test_split_batch_names_the_model_output_and_rows_when_rows_are_wrong() -> None:
    import numpy as np

    from pdserve.backends.base import ExecRequest, split_batch
    from pdserve.core.errors import ErrorCode, InferError
    from pdserve.core.types import InferRequest

    batch = [ExecRequest({}, ["Y"], InferRequest("m"), rows) for rows in (1, 2)]
    parts = split_batch(batch, {"Y": np.arange(6).reshape(3, 2)})
    assert [p["Y"].tolist() for p in parts] == [[[0, 1]], [[2, 3], [4, 5]]]  # type: ignore[index]
    with pytest.raises(InferError) as info:
        split_batch(batch, {"Y": np.zeros((2, 2))})
    assert info.value.code is ErrorCode.INTERNAL
    assert info.value.message == (
        "model 'm' returned output 'Y' with shape [2,2], expected [3,...]: 2 rows for a "
        "batch of 3 rows from 2 requests"
    )


def test_triton_backends_not_served_say_why() -> None:
    assert unavailable_reason("tensorrt") == (
        "backend 'tensorrt' is not served by pdserve: TensorRT plans are built for one GPU and "
        "TensorRT version; serve the ONNX model the plan was built from (backend 'onnxruntime')"
    )
    with pytest.raises(ConfigError) as e:
        cfgmod.normalize_platform(
            parse('backend: "dali"'), "m/config.pbtxt", backends=unavailable_reason
        )
    assert e.value.message.startswith("backend 'dali' is not served by pdserve: DALI pipelines")
    assert set(NOT_SERVED).isdisjoint(REGISTRY)
