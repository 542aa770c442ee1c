"""Unit tests: response cache, queue policies, metrics exposition, Grafana dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pdserve.backends.base import ExecRequest, batch_input_tensors, merge_batch
from pdserve.cache import ResponseCache, parse_cache_config
from pdserve.core.errors import InferError
from pdserve.core.stats import Histogram, ModelMetrics, ModelStats
from pdserve.core.types import InferRequest
from pdserve.observability.metrics import TRAFFIC_METRICS, attach, cache_families, model_families
from pdserve.observability.monitoring.monitor import METRICS as MONITORING_METRICS
from pdserve.scheduling.queue_policy import PriorityLevels, QueuePolicy

ROOT = Path(__file__).resolve().parents[3]


def exec_req(inputs: dict[str, np.ndarray], outputs: list[str] | None = None) -> ExecRequest:
    return ExecRequest(inputs, outputs or ["OUT"], InferRequest("m", inputs=inputs))


MV = SimpleNamespace(name="m", version_str="1")


# -- response cache -----------------------------------------------------------------


def test_cache_key_covers_bytes_shape_dtype_outputs_and_model() -> None:
    a = np.arange(6, dtype=np.float32)
    base = ResponseCache.key(MV, exec_req({"IN": a.reshape(2, 3)}))  # type: ignore[arg-type]
    same = ResponseCache.key(MV, exec_req({"IN": a.reshape(2, 3).copy()}))  # type: ignore[arg-type]
    assert base == same and len(base) == 16
    variants = [
        exec_req({"IN": a.reshape(3, 2)}),
        exec_req({"IN": a.astype(np.float64).reshape(2, 3)}),
        exec_req({"IN": (a + 1).reshape(2, 3)}),
        exec_req({"IN": a.reshape(2, 3)}, ["OTHER"]),
        exec_req({"IN2": a.reshape(2, 3)}),
    ]
    keys = {ResponseCache.key(MV, r) for r in variants}  # type: ignore[arg-type]
    assert base not in keys and len(keys) == len(variants)
    other_model = SimpleNamespace(name="m", version_str="2")
    assert ResponseCache.key(other_model, exec_req({"IN": a.reshape(2, 3)})) != base  # type: ignore[arg-type]
    # BYTES: element boundaries matter.
    k1 = ResponseCache.key(MV, exec_req({"S": np.array([b"ab", b"c"], dtype=object)}))  # type: ignore[arg-type]
    k2 = ResponseCache.key(MV, exec_req({"S": np.array([b"a", b"bc"], dtype=object)}))  # type: ignore[arg-type]
    assert k1 != k2


def test_cache_lru_by_bytes_and_read_only_copies() -> None:
    cache = ResponseCache(3 * (400 + 16))
    outs = {i: {"OUT": np.full(100, i, dtype=np.float32)} for i in range(5)}
    keys = {i: bytes([i]) * 16 for i in range(5)}
    for i in range(3):
        assert cache.insert(keys[i], outs[i])
    assert cache.lookup(keys[0]) is not None  # 0 becomes most recently used
    cache.insert(keys[3], outs[3])  # evicts 1
    assert cache.lookup(keys[1]) is None
    assert cache.evictions == 1 and len(cache) == 3
    hit = cache.lookup(keys[0])
    assert hit is not None
    np.testing.assert_array_equal(hit["OUT"], outs[0]["OUT"])
    outs[0]["OUT"][:] = 99  # the cache holds a copy
    assert cache.lookup(keys[0])["OUT"][0] == 0  # type: ignore[index]
    with pytest.raises(ValueError):
        hit["OUT"][0] = 1  # read-only
    assert not cache.insert(b"x" * 16, {"OUT": np.zeros(10_000, np.float32)})  # larger than all
    assert cache.bytes_used <= cache.capacity_bytes
    assert cache.hits == 3 and cache.misses == 1


def test_cache_config_flag() -> None:
    assert parse_cache_config(["local,size=1048576"]) == 1048576
    assert parse_cache_config(["size=10"]) == 10
    with pytest.raises(ValueError):
        parse_cache_config(["memcached,size=10"])
    with pytest.raises(ValueError):
        parse_cache_config(["local,size=big"])


# -- queue policy -------------------------------------------------------------------


def test_priority_levels_and_timeouts_follow_triton() -> None:
    db = mc.ModelDynamicBatching()
    text_format.Parse(
        "priority_levels: 3 default_priority_level: 2 "
        "default_queue_policy { default_timeout_microseconds: 1000 allow_timeout_override: true } "
        "priority_queue_policy { key: 1 value { max_queue_size: 4 timeout_action: DELAY } }",
        db,
    )
    levels = PriorityLevels.from_config(db)
    assert levels.count == 3 and levels.default == 2
    assert levels.level_for({}) == 1
    assert levels.level_for({"priority": 0}) == 1
    assert levels.level_for({"priority": 1}) == 0
    assert levels.level_for({"priority": 3}) == 2
    assert levels.level_for({"priority": 7}) == 1  # above the levels: default
    with pytest.raises(InferError):
        levels.level_for({"priority": -1})
    assert levels.policies[0] == QueuePolicy(0, True, False, 4)
    p = levels.policies[1]
    assert p.timeout_for({}) == 1_000_000
    assert p.timeout_for({"timeout": 500}) == 500_000  # shorter: allowed
    assert p.timeout_for({"timeout": 5000}) == 1_000_000  # longer: capped
    assert QueuePolicy(0, False, True, 0).timeout_for({"timeout": 5000}) == 5_000_000
    assert QueuePolicy(1000, False, False, 0).timeout_for({"timeout": 5}) == 1000


# -- ragged merge and batch inputs ----------------------------------------------------


def test_ragged_merge_and_batch_inputs() -> None:
    reqs = [exec_req({"R": np.arange(n, dtype=np.float32).reshape(1, n)}) for n in (3, 1, 4)]
    merged = merge_batch(reqs, {"R"})
    assert merged["R"].shape == (8,)
    cfg = mc.ModelConfig()
    text_format.Parse(
        'batch_input [ { kind: BATCH_ELEMENT_COUNT target_name: "A" data_type: TYPE_INT32 '
        'source_input: "R" }, { kind: BATCH_ACCUMULATED_ELEMENT_COUNT target_name: "B" '
        'data_type: TYPE_FP32 source_input: "R" }, { kind: BATCH_ACCUMULATED_ELEMENT_COUNT_WITH_ZERO '
        'target_name: "C" data_type: TYPE_INT32 source_input: "R" }, '
        '{ kind: BATCH_MAX_ELEMENT_COUNT_AS_SHAPE target_name: "D" data_type: TYPE_INT32 '
        'source_input: "R" } ]',
        cfg,
    )
    t = batch_input_tensors(cfg.batch_input, reqs)
    np.testing.assert_array_equal(t["A"], [3, 1, 4])
    assert t["A"].dtype == np.int32
    np.testing.assert_array_equal(t["B"], [3, 4, 8])
    assert t["B"].dtype == np.float32
    np.testing.assert_array_equal(t["C"], [0, 3, 4, 8])
    assert t["D"].shape == (4,)
    single = merge_batch(reqs[:1], {"R"})
    assert single["R"].shape == (3,)


# -- metrics exposition ----------------------------------------------------------------


def test_histogram_buckets_are_cumulative() -> None:
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 2.0):
        h.observe(v)
    assert h.cumulative() == [("0.1", 2), ("1", 3), ("+Inf", 4)]
    assert h.sum == pytest.approx(2.65) and h.count == 4


def test_model_families_render_triton_names() -> None:
    stats = ModelStats("m", "3")
    mm = attach(stats)
    assert attach(stats) is mm and stats.metrics is mm
    stats.record_execution(4, 0, 2_000_000, 0)
    stats.record_compute(2, 0, 2_000_000, 0)
    stats.record_success(2, 5_000_000, 1_000_000, 2_000_000)
    stats.record_success(2, 6_000_000, 1_000_000, 2_000_000)
    stats.record_failure(1_000, "CANCELED")
    stats.record_cache(True, 3_000)
    stats.pending = 5
    text = "".join(f.render() for f in model_families([stats]))
    lab = '{model="m",version="3"}'
    assert f"nv_inference_request_success{lab} 2\n" in text
    assert f"nv_inference_count{lab} 4\n" in text
    assert f"nv_inference_exec_count{lab} 1\n" in text
    assert f"nv_inference_pending_request_count{lab} 5\n" in text
    assert f"nv_inference_request_duration_us{lab} 11000\n" in text
    assert f"nv_inference_queue_duration_us{lab} 2000\n" in text
    assert f"nv_inference_compute_infer_duration_us{lab} 4000\n" in text
    assert f"nv_cache_num_hits_per_model{lab} 1\n" in text
    assert 'nv_inference_request_failure{model="m",version="3",reason="CANCELED"} 1\n' in text
    assert "# TYPE nv_inference_request_success counter\n" in text
    assert "# TYPE nv_inference_pending_request_count gauge\n" in text
    assert f"pdserve_request_duration_seconds_count{lab} 2\n" in text
    assert 'pdserve_batch_size_bucket{model="m",version="3",le="4"} 1\n' in text
    assert isinstance(mm, ModelMetrics)


def test_cache_families_only_with_a_cache() -> None:
    assert cache_families(None) == []
    cache = ResponseCache(1000)
    cache.insert(b"k" * 16, {"OUT": np.zeros(4, np.float32)})
    text = "".join(f.render() for f in cache_families(cache))
    assert "nv_cache_num_entries 1\n" in text
    assert "nv_cache_util 0.032\n" in text


def test_dashboard_queries_use_exported_metric_names() -> None:
    dash = json.loads((ROOT / "dashboards" / "grafana-pdserve.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 10
    stats = ModelStats("m", "1")
    attach(stats)
    cache = ResponseCache(100)
    exported = {
        line.split()[2]
        for f in model_families([stats]) + cache_families(cache)
        for line in f.render().splitlines()
        if line.startswith("# TYPE")
    }
    exported |= {"process_cpu_seconds_total", "process_resident_memory_bytes"}
    exported |= {"nv_cpu_utilization", "nv_cpu_memory_used_bytes", "nv_gpu_utilization"}
    exported |= {"nv_gpu_memory_used_bytes", "nv_gpu_memory_total_bytes"}
    exported |= {"pdserve_worker_cpu_seconds_total", "pdserve_worker_resident_memory_bytes"}
    exported |= {"pdserve_model_ready"}
    exported |= set(MONITORING_METRICS)  # the distributions-and-drift row
    exported |= set(TRAFFIC_METRICS)  # (its shadow divergence)
    for expr in exprs:
        for name in re.findall(r"\b((?:nv|pdserve|process)_[a-z_]+)", expr):
            base = re.sub(r"_(bucket|sum|count)$", "", name)
            assert name in exported or base in exported, f"{name} in {expr!r} is not exported"
    titles = " ".join(p["title"] for p in dash["panels"]).lower()
    for word in ("qps", "success rate", "p50", "queue", "batch size"):
        assert word in titles


def test_gpu_metrics_through_a_fake_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    """No GPU here: a stand-in ``pynvml`` module exercises the NVML path."""
    import sys
    from types import ModuleType

    from pdserve.observability.metrics import GpuSampler

    fake = ModuleType("pynvml")
    fake.nvmlInit = lambda: None  # type: ignore[attr-defined]
    fake.nvmlDeviceGetCount = lambda: 1  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"  # type: ignore[attr-defined]
    fake.nvmlDeviceGetUUID = lambda h: b"GPU-1234"  # type: ignore[attr-defined]
    fake.nvmlDeviceGetUtilizationRates = lambda h: SimpleNamespace(gpu=37)  # type: ignore[attr-defined]
    fake.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=80, used=20)  # type: ignore[attr-defined]
    fake.nvmlDeviceGetPowerUsage = lambda h: 150_000  # type: ignore[attr-defined]

    def unsupported(h: object) -> float:
        raise RuntimeError("not supported")

    fake.nvmlDeviceGetPowerManagementLimit = unsupported  # type: ignore[attr-defined]
    fake.nvmlDeviceGetTotalEnergyConsumption = lambda h: 5_000  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    sampler = GpuSampler.create()
    assert sampler is not None
    text = "".join(f.render() for f in sampler.families())
    assert 'nv_gpu_utilization{gpu_uuid="GPU-1234"} 0.37\n' in text
    assert 'nv_gpu_memory_used_bytes{gpu_uuid="GPU-1234"} 20\n' in text
    assert 'nv_gpu_power_usage{gpu_uuid="GPU-1234"} 150\n' in text
    assert 'nv_energy_consumption{gpu_uuid="GPU-1234"} 5\n' in text
    assert "nv_gpu_power_limit" not in text  # unsupported reading: no series
    fake.nvmlInit = lambda: (_ for _ in ()).throw(RuntimeError("no driver"))  # type: ignore[attr-defined]
    assert GpuSampler.create() is None  # a driver error means no GPU metrics, not a crash
