"""benchmarks/bench_ray.py without a cluster: the one-hop side's tiny batches as the
plain Ray Serve peer's ``@serve.batch`` (same batch size and wait), and the per-process
CPU figures of a point are kept through the medians."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import numpy as np

from pdserve.config.loading import load_model_config
from pdserve.core.types import InferRequest
from pdserve.server import InferenceServer
from tests.conftest import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "benchmarks" / "peers"))

import bench_ray  # noqa: E402
import ray_serve_tiny  # noqa: E402


def test_batched_tiny_batches_as_the_plain_peer(tmp_path: Path) -> None:
    repo = bench_ray.batched_tiny_repo(
        tmp_path, ray_serve_tiny.MAX_BATCH_SIZE, ray_serve_tiny.BATCH_WAIT_S
    )
    cfg = load_model_config(repo / "tiny")
    assert list(cfg.dynamic_batching.preferred_batch_size) == [32]
    assert cfg.dynamic_batching.max_queue_delay_microseconds == 1000
    assert cfg.max_batch_size == 128  # the model's own limit is kept

    async def main() -> tuple[list[np.ndarray], dict[str, int]]:
        server = InferenceServer(repo)
        await server.start()
        try:
            xs = [np.full((1, 64), i / 40, np.float32) for i in range(40)]
            outs = await asyncio.gather(
                *(server.infer(InferRequest("tiny", inputs={"INPUT0": x})) for x in xs)
            )
            stats = server.manager.get("tiny").stats.as_dict()
            return [o.outputs["OUTPUT0"] for o in outs], stats
        finally:
            await server.stop(timeout=5)

    outs, stats = asyncio.run(main())
    assert stats["inference_count"] == 40
    # 40 requests queued at once: batches of at most 32 rows, so 2 or more runs, and
    # far fewer than one per request
    assert 2 <= stats["execution_count"] <= 10, stats
    assert [o.shape for o in outs] == [(1, 64)] * 40
    assert not np.array_equal(outs[1], outs[39])  # each request got its own rows


def test_medians_keep_each_process_cpu() -> None:
    def point(rps: float, proxy: int, replica: int) -> dict[str, object]:
        cpu = {"proxy": proxy, "replica_pdserve": replica}
        return {"conns": 8, "rps": rps, "p50_ms": 1.0, "p99_ms": 2.0, "cpu_us": cpu}

    runs = [[point(90, 9000, 7000)], [point(100, 8000, 6000)], [point(95, 8500, 9000)]]
    (row,) = bench_ray.medians(runs, "rps")
    assert row["rps"] == 95
    assert row["rps_range"] == [90, 100]
    assert row["cpu_us"] == {"proxy": 8500, "replica_pdserve": 7000}
