"""Triton's rate limiter and the ModelConfig field table through a real server.

Two python models that each hold the one copy of resource ``R`` never run at the same
time with ``--rate-limit=execution_count``, and do without it (their execution
intervals are the models' own timestamps); a model needing more of a resource than the
command line grants, or setting a refused field, fails to load with the reason; an
ignored field loads with one warning.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.conftest import ROOT, ServerProcess, descendants, start_server

MODEL_PY = """\
import time

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            start = time.time()
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            time.sleep(float(x[0]))
            stamps = np.array([start, time.time()], dtype=np.float64)
            responses.append(pb_utils.InferenceResponse([pb_utils.Tensor("T", stamps)]))
        return responses
"""


def _model(repo: Path, name: str, extra: str = "") -> None:
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "1" / "model.py").write_text(MODEL_PY)
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]\n'
        'output [ { name: "T", data_type: TYPE_FP64, dims: [ 2 ] } ]\n' + extra
    )


def _limited(name: str, count: int = 1, priority: int = 1) -> str:
    return (
        "instance_group [ { count: 1, kind: KIND_CPU, rate_limiter { "
        f'resources [ {{ name: "R", count: {count} }} ] priority: {priority} }} }} ]\n'
    )


def _repo(root: Path, *, extras: bool) -> Path:
    repo = root / "repo"
    _model(repo, "stamp_a", _limited("stamp_a"))
    _model(repo, "stamp_b", _limited("stamp_b"))
    if extras:
        _model(repo, "stamp_greedy", _limited("stamp_greedy", count=2))
        _model(repo, "cfg_ignored", "optimization { cuda { graphs: true } }\n")
        _model(repo, "cfg_refused", 'model_repository_agents { agents [ { name: "checksum" } ] }\n')
    return repo


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("limited")
    server = start_server(
        _repo(tmp, extras=True),
        tmp / "pdserve.log",
        "--rate-limit=execution_count",
        "--rate-limit-resource=R:1",
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def unlimited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("unlimited")
    server = start_server(_repo(tmp, extras=False), tmp / "pdserve.log")
    yield server
    server.stop()


def _intervals(server: ServerProcess, sleep_s: float) -> dict[str, list[tuple[float, float]]]:
    """Two requests to each of stamp_a and stamp_b at once; each one's (start, end)."""
    out: dict[str, list[tuple[float, float]]] = {"stamp_a": [], "stamp_b": []}
    errors: list[BaseException] = []
    barrier = threading.Barrier(4)

    def call(model: str) -> None:
        try:
            client = httpclient.InferenceServerClient(server.http_url, network_timeout=60)
            x = httpclient.InferInput("X", [1], "FP32")
            x.set_data_from_numpy(np.array([sleep_s], dtype=np.float32))
            barrier.wait()
            t = client.infer(model, [x]).as_numpy("T")
            out[model].append((float(t[0]), float(t[1])))
        except BaseException as e:  # reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=call, args=(m,)) for m in ("stamp_a", "stamp_b") * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return out


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The longest time (s) an interval of ``a`` and one of ``b`` ran together."""
    return max(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def test_models_sharing_one_resource_never_run_together(limited: ServerProcess) -> None:
    got = _intervals(limited, 0.3)
    assert len(got["stamp_a"]) == len(got["stamp_b"]) == 2
    assert _overlap(got["stamp_a"], got["stamp_b"]) == 0.0, got
    assert "rate limiter: execution_count, resources: R:1" in limited.log()
    spans = sorted(got["stamp_a"] + got["stamp_b"])
    assert spans[-1][1] - spans[0][0] >= 4 * 0.3 - 0.05  # one at a time: four sleeps in a row


def test_without_the_rate_limiter_they_do(unlimited: ServerProcess) -> None:
    got = _intervals(unlimited, 0.5)
    assert _overlap(got["stamp_a"], got["stamp_b"]) > 0.2, got
    assert "model 'stamp_a': instance_group rate_limiter is ignored: --rate-limit is off" in (
        unlimited.log()
    )


def _index(server: ServerProcess) -> dict[str, dict]:
    client = httpclient.InferenceServerClient(server.http_url)
    return {row["name"]: row for row in client.get_model_repository_index()}


def test_a_model_needing_more_than_granted_fails_to_load(limited: ServerProcess) -> None:
    row = _index(limited)["stamp_greedy"]
    assert row["state"] == "UNAVAILABLE", row
    assert (
        'instance_group[0].rate_limiter.resources[0]: Resource count for "R" is limited to 1 '
        "which will prevent scheduling of one or more model instances, the minimum required "
        "count is 2 (--rate-limit-resource)"
    ) in row["reason"], row


def test_a_refused_field_fails_the_load_and_an_ignored_one_warns(limited: ServerProcess) -> None:
    index = _index(limited)
    assert index["cfg_refused"]["state"] == "UNAVAILABLE"
    assert (
        "model_repository_agents.agents.name: not supported by pdserve: pdserve runs no "
        "repository agents" in index["cfg_refused"]["reason"]
    ), index["cfg_refused"]
    assert index["cfg_ignored"]["state"] == "READY", index["cfg_ignored"]
    warning = "model 'cfg_ignored': optimization.cuda.graphs is ignored: CUDA graphs (TensorRT)"
    assert limited.log().count(warning) == 1, limited.log()


@pytest.mark.parametrize(
    ("flag", "needle"),
    [
        ("--rate-limit-resource=R", "got 'R'"),
        ("--rate-limit-resource=R:two", "got 'R:two': count and device are integers"),
        ("--rate-limit-resource=R:1:0:9", "got 'R:1:0:9'"),
        ("--rate-limit=fastest", "invalid choice: 'fastest'"),
    ],
)
def test_bad_rate_limit_flags_exit_2(flag: str, needle: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "serve", flag],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert needle in proc.stderr, proc.stderr
    if "resource" in flag:
        assert "--rate-limit-resource option format is '<resource_name>:<count>:<device>' or " in (
            proc.stderr
        )


# -- two models loading at once whose resources conflict -------------------------------


def _global_or_device(name: str, is_global: bool) -> str:
    flag = " global: true" if is_global else ""
    return (
        "instance_group [ { count: 2, kind: KIND_CPU, rate_limiter { "
        f'resources [ {{ name: "Q" count: 1{flag} }} ] }} }} ]\n'
    )


def test_a_model_refused_when_registering_frees_its_instances(tmp_path: Path) -> None:
    """``Q`` global in one model and per device in another, both loaded at once: each
    passes the check before loading (the other is not registered yet); the second to
    register is refused and its python workers must stop with it."""
    repo = tmp_path / "repo"
    _model(repo, "q_global", _global_or_device("q_global", True))
    _model(repo, "q_device", _global_or_device("q_device", False))
    server = start_server(
        repo,
        tmp_path / "pdserve.log",
        "--rate-limit=execution_count",
        "--model-control-mode=explicit",
    )
    try:
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
        client.load_model("q_global")  # the python backend's own helpers start once
        client.unload_model("q_global")
        time.sleep(1)
        baseline = len(descendants(server.proc.pid))
        for _ in range(3):
            results: dict[str, str] = {}

            def load(name: str, results: dict[str, str] = results) -> None:
                own = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
                try:
                    own.load_model(name)
                    results[name] = "loaded"
                except Exception as e:  # noqa: BLE001 - the refusal is the point
                    results[name] = str(e)
                finally:
                    own.close()

            threads = [threading.Thread(target=load, args=(m,)) for m in ("q_global", "q_device")]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert sorted(results.values()).count("loaded") == 1, results
            refused = next(v for v in results.values() if v != "loaded")
            assert 'Resource "Q" is present as both global and device-specific' in refused
            loaded = next(m for m, v in results.items() if v == "loaded")
            client.unload_model(loaded)
            deadline = time.monotonic() + 30
            while len(descendants(server.proc.pid)) > baseline:
                assert time.monotonic() < deadline, "a refused model's workers kept running"
                time.sleep(0.2)
        x = httpclient.InferInput("X", [1], "FP32")  # the limiter still serves
        x.set_data_from_numpy(np.array([0.0], dtype=np.float32))
        client.load_model("q_global")
        assert client.infer("q_global", [x]).as_numpy("T").shape == (2,)
        client.close()
    finally:
        server.stop()
