"""pdserve.core.monitor: the server attaches an observer to each version after warm-up
and calls it once per finished request (outputs, or the error); an attach that raises
fails the version's load with the reason. A real InferenceServer on the example ``tiny``
model, with a recording monitor (the hook's contract, not pdserve's own monitor)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdserve.core.errors import InferError
from pdserve.core.monitor import ResponseMonitor, VersionObserver
from pdserve.core.types import InferRequest
from pdserve.observability.monitoring.monitor import Monitor, VersionMonitor
from pdserve.server import InferenceServer
from tests.conftest import EXAMPLE_REPO, require_examples


class Recorder:
    """A ResponseMonitor that records every call; raises on attach when told to."""

    def __init__(self, fail: str = "") -> None:
        self.fail = fail
        self.attached: list[tuple[str, str, Path]] = []
        self.seen: list[tuple[str, str, Any, str | None]] = []

    def attach(self, mv: Any, model_dir: Path) -> VersionObserver | None:
        if self.fail:
            raise ValueError(self.fail)
        self.attached.append((mv.name, mv.version_str, model_dir))
        recorder = self

        class Observer:
            def observe(self, request: InferRequest, outputs: Any, error: Any) -> None:
                recorder.seen.append(
                    (request.id, mv.version_str, outputs, None if error is None else str(error))
                )

        return Observer()


def _server(tmp_path: Path, monitor: ResponseMonitor) -> InferenceServer:
    require_examples()
    shutil.copytree(EXAMPLE_REPO / "tiny", tmp_path / "tiny")
    server = InferenceServer(tmp_path)
    server.monitor = monitor
    return server


def test_observe_once_per_request_with_outputs_or_error(tmp_path: Path) -> None:
    recorder = Recorder()
    server = _server(tmp_path, recorder)

    async def scenario() -> None:
        await server.load_model("tiny")
        x = np.ones((1, 64), np.float32)
        response = await server.infer(InferRequest("tiny", inputs={"INPUT0": x}, id="ok"))
        with pytest.raises(InferError):
            bad = np.ones((1, 3), np.float32)  # wrong shape: refused before scheduling
            await server.infer(InferRequest("tiny", inputs={"INPUT0": bad}, id="bad"))
        await server.stop()
        assert recorder.attached == [("tiny", "2", tmp_path / "tiny")]
        assert len(recorder.seen) == 1
        rid, version, outputs, error = recorder.seen[0]
        assert (rid, version, error) == ("ok", "2", None)
        np.testing.assert_array_equal(outputs["OUTPUT0"], response.outputs["OUTPUT0"])

    asyncio.run(scenario())


def test_a_failing_attach_fails_the_load(tmp_path: Path) -> None:
    server = _server(tmp_path, Recorder(fail="drift: reference file ref.npz not found"))

    async def scenario() -> None:
        with pytest.raises(InferError) as e:
            await server.load_model("tiny")
        assert "monitoring: drift: reference file ref.npz not found" in str(e.value)
        assert not server.model_ready("tiny")
        await server.stop()

    asyncio.run(scenario())


def test_pdserves_monitor_implements_the_protocols() -> None:
    monitor: ResponseMonitor = Monitor()
    observer: type[VersionObserver] = VersionMonitor
    assert monitor.attach and observer.observe
