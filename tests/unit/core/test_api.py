"""pdserve.core.api: InferenceServer implements every protocol, and each consumer
(ensemble steps, the model manager's warm-up hook, metrics, the poller) reaches the
core through its protocol on a real server with real ONNX Runtime models."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdserve.core import api
from pdserve.core.types import InferRequest
from pdserve.observability.metrics import MetricsExporter, MetricsSource
from pdserve.repository.control import RepositoryHost, RepositoryPoller
from pdserve.repository.model import ModelVersion
from pdserve.server import InferenceServer
from tests.batching_models import rowwise_expected, rowwise_model

PROTOCOLS = [
    api.InferenceCore,
    MetricsSource,
    RepositoryHost,
    api.ModelRunner,
    api.ModelHost,
]


def _members(protocol: type) -> list[str]:
    return sorted(
        name
        for klass in protocol.__mro__
        if klass not in (object,) and getattr(klass, "_is_protocol", False)
        for name in vars(klass)
        if not name.startswith("_")
    )


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.__name__)
def test_inference_server_is_each_protocol(protocol: type, tmp_path: Path) -> None:
    assert isinstance(InferenceServer(tmp_path), protocol)


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=lambda p: p.__name__)
def test_methods_have_the_protocols_signatures(protocol: type) -> None:
    """Names, kinds, defaults and sync / async of every method match the protocol's."""
    members = _members(protocol)
    assert members, protocol
    for name in members:
        declared = inspect.getattr_static(protocol, name)
        implemented = inspect.getattr_static(InferenceServer, name, None)
        if isinstance(declared, property):
            # a property in the protocol: a property or a plain attribute set in __init__
            assert implemented is None or isinstance(implemented, property), name
            continue
        assert callable(implemented), name
        assert inspect.iscoroutinefunction(implemented) == inspect.iscoroutinefunction(declared), (
            name
        )
        want = [
            (p.name, p.kind, p.default) for p in inspect.signature(declared).parameters.values()
        ]
        got = [
            (p.name, p.kind, p.default) for p in inspect.signature(implemented).parameters.values()
        ]
        assert got == want, name


def test_protocol_members() -> None:
    assert _members(api.ModelRunner) == ["infer_on", "infer_stream", "model_version"]
    assert _members(api.ModelHost) == ["infer_on", "infer_stream", "model_version", "warmup"]
    assert _members(MetricsSource) == [
        "memory_report",
        "response_cache",
        "served_model_stats",
    ]
    assert _members(RepositoryHost) == ["live", "manager", "started"]
    assert "started" in _members(api.InferenceCore)
    assert "infer_stream" in _members(api.InferenceCore)
    assert "manager" not in _members(api.InferenceCore)


# --------------------------------------------------------------------------- a real server

ENSEMBLE = """
name: "pipe"
platform: "ensemble"
max_batch_size: 8
input [{ name: "X" data_type: TYPE_FP32 dims: [16] }]
output [{ name: "Y" data_type: TYPE_FP32 dims: [16] }]
ensemble_scheduling {
  step [{
    model_name: "rowwise"
    model_version: -1
    input_map { key: "INPUT0" value: "X" }
    output_map { key: "OUTPUT0" value: "Y" }
  }]
}
"""

ROWWISE = """
name: "rowwise"
backend: "onnxruntime"
max_batch_size: 8
input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [16] }]
output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [16] }]
instance_group [{ kind: KIND_CPU count: 1 }]
"""


def _repository(root: Path) -> Path:
    rowwise_model(root / "rowwise" / "1" / "model.onnx")
    (root / "rowwise" / "config.pbtxt").write_text(ROWWISE)
    (root / "pipe" / "1").mkdir(parents=True)
    (root / "pipe" / "config.pbtxt").write_text(ENSEMBLE)
    return root


class RecordingServer(InferenceServer):
    """An InferenceServer that records the versions its warm-up hook ran on."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.warmed: list[tuple[str, int]] = []

    async def warmup(self, mv: ModelVersion) -> None:
        self.warmed.append((mv.name, mv.version))
        await super().warmup(mv)


def test_consumers_reach_the_core_through_their_protocols(tmp_path: Path) -> None:
    async def main() -> None:
        server = RecordingServer(_repository(tmp_path / "repo"))
        poller = RepositoryPoller(server, 0.01)
        poller.baseline()
        polling = asyncio.ensure_future(poller.run())
        await asyncio.sleep(0.1)
        # RepositoryHost.started: the poller waits for the initial load
        assert not server.started and poller.scans == 0 and not polling.done()

        await server.start()
        assert server.started and server.ready()
        # ModelHost.warmup: the manager ran the hook on every loaded version
        # (the ensemble loads after its step model)
        assert server.warmed == [("rowwise", 1), ("pipe", 1)]
        await asyncio.sleep(0.1)
        assert poller.scans > 0

        # ModelRunner: the ensemble's step runs through the step model's own path
        x = np.arange(32, dtype=np.float32).reshape(2, 16)
        response = await server.infer(InferRequest("pipe", inputs={"X": x}))
        np.testing.assert_array_equal(response.outputs["Y"], rowwise_expected(x))
        assert server.model_version("rowwise").name == "rowwise"

        # MetricsSource: every served version's statistics, by name then version
        stats = server.served_model_stats()
        assert [(s.name, s.version) for s in stats] == [("pipe", "1"), ("rowwise", "1")]
        assert [s.as_dict()["inference_stats"]["success"]["count"] for s in stats] == [1, 1]
        assert MetricsExporter(server, cpu=False, gpu=False).model_stats() == stats
        assert server.response_cache is None

        await server.stop(5)
        await asyncio.wait_for(polling, 2)  # RepositoryHost.live: the poller stops

    asyncio.run(main())
