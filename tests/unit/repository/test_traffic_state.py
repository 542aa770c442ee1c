"""pdserve.repository.model_traffic (one model's traffic state), shadow (ShadowMirror) and
memory (MemoryMeter)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from pdserve.core.types import InferRequest, InferResponse
from pdserve.repository.entry import ModelEntry
from pdserve.repository.memory import ENSEMBLE_SOURCE, MemoryMeter
from pdserve.repository.model_traffic import ModelTraffic
from pdserve.repository.rollout import TrafficControl
from pdserve.repository.rollout_policy import Rollout, RolloutPolicy
from pdserve.repository.shadow import ShadowMirror
from pdserve.repository.traffic import ShadowSpec, TrafficSpec


def test_model_traffic_weights_source_and_split() -> None:
    st = ModelTraffic("m")
    assert st.source() == "default" and st.weights() == {}
    st.file_spec = TrafficSpec(weights={1: 50.0, 2: 50.0, 3: 0.0})
    assert st.source() == "file"
    entry = ModelEntry("m")
    served: Any = {1: object()}
    entry.serving = served
    split = st.split(entry)
    assert split is not None and split.pick("key") == 1
    assert st.unserved == [2]
    st.rollout = Rollout(RolloutPolicy(canary=2), baseline=1)
    assert st.source() == "rollout" and st.weights() == {2: 10.0, 1: 90.0}
    st.forget_split()


def test_shadow_sheds_when_its_queue_is_full() -> None:
    async def main() -> tuple[int, int]:
        runner: Any = SimpleNamespace()
        manager: Any = SimpleNamespace(models={})
        mirror = ShadowMirror(runner, manager)
        st = ModelTraffic("m")
        spec = ShadowSpec(version=2, queue_size=1)
        request = InferRequest("m", "", {})
        response = InferResponse("m", "1", {})
        for _ in range(3):
            mirror.offer(st, spec, request, response)
        shed = st.shadow_results[("2", "shed")]
        mirror.closing = True
        mirror.offer(st, spec, request, response)
        after = st.shadow_results[("2", "shed")]
        mirror.stop(st)
        return shed, after

    shed, after = asyncio.run(main())
    assert shed >= 1 and after == shed


def test_memory_meter_ensemble() -> None:
    stats = SimpleNamespace(memory_bytes=None, memory_source=None, gpu_memory_bytes=None)
    mv: Any = SimpleNamespace(stats=stats, instances=[], name="e", version=1)
    MemoryMeter().measure(mv, in_process=False, ensemble=True, rss_before=None, gpu_before=None)
    assert (stats.memory_bytes, stats.memory_source) == (0, ENSEMBLE_SOURCE)


def test_route_is_a_decision() -> None:
    """TrafficControl.route picks the version and runs nothing; observe records the run."""
    mv1: Any = SimpleNamespace(version=1, version_str="1")
    mv2: Any = SimpleNamespace(version=2, version_str="2")
    entry = ModelEntry("m")
    entry.serving = {1: mv1, 2: mv2}

    class Manager:
        models = {"m": entry}

        def get(self, name: str, version: str = "") -> Any:
            return entry.serving[int(version)] if version else mv2

    runner: Any = SimpleNamespace()
    manager: Any = Manager()
    traffic = TrafficControl(runner, manager)
    mv, routed = traffic.route(InferRequest("m"))
    assert mv is mv2 and routed is None  # no traffic settings: the default version
    mv, routed = traffic.route(InferRequest("m", pinned_version="1"))
    assert mv is mv1 and routed is not None and routed.route == "pinned"

    async def answer() -> InferResponse:
        return InferResponse("m", "1", {})

    response = asyncio.run(traffic.observe(routed, InferRequest("m"), answer()))
    assert response.model_version == "1"
    assert routed.st.window(1).summary(60)["requests"] == 1
    assert routed.st.routed[("1", "pinned")] == 1


def test_traffic_free_until_the_traffic_changes() -> None:
    """route marks a model without traffic settings ``traffic_free`` (the server then
    skips it); the admin endpoint clears the mark, and the entry's default version
    follows its served versions."""
    mv1: Any = SimpleNamespace(version=1, version_str="1")
    mv2: Any = SimpleNamespace(version=2, version_str="2")
    entry = ModelEntry("m")
    assert entry.default_version is None and not entry.traffic_free
    entry.serving = {2: mv2, 1: mv1}
    assert entry.default_version is mv2

    class Manager:
        models = {"m": entry}

        def get(self, name: str, version: str = "") -> Any:
            return entry.serving[int(version)] if version else entry.default_version

    runner: Any = SimpleNamespace()
    traffic = TrafficControl(runner, Manager())
    assert traffic.route(InferRequest("m")) == (mv2, None)
    assert entry.traffic_free
    traffic.set_traffic("m", {"weights": {"1": 100, "2": 0}})
    assert not entry.traffic_free
    mv, routed = traffic.route(InferRequest("m"))
    assert mv is mv1 and routed is not None and routed.route == "split"
    assert not entry.traffic_free
    traffic.set_traffic("m", {"reset": True})
    assert traffic.route(InferRequest("m")) == (mv2, None) and entry.traffic_free
    entry.serving = {}
    assert entry.default_version is None
