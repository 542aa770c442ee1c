"""Host policies on a real server: ``--host-policy cpu,cpu-cores=1`` pins python
worker processes (also after a crash) and the ORT instances' threads to core 1; a
group naming a policy that was not given fails to load with a clear reason."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from pdserve.core.errors import InferError
from pdserve.frontends.http.status import http_status
from pdserve.server import InferenceServer
from tests.conftest import copy_models, descendants, start_server
from tests.goldens import tiny_reference

DATA = Path(__file__).resolve().parents[1] / "data" / "python_models"
CORE = 1

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or not {0, CORE} <= os.sched_getaffinity(0),
    reason="needs CPUs 0 and 1 in this process's affinity mask",
)


def _status(path: Path) -> dict[str, str]:
    fields = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def _threads(pid: int) -> list[dict[str, str]]:
    """``/proc/<pid>/task/*/status`` of every live thread of ``pid``."""
    rows = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            rows.append(_status(task / "status"))
        except OSError:  # the thread ended meanwhile
            continue
    return rows


def _variant(repo: Path, src: str, name: str, extra: str) -> None:
    shutil.copytree(repo / src, repo / name)
    cfg = (repo / name / "config.pbtxt").read_text().replace(f'name: "{src}"', f'name: "{name}"')
    (repo / name / "config.pbtxt").write_text(cfg + extra)


@pytest.fixture(scope="module")
def pinned_server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("host_policy")
    repo = copy_models(tmp / "repo", "tiny")
    shutil.copytree(DATA / "affinity", repo / "affinity")
    # ORT: pool threads (intra_op_thread_count 2) and execution_thread loop, which the
    # host policy overrides (the session runs on the instance's pinned thread)
    _variant(
        repo,
        "tiny",
        "tiny_pool",
        "instance_group [{ count: 1, kind: KIND_CPU }]\n"
        'parameters { key: "intra_op_thread_count" value { string_value: "2" } }\n'
        'parameters { key: "execution_thread" value { string_value: "loop" } }\n',
    )
    # a group naming a policy that was not given
    _variant(
        repo,
        "tiny",
        "tiny_unknown",
        'instance_group [{ name: "pinned", count: 1, kind: KIND_CPU, host_policy: "numa7" }]\n',
    )
    server = start_server(repo, tmp / "log.txt", "--host-policy", f"cpu,cpu-cores={CORE}")
    yield server
    assert server.stop() == 0


def _affinity(client: httpclient.InferenceServerClient, value: float = 1.0):
    inp = httpclient.InferInput("INPUT0", [1], "FP32")
    inp.set_data_from_numpy(np.array([value], dtype=np.float32))
    return client.infer("affinity", [inp])


def test_python_workers_pinned(pinned_server) -> None:
    url = pinned_server.http_url
    # concurrent requests so that both instances (worker processes) answer
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(lambda _: _affinity(httpclient.InferenceServerClient(url)), range(32))
        )
    pids = {int(r.as_numpy("PID")[0]) for r in results}
    for r in results:
        assert r.as_numpy("CPUS").tolist() == [CORE]
        assert r.as_numpy("THREAD_CPUS").tolist() == [CORE]  # threads it starts inherit
    workers = descendants(pinned_server.proc.pid)
    assert pids <= workers, (pids, workers)
    for pid in pids:
        assert _status(Path(f"/proc/{pid}/status"))["Cpus_allowed_list"] == str(CORE)
        assert {t["Cpus_allowed_list"] for t in _threads(pid)} == {str(CORE)}


def test_python_worker_pinned_again_after_crash(pinned_server) -> None:
    client = httpclient.InferenceServerClient(pinned_server.http_url)
    before = {int(_affinity(client).as_numpy("PID")[0]) for _ in range(4)}
    with pytest.raises(InferenceServerException, match="is being restarted"):
        _affinity(client, -1.0)
    deadline = time.monotonic() + 30
    new: set[int] = set()
    while not new and time.monotonic() < deadline:
        new = {int(_affinity(client).as_numpy("PID")[0]) for _ in range(4)} - before
    assert new, "no restarted worker answered"
    for pid in new:
        assert pid in descendants(pinned_server.proc.pid)
        assert _status(Path(f"/proc/{pid}/status"))["Cpus_allowed_list"] == str(CORE)
    result = _affinity(client)
    assert result.as_numpy("CPUS").tolist() == [CORE]


def test_onnxruntime_instance_threads_pinned(pinned_server) -> None:
    client = httpclient.InferenceServerClient(pinned_server.http_url)
    x = np.full((1, 64), 0.5, dtype=np.float32)
    for model in ("tiny", "tiny_pool"):
        for _ in range(5):
            inp = httpclient.InferInput("INPUT0", [1, 64], "FP32")
            inp.set_data_from_numpy(x)
            out = client.infer(model, [inp]).as_numpy("OUTPUT0")
            np.testing.assert_allclose(out, tiny_reference(x), rtol=1e-5, atol=1e-5)
    threads = _threads(pinned_server.proc.pid)
    by_name: dict[str, list[str]] = {}
    for t in threads:
        by_name.setdefault(t["Name"], []).append(t["Cpus_allowed_list"])
    # each pinned instance thread carries its instance name (ORT's pool threads, which
    # it creates, inherit it): tiny has 2 instances (Triton's CPU default), 1 thread each;
    # tiny_pool's thread plus its intra-op pool thread
    assert by_name.get("tiny_0") == [str(CORE)], by_name
    assert by_name.get("tiny_1") == [str(CORE)], by_name
    assert by_name.get("tiny_pool_0") == [str(CORE), str(CORE)], by_name
    # the process itself (event loop thread) is not pinned
    main = _status(Path(f"/proc/{pinned_server.proc.pid}/status"))
    assert main["Cpus_allowed_list"] != str(CORE)
    assert "execution_thread 'loop' is overridden by its host policy" in pinned_server.log()


def test_unknown_policy_fails_to_load(pinned_server) -> None:
    client = httpclient.InferenceServerClient(pinned_server.http_url)
    rows = {r["name"]: r for r in client.get_model_repository_index()}
    row = rows["tiny_unknown"]
    assert row["state"] == "UNAVAILABLE"
    reason = row["reason"]
    assert "model 'tiny_unknown' instance group 'pinned' names host policy 'numa7'" in reason
    assert "which was not given" in reason and "policies given: cpu" in reason
    assert not client.is_model_ready("tiny_unknown")
    assert rows["affinity"]["state"] == "READY" and rows["tiny"]["state"] == "READY"
    assert "numa7" in pinned_server.log()


def test_refused_pin_is_a_clear_load_error(tmp_path: Path) -> None:
    """A policy whose cores the kernel refuses (a container cpuset that shrank after
    the start-up check, or an InferenceServer built in code) fails the load with a
    reason naming the cores, for ORT ("A thread initializer failed, the thread pool
    is not usable anymore" before) and python ("[Errno 22] Invalid argument")."""
    repo = copy_models(tmp_path / "repo", "tiny")
    shutil.copytree(DATA / "affinity", repo / "affinity")
    outside = max(os.sched_getaffinity(0)) + 1

    async def main() -> list[dict[str, str]]:
        server = InferenceServer(repo, host_policies={"cpu": {outside}})
        try:
            for model in ("tiny", "affinity"):
                with pytest.raises(InferError) as e:
                    await server.manager.load_model(model)
                assert f"cannot pin to host policy cpu-cores {outside}" in str(e.value)
                assert http_status(e.value.code) == 400
            return server.manager.index()
        finally:
            await server.manager.close(5.0)

    before = {t.name for t in Path("/proc/self/task").iterdir()}
    rows = {r["name"]: r for r in asyncio.run(main())}
    for model in ("tiny", "affinity"):
        assert rows[model]["state"] == "UNAVAILABLE"
        assert rows[model]["reason"].startswith(f"cannot pin to host policy cpu-cores {outside}: ")
    # the instances' threads did not stay behind
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        left = {t.name for t in Path("/proc/self/task").iterdir()} - before
        if not left:
            break
        time.sleep(0.1)
    names = {(Path("/proc/self/task") / t / "comm").read_text().strip() for t in left}
    assert not any(n.startswith("tiny_") for n in names), names
