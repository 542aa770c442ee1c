"""The python backend and ensembles against a real pdserve (issue 3).

The models are in ``tests/data/python_models`` (plus ``efficientnet_lite0`` and
``postprocess`` from the example repository for the seed-style ensemble):

* ``seed_preprocess`` — written exactly like the seed's preprocess model
  (``cv2.imdecode``, ``pb_utils.get_input_tensor_by_name(...).as_numpy()``,
  ``pb_utils.InferenceResponse(output_tensors=[...])``);
* ``add_sub`` — Triton's example, its tensors from ``auto_complete_config``;
* ``identity`` — dynamic batching: several requests reach one ``execute`` call;
* ``crashy`` — raises, exits, returns errors and wrong outputs on demand;
* ``bls`` / ``bls_async`` — BLS with ``exec()`` and ``async_exec()``;
* ``sleepy`` + ``ens_parallel`` — independent ensemble steps run concurrently;
* ``ens_crashy`` — a failing step fails its request only.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import GOLDENS, ServerProcess, copy_models, start_server

DATA = Path(__file__).resolve().parents[1] / "data" / "python_models"


def _repository(dst: Path) -> Path:
    copy_models(dst, "efficientnet_lite0", "postprocess")
    for model in DATA.iterdir():
        shutil.copytree(model, dst / model.name)
    return dst


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _repository(tmp_path_factory.mktemp("python_backend") / "models")


@pytest.fixture(scope="module")
def server(repo: Path) -> Iterator[ServerProcess]:
    proc = start_server(repo, repo.parent / "pdserve.log")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> httpclient.InferenceServerClient:
    return httpclient.InferenceServerClient(server.http_url, concurrency=16, network_timeout=60)


def _bytes_input(name: str, values: list[bytes], batch: bool = False) -> httpclient.InferInput:
    arr = np.array(values, dtype=object).reshape([len(values), 1] if batch else [len(values)])
    tensor = httpclient.InferInput(name, list(arr.shape), "BYTES")
    tensor.set_data_from_numpy(arr)
    return tensor


def _fp32_input(name: str, arr: np.ndarray) -> httpclient.InferInput:
    tensor = httpclient.InferInput(name, list(arr.shape), "FP32")
    tensor.set_data_from_numpy(arr.astype(np.float32))
    return tensor


def _crashy(client: httpclient.InferenceServerClient, mode: str, model: str = "crashy") -> int:
    result = client.infer(model, [_bytes_input("MODE", [mode.encode()])])
    return int(result.as_numpy("PID")[0])


def _crashy_async(client: httpclient.InferenceServerClient, mode: str, model: str = "crashy"):
    """Start a request (tritonclient.http is not thread-safe: concurrency is gevent's)."""
    return client.async_infer(model, [_bytes_input("MODE", [mode.encode()])])


def _pid(pending) -> int:
    return int(pending.get_result().as_numpy("PID")[0])


def _error(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as info:
        call()
    return info.value


# --------------------------------------------------------------------------- basics


def test_auto_complete_config_fills_the_configuration(
    client: httpclient.InferenceServerClient,
) -> None:
    config = client.get_model_config("add_sub")
    assert [i["name"] for i in config["input"]] == ["INPUT0", "INPUT1"]
    assert [o["name"] for o in config["output"]] == ["OUTPUT0", "OUTPUT1"]
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    a = np.arange(4, dtype=np.float32)
    b = np.array([10, 20, 30, 40], dtype=np.float32)
    result = client.infer("add_sub", [_fp32_input("INPUT0", a), _fp32_input("INPUT1", b)])
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)


def test_seed_style_model_runs_unchanged(client: httpclient.InferenceServerClient) -> None:
    import cv2

    raw = np.load(GOLDENS / "image_classifier.npz")["image_bytes_flower"]
    tensor = httpclient.InferInput("input_image_bytes", [raw.size], "UINT8")
    tensor.set_data_from_numpy(raw)
    got = client.infer("seed_preprocess", [tensor]).as_numpy("preprocessed_image")
    img = cv2.cvtColor(cv2.imdecode(raw, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    img = cv2.resize(img, (224, 224), interpolation=cv2.INTER_LINEAR)
    want = np.transpose((img.astype(np.float32) - 127.0) / 128.0, (2, 0, 1))[np.newaxis]
    np.testing.assert_array_equal(got, want)


def test_seed_style_ensemble_classifies_a_cat(client: httpclient.InferenceServerClient) -> None:
    raw = np.load(GOLDENS / "image_classifier.npz")["image_bytes_chelsea"]
    tensor = httpclient.InferInput("input_image_bytes", [raw.size], "UINT8")
    tensor.set_data_from_numpy(raw)
    result = client.infer("seed_image_classifier", [tensor])
    labels = [x.decode() for x in result.as_numpy("top5_labels")[0]]
    assert result.as_numpy("top5_confidences").shape == (1, 5)
    assert "cat" in labels[0], labels


def test_several_requests_reach_one_execute_call(client: httpclient.InferenceServerClient) -> None:
    """identity (dynamic batching) gets concurrent requests as one list, unmerged."""
    rng = np.random.default_rng(0)
    # (the dynamic batcher only groups requests whose shapes agree, as Triton's does)
    inputs = [rng.random((1 + i % 2, 16), dtype=np.float32) for i in range(12)]
    pending = [client.async_infer("identity", [_fp32_input("INPUT0", x)]) for x in inputs]
    results = [p.get_result() for p in pending]
    call_sizes = []
    for x, r in zip(inputs, results, strict=True):
        np.testing.assert_array_equal(r.as_numpy("OUTPUT0"), x)  # not merged or padded
        call_sizes.append(int(r.as_numpy("CALL_SIZE")[0, 0]))
    assert max(call_sizes) > 1, call_sizes


@pytest.mark.parametrize("shape", [(1, 3 * 224 * 224), (8, 32 * 3 * 224 * 224 // 8)])
def test_large_tensors_round_trip(
    client: httpclient.InferenceServerClient, shape: tuple[int, int]
) -> None:
    """A 602 KB image tensor and a 32x3x224x224 batch (19 MB) through shared memory."""
    x = np.random.default_rng(1).standard_normal(shape, dtype=np.float32)
    out = client.infer("identity", [_fp32_input("INPUT0", x)]).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(out, x)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("mode", "status", "words"),
    [
        ("bad_arg", "400", "MODE bad_arg is a bad argument"),
        ("internal", "500", "crashy failed inside"),
        ("raise", "500", "ValueError: crashy was asked to raise"),
        ("wrong_dtype", "500", "returned output 'PID' as FP64, but its model configuration says"),
        ("missing", "500", "did not return requested output 'PID'"),
    ],
)
def test_model_errors_become_clear_errors(
    client: httpclient.InferenceServerClient, mode: str, status: str, words: str
) -> None:
    error = _error(lambda: _crashy(client, mode))
    assert error.status() == status
    assert words in error.message()
    assert _crashy(client, "pid") > 0  # the model is still fine


def test_a_worker_killed_mid_request_fails_only_its_request(
    client: httpclient.InferenceServerClient,
) -> None:
    pids = {_pid(p) for p in [_crashy_async(client, "sleep:0.4") for _ in range(2)]}
    assert len(pids) == 2  # one worker per instance
    slow = _crashy_async(client, "sleep:30")
    time.sleep(0.5)
    idle = _crashy(client, "pid")  # answered by the other, idle worker
    (busy,) = pids - {idle}
    os.kill(busy, signal.SIGKILL)
    with pytest.raises(InferenceServerException) as info:
        slow.get_result(timeout=20)
    assert info.value.status() == "500"
    message = info.value.message()
    assert f"(pid {busy}) was killed by SIGKILL" in message, message
    assert "crashy" in message and "restarted" in message
    # the model stays available; the dead worker is replaced
    seen = {_pid(p) for p in [_crashy_async(client, "sleep:0.3") for _ in range(2)]}
    assert busy not in seen and idle in seen and len(seen) == 2


def test_a_worker_that_exits_is_restarted(client: httpclient.InferenceServerClient) -> None:
    error = _error(lambda: _crashy(client, "exit"))
    assert error.status() == "500"
    assert "exited with code 3" in error.message()
    for _ in range(4):
        assert _crashy(client, "pid") > 0


def test_a_worker_that_cannot_restart_gives_503_until_it_can(
    client: httpclient.InferenceServerClient, repo: Path
) -> None:
    marker = repo / "crashy" / "FAIL_INITIALIZE"
    marker.write_text("")
    try:
        error = _error(lambda: _crashy(client, "exit"))
        assert error.status() == "500"
        statuses = []
        for _ in range(6):
            try:
                _crashy(client, "pid")
                statuses.append("200")
            except InferenceServerException as e:
                statuses.append(e.status())
                assert "could not be restarted" in e.message()
                assert "FAIL_INITIALIZE is present" in e.message()
            time.sleep(0.1)
        assert "503" in statuses and "200" in statuses  # the other instance still serves
    finally:
        marker.unlink()
    time.sleep(1.0)  # past the restart back-off
    for _ in range(6):
        assert _crashy(client, "pid") > 0


# --------------------------------------------------------------------------- BLS


def test_bls_exec_calls_another_model(client: httpclient.InferenceServerClient) -> None:
    a = np.array([1, 2, 3, 4], dtype=np.float32)
    b = np.array([0.5, 0.5, 1, 1], dtype=np.float32)
    inputs = [_fp32_input("INPUT0", a), _fp32_input("INPUT1", b), _bytes_input("TARGET", [b""])]
    result = client.infer("bls", inputs)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    stats = client.get_inference_statistics("add_sub")["model_stats"][0]
    assert stats["inference_count"] >= 1  # the BLS call went through add_sub's scheduler


def test_bls_errors_come_back_as_responses(client: httpclient.InferenceServerClient) -> None:
    a = np.zeros(4, dtype=np.float32)
    inputs = [_fp32_input("INPUT0", a), _fp32_input("INPUT1", a), _bytes_input("TARGET", [b"nope"])]
    error = _error(lambda: client.infer("bls", inputs))
    assert error.status() == "404"
    assert "BLS failed" in error.message() and "nope" in error.message()


def test_bls_async_exec_from_async_execute(client: httpclient.InferenceServerClient) -> None:
    a = np.array([1, 2, 3, 4], dtype=np.float32)
    b = np.array([4, 3, 2, 1], dtype=np.float32)
    inputs = [_fp32_input("INPUT0", a), _fp32_input("INPUT1", b), _bytes_input("TARGET", [b""])]
    pending = [client.async_infer("bls_async", inputs) for _ in range(4)]
    for p in pending:
        result = p.get_result()
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * a)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), 2 * b)


# --------------------------------------------------------------------------- ensembles


def test_independent_ensemble_steps_run_concurrently(
    client: httpclient.InferenceServerClient,
) -> None:
    x = np.array([0.6], dtype=np.float32)
    client.infer("ens_parallel", [_fp32_input("X", np.array([0.0], dtype=np.float32))])
    start = time.perf_counter()
    result = client.infer("ens_parallel", [_fp32_input("X", x)])
    elapsed = time.perf_counter() - start
    np.testing.assert_array_equal(result.as_numpy("Y1"), x)
    np.testing.assert_array_equal(result.as_numpy("Y2"), x)
    assert elapsed < 1.0, f"two 0.6 s steps took {elapsed:.2f} s: they ran one after the other"


def test_a_failing_step_fails_only_its_request(client: httpclient.InferenceServerClient) -> None:
    good = [_crashy_async(client, "sleep:0.1", "ens_crashy") for _ in range(6)]
    bad = _crashy_async(client, "bad_arg", "ens_crashy")
    broken = _crashy_async(client, "raise", "ens_crashy")
    assert all(_pid(p) > 0 for p in good)
    with pytest.raises(InferenceServerException) as info:
        bad.get_result()
    assert info.value.status() == "400"
    assert info.value.message() == "MODE bad_arg is a bad argument"
    with pytest.raises(InferenceServerException) as info:
        broken.get_result()
    assert info.value.status() == "500" and "crashy was asked to raise" in info.value.message()


# --------------------------------------------------------------------------- lifecycle


def _shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:  # pragma: no cover - no /dev/shm on this system
        return set()


def _held(entry: str) -> bool:
    """Whether a live process maps or has open ``/dev/shm/<entry>``."""
    path = f"/dev/shm/{entry}"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                if path in f.read():
                    return True
            fds = f"/proc/{pid}/fd"
            if any(os.readlink(f"{fds}/{fd}") == path for fd in os.listdir(fds)):
                return True
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_workers_stop_with_the_server_and_leave_no_shared_memory(tmp_path: Path) -> None:
    before = _shm_entries()
    repo = tmp_path / "models"
    repo.mkdir()
    for name in ("crashy", "identity"):
        shutil.copytree(DATA / name, repo / name)
    proc = start_server(repo, tmp_path / "pdserve.log")
    try:
        c = httpclient.InferenceServerClient(proc.http_url, concurrency=4)
        pids = {_pid(p) for p in [_crashy_async(c, "sleep:0.3") for _ in range(2)]}
        x = np.ones((2, 150528), dtype=np.float32)
        pids.add(int(c.infer("identity", [_fp32_input("INPUT0", x)]).as_numpy("PID")[0, 0]))
        assert len(pids) == 3 and all(_alive(p) for p in pids)
    finally:
        assert proc.stop() == 0, proc.log()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_alive(p) for p in pids)
    # what the server's processes left: new entries no live process holds (the suite's
    # other worker may hold entries of its own, e.g. multiprocessing's semaphores)
    assert {e for e in _shm_entries() - before if not _held(e)} == set()
    assert "Traceback" not in proc.log()


# --------------------------------------------------------------------------- child processes


def _signal_mask(pid: int, field: str) -> int:
    """``SigIgn`` / ``SigCgt`` of ``/proc/<pid>/status`` as a bit mask (bit n-1: signal n)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_processes_a_model_starts_can_be_terminated_with_sigterm(tmp_path: Path) -> None:
    """The worker ignores SIGTERM (the server decides when it stops), but a program a
    model's initialize() starts (subprocess: fork + exec) and a child it forks get the
    default SIGTERM: a SIGTERM ends them. The worker itself still shrugs SIGTERM off."""
    repo = tmp_path / "models"
    shutil.copytree(DATA / "child_procs", repo / "child_procs")
    cfg = repo / "child_procs" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('string_value: "0"', 'string_value: "1"'))
    server = start_server(repo, tmp_path / "pdserve.log")
    pids: list[int] = []
    try:
        client = httpclient.InferenceServerClient(server.http_url)
        x = _fp32_input("X", np.zeros(1))
        pids = [int(p) for p in client.infer("child_procs", [x]).as_numpy("PIDS")]
        program, forked, worker = pids
        assert program and forked and worker, pids
        term = 1 << (signal.SIGTERM - 1)
        # the worker catches SIGTERM with a handler that does nothing (an ignored signal
        # would stay ignored across exec in every program a model starts)
        assert _signal_mask(worker, "SigCgt") & term, "the worker must not die of SIGTERM"
        for pid in (program, forked):
            assert not _signal_mask(pid, "SigIgn") & term, f"{pid} ignores SIGTERM"
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (_running(program) or _running(forked)):
            time.sleep(0.02)
        assert not _running(program) and not _running(forked)
        os.kill(worker, signal.SIGTERM)
        time.sleep(0.3)
        assert _running(worker)
        assert [int(p) for p in client.infer("child_procs", [x]).as_numpy("PIDS")] == pids
    finally:
        for pid in pids[:2]:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        server.stop()
