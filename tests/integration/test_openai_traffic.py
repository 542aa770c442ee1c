"""The OpenAI routes under the same traffic handling as the V2 routes, against one real
pdserve: a key's rate limit (an OpenAI-shaped 429 with ``Retry-After``), the traffic
split of the model a request's body names (``traffic.yaml`` over two versions of the
example generator, and the pinning header), an OpenTelemetry trace of an OpenAI request
under the client's ``traceparent``, the Prometheus metrics that count it, and the body
limits (413, gzip bodies)."""

from __future__ import annotations

import gzip
import re
import shutil
from collections.abc import Iterator

import httpx2 as httpx
import openai
import pytest

from tests.conftest import ROOT, ServerProcess, start_server
from tests.integration.test_tracing import Receiver, trace_flags
from tests.traffic_keys import sha256_hash

KEY = "openai-traffic-app-0c41"
#: A key limited to 2 inference requests a minute.
LIMITED = "openai-traffic-limited-93d2"
GENERATOR = ROOT / "examples" / "generator_repository" / "text_generator"
TRACE = "5cf92f3577b34da6a3ce929d0e0e47aa"
TRACEPARENT = f"00-{TRACE}-00f067aa0ba902b7-01"
MAX_BODY = 4096


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, receiver: Receiver) -> Iterator[ServerProcess]:
    """``text_generator`` with versions 1 and 2, all of its traffic split to 2."""
    base = tmp_path_factory.mktemp("openai_traffic")
    model = base / "models" / "text_generator"
    shutil.copytree(GENERATOR, model)
    shutil.copytree(model / "1", model / "2")
    config = model / "config.pbtxt"
    config.write_text(config.read_text() + "version_policy: { all: {} }\n")
    (model / "traffic.yaml").write_text("weights: {1: 0, 2: 100}\n")
    auth = base / "auth.yaml"
    auth.write_text(
        f"keys:\n  - name: app\n    hash: {sha256_hash(KEY)}\n    apis: ['*']\n"
        f"  - name: limited\n    hash: {sha256_hash(LIMITED)}\n    apis: ['*']\n"
        "    rate_limit: 2/minute\n"
    )
    proc = start_server(
        base / "models",
        base / "pdserve.log",
        "--auth-config",
        str(auth),
        f"--max-request-bytes={MAX_BODY}",
        *trace_flags(receiver.url),
    )
    yield proc
    proc.stop()


def _post(server: ServerProcess, doc: dict, key: str = KEY, **headers: str) -> httpx.Response:
    return httpx.post(
        f"http://{server.http_url}/v1/completions",
        json=doc,
        headers={"authorization": f"Bearer {key}", **headers},
        timeout=60,
    )


def _metric(server: ServerProcess, name: str, **labels: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if match and all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def _successes_by_version(server: ServerProcess) -> dict[str, int]:
    r = httpx.get(
        f"http://{server.http_url}/v2/models/text_generator/stats",
        headers={"authorization": f"Bearer {KEY}"},
        timeout=30,
    )
    return {
        s["version"]: int(s["inference_stats"]["success"]["count"]) for s in r.json()["model_stats"]
    }


def test_the_split_applies_to_the_model_the_body_names(server: ServerProcess) -> None:
    before = _successes_by_version(server)
    client = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key=KEY, max_retries=0)
    for _ in range(3):
        assert client.completions.create(model="text_generator", prompt="a b").choices[0].text
    pinned = _post(
        server, {"model": "text_generator", "prompt": "x"}, **{"x-pdserve-model-version": "1"}
    )
    assert pinned.status_code == 200 and pinned.json()["choices"][0]["text"] == "x"
    after = _successes_by_version(server)
    assert after["2"] - before.get("2", 0) == 3 and after["1"] - before.get("1", 0) == 1
    # with auth on, a request without a route key is sticky by its key's name
    assert (
        _metric(
            server,
            "pdserve_traffic_requests_total",
            model="text_generator",
            version="2",
            route="sticky",
        )
        >= 3
    )
    assert (
        _metric(
            server,
            "pdserve_traffic_requests_total",
            model="text_generator",
            version="1",
            route="pinned",
        )
        >= 1
    )


def test_request_metrics_count_openai_requests(server: ServerProcess) -> None:
    labels = {"model": "text_generator", "version": "2"}
    ok = _metric(server, "nv_inference_request_success", **labels)
    failed = _metric(server, "nv_inference_request_failure", **labels)
    stream = _post(server, {"model": "text_generator", "prompt": "one two", "stream": True})
    assert stream.status_code == 200 and stream.text.endswith("data: [DONE]\n\n")
    assert _post(server, {"model": "text_generator", "prompt": "three"}).status_code == 200
    assert _metric(server, "nv_inference_request_success", **labels) == ok + 2
    assert _metric(server, "nv_inference_request_failure", **labels) == failed


def test_an_openai_request_is_traced_under_the_clients_traceparent(
    server: ServerProcess, receiver: Receiver
) -> None:
    r = _post(server, {"model": "text_generator", "prompt": "traced"}, traceparent=TRACEPARENT)
    assert r.status_code == 200
    spans = receiver.wait_for(lambda spans: any(s.trace_id == TRACE for s in spans))
    mine = [s for s in spans if s.trace_id == TRACE]
    models = [s for s in mine if s.attrs.get("triton.model_name") == "text_generator"]
    assert models, mine
    assert models[0].attrs.get("triton.model_version") in ("2", 2)


def test_a_keys_rate_limit_is_an_openai_429(server: ServerProcess) -> None:
    limited = openai.OpenAI(base_url=f"http://{server.http_url}/v1", api_key=LIMITED, max_retries=0)
    for _ in range(2):
        limited.completions.create(model="text_generator", prompt="a")
    r = _post(server, {"model": "text_generator", "prompt": "a"}, key=LIMITED)
    assert r.status_code == 429, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == (
        "rate_limit_exceeded",
        "rate_limit_exceeded",
        None,
    )
    assert int(r.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):
        limited.completions.create(model="text_generator", prompt="a")
    assert _metric(server, "pdserve_rate_limited_total", scope="key", key="limited") >= 2
    # the other key is not limited by it
    assert _post(server, {"model": "text_generator", "prompt": "a"}).status_code == 200


def test_body_limits_and_compression_as_v2(server: ServerProcess) -> None:
    big = {"model": "text_generator", "prompt": "w " * MAX_BODY}
    r = _post(server, big)
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    body = gzip.compress(b'{"model": "text_generator", "prompt": "zipped body"}')
    r = httpx.post(
        f"http://{server.http_url}/v1/completions",
        content=body,
        headers={
            "authorization": f"Bearer {KEY}",
            "content-type": "application/json",
            "content-encoding": "gzip",
        },
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "body zipped"
    r = httpx.post(
        f"http://{server.http_url}/v1/completions",
        content=b"{not json",
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
