"""The TensorFlow backend: Triton's auto-complete from the signature, shared loads,
batches, thread parameters and the KIND_GPU refusal of the CPU build."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.backends.base import ExecRequest, ModelSpec
from pdserve.backends.tensorflow.backend import TensorFlowBackend, apply_threads, tf_gpus
from pdserve.config import ConfigError
from pdserve.core.types import InferRequest
from tests.tensorflow_models import write_conditional_savedmodel, write_savedmodel

pytest.importorskip("tensorflow")


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tfrepo")
    write_savedmodel(root / "m" / "1" / "model.savedmodel")
    return root


def _spec(repo: Path, text: str) -> ModelSpec:
    cfg = text_format.Parse(
        'platform: "tensorflow_savedmodel" backend: "tensorflow" '
        'default_model_filename: "model.savedmodel" ' + text,
        model_config_pb2.ModelConfig(name="m"),
    )
    return ModelSpec("m", 1, cfg, repo / "m", repo / "m" / "1", repo)


def test_autocomplete_from_the_signature(repo: Path) -> None:
    spec = _spec(repo, "")
    asyncio.run(TensorFlowBackend().auto_complete(spec))
    cfg = spec.config
    assert cfg.max_batch_size == 4 and cfg.HasField("dynamic_batching")
    assert [(i.name, list(i.dims)) for i in cfg.input] == [("x", [4])]
    assert [(o.name, list(o.dims)) for o in cfg.output] == [("y", [4])]


def test_a_config_that_disagrees_with_the_signature_is_refused(repo: Path) -> None:
    spec = _spec(repo, 'max_batch_size: 2 input { name: "x" data_type: TYPE_INT32 dims: [4] }')
    with pytest.raises(ConfigError) as e:
        asyncio.run(TensorFlowBackend().auto_complete(spec))
    assert e.value.field == "input[0].data_type" and "TYPE_FP32" in e.value.message


def test_instances_share_the_load_and_run_batches(repo: Path) -> None:
    spec = _spec(repo, "max_batch_size: 8 instance_group [ { count: 2, kind: KIND_CPU } ]")

    async def run() -> list[object]:
        backend = TensorFlowBackend()
        await backend.auto_complete(spec)
        instances = await backend.load(spec)
        assert len(instances) == 2
        assert instances[0].signature is instances[1].signature  # type: ignore[attr-defined]
        x = [np.full((n, 4), n, np.float32) for n in (1, 3)]
        batch = [ExecRequest({"x": a}, ["y"], InferRequest("m", "1", {}), len(a)) for a in x]
        try:
            return await instances[1].execute(batch)
        finally:
            for instance in instances:
                await instance.close()

    results = asyncio.run(run())
    for n, result in zip((1, 3), results, strict=True):
        assert isinstance(result, dict)
        np.testing.assert_array_equal(result["y"], np.full((n, 4), 2 * n, np.float32))


@pytest.mark.parametrize(("branches", "single_threaded"), [(False, True), (True, False)])
def test_inline_runs_use_the_single_threaded_executor_where_the_graph_allows(
    tmp_path: Path, branches: bool, single_threaded: bool
) -> None:
    """A graph with Switch/Merge nodes fails in that executor: the instance falls back to
    the default one, and the batch that found out is answered all the same."""
    folder = tmp_path / "m" / "1" / "model.savedmodel"
    (write_conditional_savedmodel if branches else write_savedmodel)(folder)
    spec = _spec(tmp_path, "max_batch_size: 8")

    async def run() -> tuple[int, bool]:
        backend = TensorFlowBackend()
        await backend.auto_complete(spec)
        instance = (await backend.load(spec))[0]
        runs = instance.runs  # type: ignore[attr-defined]
        inline = 0
        try:
            # The first runs (TensorFlow optimising the graph, then instantiating it for the
            # other executor) are long and put the instance on its thread for a while.
            for i in range(300):
                n = 1 + i % 3
                inline += runs.inline()
                x = np.full((n, 4), n, np.float32)
                batch = [ExecRequest({"x": x}, ["y"], InferRequest("m", "1", {}), n)]
                result = (await instance.execute(batch))[0]
                assert isinstance(result, dict)
                np.testing.assert_array_equal(result["y"], np.full((n, 4), 2 * n, np.float32))
                if inline == 3:
                    break
            return inline, instance.single_threaded  # type: ignore[attr-defined]
        finally:
            await instance.close()

    assert asyncio.run(run()) == (3, single_threaded)


def test_thread_parameters_must_be_numbers(repo: Path) -> None:
    spec = _spec(repo, 'parameters { key: "TF_NUM_INTRA_THREADS" value { string_value: "x" } }')
    with pytest.raises(ValueError, match="'TF_NUM_INTRA_THREADS' must be a non-negative number"):
        apply_threads(spec.config)


@pytest.mark.skipif(bool(tf_gpus()), reason="TensorFlow sees a GPU here")
def test_kind_gpu_on_the_cpu_build_fails_the_load(repo: Path) -> None:
    spec = _spec(repo, "max_batch_size: 8 instance_group [ { kind: KIND_GPU, gpus: [1] } ]")
    with pytest.raises(RuntimeError) as e:
        asyncio.run(TensorFlowBackend().load(spec))
    text = str(e.value)
    assert "model 'm': instance group 'm' asks for KIND_GPU on /GPU:1" in text
    assert "CPU-only build" in text and "use KIND_CPU" in text
