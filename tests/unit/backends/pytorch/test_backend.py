"""pdserve.backends.pytorch: naming conventions, configuration checks, loading and
running TorchScript / model.py modules, and the load errors (corrupt file, a file from a
newer torch, a GPU that is not there)."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve import config as cfgmod
from pdserve.backends.base import ExecRequest, ModelSpec
from pdserve.backends.pytorch import backend as ptb
from pdserve.backends.pytorch import options as pto
from pdserve.backends.pytorch.naming import indexed_position, plan_inputs, plan_outputs
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.types import InferRequest
from tests import pytorch_models as pm

torch = pytest.importorskip("torch")
# torch 2.13 marks torch.jit deprecated; the backend filters that warning process-wide, but
# pytest restores the filters after each test.
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")


# --------------------------------------------------------------------------- naming


def test_indexed_names() -> None:
    assert indexed_position("INPUT__0") == 0
    assert indexed_position("my__input__12") == 12
    assert indexed_position("INPUT_0") is None
    assert indexed_position("__3") is None  # no <name>


def test_inputs_by_dict_names_index_or_order() -> None:
    plan = plan_inputs(["b", "a"], ["x"], dict_argument=True)
    assert (plan.as_dict, plan.order, plan.rule) == (True, ("b", "a"), "dict")
    plan = plan_inputs(["y", "x"], ["x", "y"])
    assert (plan.order, plan.rule) == (("x", "y"), "argument names")
    plan = plan_inputs(["INPUT__1", "INPUT__0"], ["a", "b"])
    assert (plan.order, plan.rule) == (("INPUT__0", "INPUT__1"), "<name>__<index>")
    plan = plan_inputs(["first", "INPUT__0"], ["a", "b"])  # mixed: configuration order
    assert (plan.order, plan.rule) == (("first", "INPUT__0"), "configuration order")
    plan = plan_inputs(["INPUT__0"], None)  # signature unknown
    assert plan.order == ("INPUT__0",)


@pytest.mark.parametrize(
    ("names", "arguments", "message"),
    [
        (["INPUT__0", "INPUT__2"], None, "indices [0, 2] are not 0..1"),
        (["INPUT__0", "X__0"], None, "indices [0, 0] are not 0..1"),
        (
            ["x"],
            ["x", "y"],
            "forward() takes 2 input(s) (x, y); the configuration names 1: missing y",
        ),
        (["INPUT__0"], ["a", "b"], "forward() takes 2 input(s) (a, b); the configuration lists 1"),
    ],
)
def test_input_naming_errors(names: list[str], arguments: list[str] | None, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        plan_inputs(names, arguments)


def test_outputs_by_index_or_order() -> None:
    assert plan_outputs(["OUTPUT__1", "OUTPUT__0"]) == (
        {"OUTPUT__0": 0, "OUTPUT__1": 1},
        "<name>__<index>",
    )
    assert plan_outputs(["logits", "OUTPUT__0"]) == (
        {"logits": 0, "OUTPUT__0": 1},
        "configuration order",
    )
    with pytest.raises(ValueError, match="both name result element 0"):
        plan_outputs(["A__0", "B__0"])


# --------------------------------------------------------------------------- config


def cfg(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig(name="m"))


IO = (
    'input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
    'output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]\n'
)


@pytest.mark.parametrize(
    ("text", "field", "message"),
    [
        (
            'output [ { name: "OUTPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]',
            "input",
            "must list its inputs (name, data_type, dims): a TorchScript file has no metadata",
        ),
        (
            'input [ { name: "INPUT__0", data_type: TYPE_FP32, dims: [ 4 ] } ]',
            "output",
            "must list its outputs",
        ),
        (
            'input [ { name: "s", data_type: TYPE_STRING, dims: [ 1 ] } ]\n'
            'output [ { name: "o", data_type: TYPE_FP32, dims: [ 1 ] } ]',
            "input[0].data_type",
            "data_type TYPE_STRING, which the pytorch backend does not serve",
        ),
        (
            IO.replace("OUTPUT__0", "A__0")
            + 'output [ { name: "B__0", data_type: TYPE_FP32, dims: [ 4 ] } ]',
            "output",
            "both name result element 0",
        ),
        (
            IO + 'parameters { key: "INFERENCE_MODE" value { string_value: "maybe" } }',
            "parameters",
            "parameter INFERENCE_MODE must be 'true' or 'false', got 'maybe'",
        ),
        (
            IO + 'parameters { key: "INTRA_OP_THREAD_COUNT" value { string_value: "0" } }',
            "parameters",
            "INTRA_OP_THREAD_COUNT must be a positive integer, got '0'",
        ),
    ],
)
def test_check_config_refuses(text: str, field: str, message: str) -> None:
    with pytest.raises(cfgmod.ConfigError) as e:
        ptb.check_config(cfg(text), "m/config.pbtxt")
    assert e.value.field == field
    assert message in e.value.message


def test_options_follow_parameters_and_pinned_memory() -> None:
    assert pto.Options.from_config(cfg(IO)) == pto.Options()
    text = (
        IO
        + 'parameters { key: "INFERENCE_MODE" value { string_value: "false" } }\n'
        + 'parameters { key: "DISABLE_OPTIMIZED_EXECUTION" value { string_value: "True" } }\n'
        + 'parameters { key: "ENABLE_CACHE_CLEANING" value { string_value: "true" } }\n'
        + 'parameters { key: "ENABLE_WEIGHT_SHARING" value { string_value: "1" } }\n'
        + "optimization { input_pinned_memory { enable: false } }\n"
    )
    assert pto.Options.from_config(cfg(text)) == pto.Options(
        inference_mode=False,
        optimized_execution=False,
        cache_cleaning=True,
        weight_sharing=True,
        input_pinned=False,
        output_pinned=True,
    )


# --------------------------------------------------------------------------- loading and running


def spec_of(model_dir: Path) -> ModelSpec:
    config = cfgmod.load_model_config(model_dir)
    cfgmod.normalize_platform(config, model_dir / "config.pbtxt")
    ptb.check_config(config, model_dir / "config.pbtxt")
    cfgmod.apply_defaults(config)
    return ModelSpec(model_dir.name, 1, config, model_dir, model_dir / "1", model_dir.parent)


def request(inputs: dict[str, np.ndarray], outputs: list[str]) -> ExecRequest:
    rows = next(iter(inputs.values())).shape[0]
    return ExecRequest(inputs, outputs, InferRequest("m"), rows)


async def load_and_run(spec: ModelSpec, batch: list[ExecRequest]) -> tuple[list, list]:
    instances = await ptb.PyTorchBackend().load(spec)
    try:
        return instances, await instances[0].execute(batch)
    finally:
        for i in instances:
            await i.close()


X = np.arange(8, dtype=np.float32).reshape(2, 4)
Y = np.full((2, 4), 10, dtype=np.float32)


def test_indexed_inputs_and_outputs_in_any_config_order(tmp_path: Path) -> None:
    d = pm.add_sub(tmp_path, inputs=["INPUT__1", "INPUT__0"])
    spec = spec_of(d)
    a = request({"INPUT__0": X, "INPUT__1": Y}, ["OUTPUT__1", "OUTPUT__0"])
    b = request({"INPUT__0": Y[:1], "INPUT__1": X[:1]}, ["OUTPUT__1"])
    instances, results = asyncio.run(load_and_run(spec, [a, b]))  # merged into 3 rows
    assert [i.kind for i in instances] == ["KIND_CPU"]
    assert str(instances[0].device) == "cpu"
    np.testing.assert_array_equal(results[0]["OUTPUT__0"], X + Y)
    np.testing.assert_array_equal(results[0]["OUTPUT__1"], X - Y)
    assert list(results[1]) == ["OUTPUT__1"]
    np.testing.assert_array_equal(results[1]["OUTPUT__1"], Y[:1] - X[:1])


def test_inputs_by_argument_name_and_dict(tmp_path: Path) -> None:
    spec = spec_of(pm.named_args(tmp_path))
    _, results = asyncio.run(load_and_run(spec, [request({"y": Y, "x": X}, ["result"])]))
    np.testing.assert_array_equal(results[0]["result"], X * 2 + Y)
    spec = spec_of(pm.dict_input(tmp_path))
    _, results = asyncio.run(load_and_run(spec, [request({"left": Y, "right": X}, ["OUTPUT__0"])]))
    np.testing.assert_array_equal(results[0]["OUTPUT__0"], Y - X)


def test_python_runtime_form_loads_weights(tmp_path: Path) -> None:
    d, weight = pm.python_runtime(tmp_path)
    spec = spec_of(d)
    assert spec.config.default_model_filename == ""
    assert cfgmod.find_model_file(spec.config, d / "1").name == "model.py"
    _, results = asyncio.run(load_and_run(spec, [request({"INPUT__0": X}, ["OUTPUT__0"])]))
    np.testing.assert_allclose(results[0]["OUTPUT__0"], X @ weight.T, rtol=1e-6)


def test_instances_groups_and_weight_sharing(tmp_path: Path) -> None:
    shared = 'parameters { key: "ENABLE_WEIGHT_SHARING" value { string_value: "true" } }\n'
    d = pm.add_sub(tmp_path, extra="instance_group [ { count: 3, kind: KIND_CPU } ]\n" + shared)

    async def main() -> list[ptb.PyTorchInstance]:
        instances = await ptb.PyTorchBackend().load(spec_of(d))
        for i in instances:
            await i.close()
        return instances

    instances = asyncio.run(main())
    assert [i.name for i in instances] == ["pt_add_sub_0", "pt_add_sub_1", "pt_add_sub_2"]
    # KIND_AUTO would be CPU here too: this torch has no CUDA
    assert ptb.PyTorchBackend().usable_gpus() == []


def test_model_error_is_500_naming_the_model(tmp_path: Path) -> None:
    spec = spec_of(pm.raises_on_negative(tmp_path))

    async def main() -> tuple[Exception | None, list]:
        instances = await ptb.PyTorchBackend().load(spec)
        try:
            error = None
            try:
                await instances[0].execute([request({"INPUT__0": -X}, ["OUTPUT__0"])])
            except InferError as e:
                error = e
            ok = await instances[0].execute([request({"INPUT__0": X}, ["OUTPUT__0"])])
            return error, ok
        finally:
            for i in instances:
                await i.close()

    error, ok = asyncio.run(main())
    assert isinstance(error, InferError) and error.code == ErrorCode.INTERNAL
    assert "pytorch execution of model 'pt_raises' failed" in str(error)
    assert "negative input" in str(error)
    np.testing.assert_array_equal(ok[0]["OUTPUT__0"], X + 1)  # the instance carries on


def test_closed_instance_answers_503(tmp_path: Path) -> None:
    spec = spec_of(pm.add_sub(tmp_path))

    async def main() -> InferError:
        instances = await ptb.PyTorchBackend().load(spec)
        await instances[0].close()
        with pytest.raises(InferError) as e:
            await instances[0].execute([request({"INPUT__0": X, "INPUT__1": X}, ["OUTPUT__0"])])
        return e.value

    assert asyncio.run(main()).code == ErrorCode.UNAVAILABLE


# --------------------------------------------------------------------------- load errors


def load_error(spec: ModelSpec) -> str:
    with pytest.raises(Exception) as e:
        asyncio.run(ptb.PyTorchBackend().load(spec))
    return str(e.value)


def test_corrupt_file_is_a_clear_load_error(tmp_path: Path) -> None:
    d = pm.add_sub(tmp_path)
    pm.corrupt_copy(d / "1" / "model.pt", d / "1" / "model.pt")
    message = load_error(spec_of(d))
    assert f"model 'pt_add_sub': cannot load {d / '1' / 'model.pt'}" in message
    assert "not a TorchScript archive: corrupt or truncated" in message


def test_state_dict_instead_of_torchscript_is_explained(tmp_path: Path) -> None:
    d = pm.add_sub(tmp_path)
    torch.save(torch.nn.Linear(4, 4).state_dict(), str(d / "1" / "model.pt"))
    assert "written with torch.save instead of torch.jit.save" in load_error(spec_of(d))


def test_file_from_a_newer_torch_is_a_clear_load_error(tmp_path: Path) -> None:
    d = pm.add_sub(tmp_path)
    pt = d / "1" / "model.pt"
    pm.newer_version_copy(pt, pt)
    message = load_error(spec_of(d))
    assert "model 'pt_add_sub'" in message
    assert f"saved by a newer torch than the {torch.__version__} installed here" in message
    assert "version 99" in message


def test_python_runtime_errors(tmp_path: Path) -> None:
    d, _ = pm.python_runtime(tmp_path)
    (d / "1" / "model.py").write_text("import torch\n")
    assert "must define exactly one torch.nn.Module subclass (found none)" in load_error(spec_of(d))
    (d / "1" / "model.py").write_text(pm.MODEL_PY)
    torch.save({"other.weight": torch.zeros(4, 4)}, str(d / "1" / "model.pt"))
    assert "cannot load the weights" in load_error(spec_of(d))


@pytest.mark.parametrize("gpus", ["gpus: [ 3 ]", ""])
def test_kind_gpu_without_cuda_names_model_and_device(tmp_path: Path, gpus: str) -> None:
    d = pm.add_sub(tmp_path, extra=f"instance_group [ {{ kind: KIND_GPU {gpus} }} ]\n")
    spec = spec_of(d)
    message = load_error(spec)
    device = "cuda:3" if gpus else "cuda:0"
    assert f"model 'pt_add_sub' instance group 'pt_add_sub_0' asks for KIND_GPU ({device})" in (
        message
    )
    assert "CPU-only build" in message and "use KIND_CPU" in message


def test_gpu_id_beyond_the_visible_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """With a CUDA build of torch, an id past the visible GPUs names what is seen."""
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(ptb, "visible_gpu_count", lambda: 2)
    assert ptb._gpu_message("m", "g", [0, 1]) is None
    message = ptb._gpu_message("m", "g", [1, 3])
    assert message is not None
    assert "model 'm' instance group 'g' asks for KIND_GPU on cuda:3, but this process sees 2" in (
        message
    )


# --------------------------------------------------------------------------- process-wide settings


def test_thread_counts_are_process_wide_first_model_wins(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = pto._ProcessSettings()
    before = torch.get_num_threads()
    try:
        settings.apply(
            "a", cfg(IO + 'parameters { key: "INTRA_OP_THREAD_COUNT" value { string_value: "1" } }')
        )
        assert torch.get_num_threads() == 1
        with caplog.at_level(logging.WARNING, "pdserve.pytorch"):
            settings.apply(
                "b",
                cfg(IO + 'parameters { key: "INTRA_OP_THREAD_COUNT" value { string_value: "3" } }'),
            )
        assert torch.get_num_threads() == 1
        assert "b: INTRA_OP_THREAD_COUNT=3 is ignored: it is process-wide and model 'a' set 1" in (
            caplog.text
        )
    finally:
        torch.set_num_threads(before)
