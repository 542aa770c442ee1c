"""Stateful models through the sequence batcher, against a real pdserve (issue 15 item 3).

Models: ``examples/stateful/accumulator`` (oldest strategy, implicit state, string
CORRID, 2 instances) and ``tests/data/python_models/seq_direct`` (direct strategy,
state kept by the model by its UINT64 CORRID, null requests in empty slots). Clients:
real ``tritonclient.http`` and ``tritonclient.grpc`` with ``sequence_id`` /
``sequence_start`` / ``sequence_end``.
"""

from __future__ import annotations

import json
import random
import shutil
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT, ServerProcess, start_server

DATA = Path(__file__).resolve().parents[1] / "data" / "python_models"
ACCUMULATOR = ROOT / "examples" / "stateful" / "accumulator"

#: an ensemble with the stateful accumulator as its step (the sequence parameters
#: reach the step, as Triton passes the correlation id and flags on)
ENSEMBLE = """
name: "ens_acc"
platform: "ensemble"
max_batch_size: 8
input [ { name: "X", data_type: TYPE_FP32, dims: [ 1 ] } ]
output [ { name: "TOTAL", data_type: TYPE_FP32, dims: [ 1 ] } ]
ensemble_scheduling { step [ {
  model_name: "accumulator", model_version: -1
  input_map { key: "INPUT", value: "X" }
  output_map { key: "SUM", value: "TOTAL" }
} ] }
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    repo = tmp_path_factory.mktemp("sequence") / "models"
    shutil.copytree(ACCUMULATOR, repo / "accumulator")
    shutil.copytree(DATA / "seq_direct", repo / "seq_direct")
    shutil.copytree(DATA / "seq_bls", repo / "seq_bls")
    (repo / "ens_acc" / "1").mkdir(parents=True)
    (repo / "ens_acc" / "config.pbtxt").write_text(ENSEMBLE)
    proc = start_server(repo, repo.parent / "pdserve.log")
    yield proc
    proc.stop()


def _client(server: ServerProcess, protocol: str) -> Any:
    if protocol == "http":
        return httpclient.InferenceServerClient(server.http_url, network_timeout=60)
    return grpcclient.InferenceServerClient(server.grpc_url)


def _input(protocol: str, name: str, value: float, datatype: str) -> Any:
    mod = httpclient if protocol == "http" else grpcclient
    arr = np.array([[value]], dtype=np.float32 if datatype == "FP32" else np.int32)
    tensor = mod.InferInput(name, [1, 1], datatype)
    tensor.set_data_from_numpy(arr)
    return tensor


def _accumulate(server: ServerProcess, protocol: str, cid: int | str, values: list[float]) -> list:
    """Send one sequence in order; return (SUM, MEAN, CORRID) per request."""
    client = _client(server, protocol)
    rng = random.Random(str(cid))
    out = []
    try:
        for i, v in enumerate(values):
            time.sleep(rng.random() * 0.01)
            result = client.infer(
                "accumulator",
                [_input(protocol, "INPUT", v, "FP32")],
                sequence_id=cid,
                sequence_start=i == 0,
                sequence_end=i == len(values) - 1,
            )
            assert result.as_numpy("ACC_STATE_OUT") is None  # the state stays in the server
            out.append(
                (
                    float(result.as_numpy("SUM")[0, 0]),
                    float(result.as_numpy("MEAN")[0, 0]),
                    result.as_numpy("CORRID")[0, 0],
                )
            )
    finally:
        client.close()
    return out


def test_many_interleaved_sequences_over_http_and_grpc(server: ServerProcess) -> None:
    """32 sequences at once (half HTTP, half gRPC; integer and string ids): each gets
    its own running sum and mean, in order, with its own id echoed."""
    rng = random.Random(15)
    seqs: list[tuple[str, int | str, list[float]]] = []
    for i in range(32):
        cid: int | str = 1000 + i if i % 2 else f"sensor-{i}"
        protocol = "http" if i % 4 < 2 else "grpc"
        seqs.append((protocol, cid, [float(rng.randint(-5, 9)) for _ in range(rng.randint(3, 8))]))
    stats_before = _model_stats(server, "accumulator")
    with ThreadPoolExecutor(len(seqs)) as pool:
        results = list(pool.map(lambda s: _accumulate(server, *s), seqs))
    for (_, cid, values), got in zip(seqs, results, strict=True):
        sums = np.cumsum(values)
        assert [g[0] for g in got] == list(sums), cid
        assert [g[1] for g in got] == pytest.approx(list(sums / np.arange(1, len(values) + 1)))
        assert {g[2] for g in got} == {str(cid).encode()}
    stats = _model_stats(server, "accumulator")
    sent = sum(len(v) for _, _, v in seqs)
    assert stats["inference_count"] - stats_before["inference_count"] == sent
    assert stats["inference_stats"]["success"]["count"] - stats_before["success"] == sent
    executions = stats["execution_count"] - stats_before["execution_count"]
    assert 0 < executions <= sent


def _model_stats(server: ServerProcess, model: str) -> dict[str, Any]:
    client = httpclient.InferenceServerClient(server.http_url)
    stats = client.get_inference_statistics(model)["model_stats"][0]
    stats["success"] = stats["inference_stats"]["success"]["count"]
    return stats


def _direct(server: ServerProcess, protocol: str, cid: int, values: list[int]) -> list[tuple]:
    client = _client(server, protocol)
    out = []
    try:
        for i, v in enumerate(values):
            result = client.infer(
                "seq_direct",
                [_input(protocol, "IN", v, "INT32")],
                sequence_id=cid,
                sequence_start=i == 0,
                sequence_end=i == len(values) - 1,
            )
            out.append(
                (
                    int(result.as_numpy("OUT")[0, 0]),
                    int(result.as_numpy("SLOT")[0, 0]),
                    int(result.as_numpy("CORRID")[0, 0]),
                )
            )
    finally:
        client.close()
    return out


def test_direct_strategy_keeps_each_sequence_in_its_slot(server: ServerProcess) -> None:
    """12 sequences over 4 slots (8 wait in the backlog); a sequence keeps one slot
    and gets its UINT64 id in CORRID (up to 2**64 - 2 over HTTP; tritonclient.grpc
    sends ids as int64_param, so at most 2**63 - 1 there). Odd ids go over gRPC."""
    ids = [2**64 - 2 - 2 * i for i in range(3)] + [2**63 - 1 - 2 * i for i in range(3)]
    ids += [7 + i for i in range(6)]
    rng = random.Random(3)
    values = {cid: [rng.randint(1, 50) for _ in range(rng.randint(2, 6))] for cid in ids}
    with ThreadPoolExecutor(len(ids)) as pool:
        results = list(
            pool.map(lambda c: _direct(server, "grpc" if c % 2 else "http", c, values[c]), ids)
        )
    for cid, got in zip(ids, results, strict=True):
        assert [g[0] for g in got] == list(np.cumsum(values[cid]))
        assert {g[2] for g in got} == {cid}
        assert len({g[1] for g in got}) == 1 and 0 <= got[0][1] < 4  # one slot per sequence


def _error(fn: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as err:
        fn()
    return err.value


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_request_without_start_is_refused(server: ServerProcess, protocol: str) -> None:
    client = _client(server, protocol)
    err = _error(
        lambda: client.infer("seq_direct", [_input(protocol, "IN", 1, "INT32")], sequence_id=4242)
    )
    assert err.status() == ("400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT")
    assert (
        "inference request for sequence 4242 to model 'seq_direct' must specify the START "
        "flag on the first request of the sequence" in err.message()
    )


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_request_without_correlation_id_is_refused(server: ServerProcess, protocol: str) -> None:
    client = _client(server, protocol)
    err = _error(
        lambda: client.infer(
            "accumulator", [_input(protocol, "INPUT", 1, "FP32")], sequence_start=True
        )
    )
    assert err.status() == ("400" if protocol == "http" else "StatusCode.INVALID_ARGUMENT")
    assert "must specify a non-zero or non-empty correlation ID" in err.message()


def test_string_id_for_numeric_corrid_is_refused(server: ServerProcess) -> None:
    client = _client(server, "grpc")
    err = _error(
        lambda: client.infer(
            "seq_direct",
            [_input("grpc", "IN", 1, "INT32")],
            sequence_id="abc",
            sequence_start=True,
        )
    )
    assert err.status() == "StatusCode.INVALID_ARGUMENT"
    assert "must be an unsigned integer, not a string" in err.message()


def test_unknown_after_end_and_reused_ids(server: ServerProcess) -> None:
    """After its END an id is unknown (refused without START); a START for an id in
    progress restarts the sequence (Triton: the previous one is terminated early)."""
    assert _accumulate(server, "http", 555, [2.0, 3.0])[-1][0] == 5.0
    client = _client(server, "http")
    err = _error(
        lambda: client.infer("accumulator", [_input("http", "INPUT", 1, "FP32")], sequence_id=555)
    )
    assert "must specify the START flag" in err.message()

    def send(v: float, **flags: Any) -> float:
        r = client.infer("accumulator", [_input("http", "INPUT", v, "FP32")], **flags)
        return float(r.as_numpy("SUM")[0, 0])

    assert send(4, sequence_id="re", sequence_start=True) == 4.0
    assert send(1, sequence_id="re") == 5.0
    assert send(10, sequence_id="re", sequence_start=True) == 10.0  # reused: starts again
    assert send(1, sequence_id="re", sequence_end=True) == 11.0
    assert "sequence re for model 'accumulator' has a conflict" in server.log()


def test_idle_sequence_is_released_and_its_next_request_refused(server: ServerProcess) -> None:
    """seq_direct's max_sequence_idle_microseconds is 1 s: after 2.5 s idle the
    sequence is gone; its next request gets a clear INVALID_ARG; others carry on."""
    client = _client(server, "grpc")

    def send(cid: int, v: int, **flags: Any) -> int:
        r = client.infer("seq_direct", [_input("grpc", "IN", v, "INT32")], sequence_id=cid, **flags)
        return int(r.as_numpy("OUT")[0, 0])

    assert send(9001, 5, sequence_start=True) == 5
    time.sleep(2.5)
    with pytest.raises(InferenceServerException) as err:
        send(9001, 1)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "sequence 9001" in err.value.message() and "idle" in err.value.message()
    assert "max_sequence_idle_microseconds = 1000000" in err.value.message()
    # the id can start again, and the server serves on
    assert send(9001, 7, sequence_start=True) == 7
    assert send(9001, 1, sequence_end=True) == 8
    assert client.is_server_live() and client.is_model_ready("seq_direct")


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_sequences_through_an_ensemble_and_bls(server: ServerProcess, protocol: str) -> None:
    """The sequence parameters reach a stateful ensemble step, and a BLS call made with
    ``correlation_id`` / ``flags`` (read from the model's own request)."""
    client = _client(server, protocol)
    mod = httpclient if protocol == "http" else grpcclient

    def send(model: str, name: str, out: str, v: float, shape: list[int], **flags: Any) -> float:
        tensor = mod.InferInput(name, shape, "FP32")
        tensor.set_data_from_numpy(np.full(shape, v, np.float32))
        return float(client.infer(model, [tensor], **flags).as_numpy(out).reshape(-1)[0])

    for model, name, out, shape in (
        ("ens_acc", "X", "TOTAL", [1, 1]),
        ("seq_bls", "INPUT", "SUM", [1, 1]),
    ):
        cid = f"{model}-{protocol}"
        assert send(model, name, out, 2, shape, sequence_id=cid, sequence_start=True) == 2
        assert send(model, name, out, 3, shape, sequence_id=cid) == 5
        assert send(model, name, out, 4, shape, sequence_id=cid, sequence_end=True) == 9
        with pytest.raises(InferenceServerException) as err:
            send(model, name, out, 1, shape, sequence_id=cid)
        assert "must specify the START flag" in err.value.message()


def test_bad_requests_leave_the_sequence_and_server_running(server: ServerProcess) -> None:
    """Bad requests in the middle of a sequence are refused with 400 and change nothing:
    two rows, a control or state tensor sent by the client, sequence parameters of the
    wrong type (raw JSON); the sequence then carries on with its sum intact."""
    client = _client(server, "http")

    def send(v: float, **flags: Any) -> float:
        r = client.infer("accumulator", [_input("http", "INPUT", v, "FP32")], **flags)
        return float(r.as_numpy("SUM")[0, 0])

    assert send(3, sequence_id=777, sequence_start=True) == 3.0
    two = httpclient.InferInput("INPUT", [2, 1], "FP32")
    two.set_data_from_numpy(np.ones((2, 1), np.float32))
    err = _error(lambda: client.infer("accumulator", [two], sequence_id=777))
    assert err.status() == "400" and "must specify batch-size 1" in err.message()
    for name, dt in (("START", "INT32"), ("ACC_STATE", "FP32")):
        extra = httpclient.InferInput(name, [1, 1], dt)
        extra.set_data_from_numpy(np.ones((1, 1), np.float32 if dt == "FP32" else np.int32))
        err = _error(
            lambda extra=extra: client.infer(
                "accumulator", [_input("http", "INPUT", 1, "FP32"), extra], sequence_id=777
            )
        )
        assert err.status() == "400" and f"unexpected inference input '{name}'" in err.message()
    url = f"http://{server.http_url}/v2/models/accumulator/infer"
    for params, words in (
        ({"sequence_id": 1.5}, "'sequence_id' must be a non-negative integer or a string"),
        ({"sequence_id": -3}, "'sequence_id' must be a non-negative integer or a string"),
        ({"sequence_id": 777, "sequence_start": "yes"}, "'sequence_start' must be true or false"),
    ):
        body = {
            "inputs": [{"name": "INPUT", "shape": [1, 1], "datatype": "FP32", "data": [1]}],
            "parameters": params,
        }
        req = urllib.request.Request(
            url, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as http_err:
            urllib.request.urlopen(req, timeout=30)
        assert http_err.value.code == 400
        assert words in json.loads(http_err.value.read())["error"]
    assert send(4, sequence_id=777, sequence_end=True) == 7.0
    assert client.is_server_live() and client.is_model_ready("accumulator")


def test_model_faults_fail_one_request_and_the_sequence_carries_on(server: ServerProcess) -> None:
    """A model error fails its request only; a worker that exits mid-sequence fails its
    batch, is restarted, and the sequence's later requests are still served (the model
    kept its sums in the dead process, so they start from zero there)."""
    client = _client(server, "grpc")

    def send(v: int, **flags: Any) -> int:
        r = client.infer("seq_direct", [_input("grpc", "IN", v, "INT32")], sequence_id=31, **flags)
        return int(r.as_numpy("OUT")[0, 0])

    assert send(5, sequence_start=True) == 5
    err = _error(lambda: send(-1))
    assert err.status() == "StatusCode.INTERNAL" and "-1 is not allowed" in err.message()
    assert send(2) == 7
    err = _error(lambda: send(-2))
    assert err.status() in ("StatusCode.INTERNAL", "StatusCode.UNAVAILABLE")
    deadline = time.monotonic() + 60
    while True:  # the worker restarts; until then requests fail with 503
        try:
            assert send(4) == 4
            break
        except InferenceServerException:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert send(1, sequence_end=True) == 5
    assert client.is_server_live() and client.is_model_ready("seq_direct")
