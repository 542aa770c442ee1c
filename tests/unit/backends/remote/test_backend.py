"""The remote backend's parts that need no second server: parameters, the config
check against the target, retries / fail-fast of a target, and its metrics.

Calls to a real target (two pdserve processes) are in tests/integration/test_remote.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tritonclient.grpc import model_config_pb2 as mc

from pdserve import config as cfgmod
from pdserve.backends import registry
from pdserve.backends.remote import stats as stats_mod
from pdserve.backends.remote.backend import (
    RemoteTarget,
    check_against_remote,
    config_from_metadata,
    parse_params,
)
from pdserve.backends.remote.client import Endpoint, HttpClient, RemoteClient, RemoteError
from pdserve.core.errors import ErrorCode, InferError
from pdserve.observability.metrics import remote_families


def _cfg(text: str) -> mc.ModelConfig:
    from google.protobuf import text_format

    return text_format.Parse(text, mc.ModelConfig())


REMOTE = _cfg(
    """
    name: "effnet" max_batch_size: 32
    input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]
    output [ { name: "logits" data_type: TYPE_FP32 dims: [ 1000 ] label_filename: "labels.txt" } ]
    """
)


def _local(extra: str = "") -> mc.ModelConfig:
    return _cfg(
        'name: "m" backend: "remote" '
        'parameters { key: "url" value { string_value: "127.0.0.1:8001" } } ' + extra
    )


def test_registry_serves_remote() -> None:
    assert "remote" in registry.served_backends()
    assert registry.unavailable_reason("remote") is None


def test_normalize_platform_accepts_remote_without_model_file() -> None:
    cfg = _local()
    cfgmod.normalize_platform(cfg, "m/config.pbtxt", backends=registry.unavailable_reason)
    assert cfg.backend == "remote"
    assert cfg.platform == "" and cfg.default_model_filename == ""


def test_params_defaults_and_scheme() -> None:
    p = parse_params(_local(), "m/config.pbtxt")
    assert (p.address, p.protocol, p.model_name, p.model_version) == (
        "127.0.0.1:8001",
        "grpc",
        "m",
        "",
    )
    assert (p.timeout_s, p.connect_timeout_s, p.retries, p.pool_size) == (30.0, 1.0, 2, 4)
    assert p.health_interval_s == 1.0 and p.target == "grpc://127.0.0.1:8001"
    cfg = _cfg(
        'name: "m" parameters { key: "url" value { string_value: "http://h:9/" } } '
        'parameters { key: "model_name" value { string_value: "other" } } '
        'parameters { key: "timeout_ms" value { string_value: "250" } } '
        'parameters { key: "retries" value { string_value: "0" } }'
    )
    p = parse_params(cfg, "m/config.pbtxt")
    assert (p.address, p.protocol, p.model_name, p.timeout_s, p.retries) == (
        "h:9",
        "http",
        "other",
        0.25,
        0,
    )


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        ("", "parameters.url", "needs the target's address"),
        (
            'parameters { key: "url" value { string_value: "nohost" } }',
            "parameters.url",
            "host:port",
        ),
        (
            'parameters { key: "url" value { string_value: "h:1" } } '
            'parameters { key: "protocol" value { string_value: "ws" } }',
            "parameters.protocol",
            "not one of grpc, http",
        ),
        (
            'parameters { key: "url" value { string_value: "h:1" } } '
            'parameters { key: "timeout_ms" value { string_value: "soon" } }',
            "parameters.timeout_ms",
            "not a number",
        ),
        (
            'parameters { key: "url" value { string_value: "grpc://h:1" } } '
            'parameters { key: "protocol" value { string_value: "http" } }',
            "parameters.protocol",
            "disagrees",
        ),
    ],
)
def test_params_errors_name_the_field(extra: str, field: str, words: str) -> None:
    with pytest.raises(cfgmod.ConfigError) as info:
        parse_params(_cfg('name: "m" ' + extra), "m/config.pbtxt")
    assert info.value.field == field and words in info.value.message


def test_auto_complete_from_target() -> None:
    local = _local()
    check_against_remote(local, REMOTE, "m/config.pbtxt", "grpc://h:1")
    assert local.max_batch_size == 32
    assert [i.name for i in local.input] == ["input"] and list(local.input[0].dims) == [3, 224, 224]
    assert [o.name for o in local.output] == ["logits"]
    assert local.output[0].label_filename == ""  # the target's file is not here


@pytest.mark.parametrize(
    ("extra", "field", "words"),
    [
        (
            'max_batch_size: 32 input [ { name: "input" data_type: TYPE_FP16 dims: [ 3, 224, 224 ] } ]',
            "input[0].data_type",
            "FP16 here but FP32",
        ),
        (
            'max_batch_size: 32 input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 224, 225 ] } ]',
            "input[0].dims",
            "[3, 224, 225] here but [3, 224, 224]",
        ),
        (
            'max_batch_size: 64 input [ { name: "input" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]',
            "max_batch_size",
            "max_batch_size is 32",
        ),
        (
            'max_batch_size: 8 input [ { name: "image" data_type: TYPE_FP32 dims: [ 3, 224, 224 ] } ]',
            "input[0].name",
            "'image' is not one of",
        ),
    ],
)
def test_mismatch_is_a_config_error_naming_the_field(extra: str, field: str, words: str) -> None:
    with pytest.raises(cfgmod.ConfigError) as info:
        check_against_remote(_local(extra), REMOTE, "m/config.pbtxt", "grpc://h:1")
    assert info.value.field == field, info.value
    assert words in info.value.message, info.value.message


def test_a_required_target_input_must_be_configured() -> None:
    remote = _cfg(
        'max_batch_size: 8 input [ { name: "a" data_type: TYPE_FP32 dims: [ 1 ] }, '
        '{ name: "b" data_type: TYPE_FP32 dims: [ 1 ] } ]'
    )
    local = _local('max_batch_size: 8 input [ { name: "a" data_type: TYPE_FP32 dims: [ 1 ] } ]')
    with pytest.raises(cfgmod.ConfigError) as info:
        check_against_remote(local, remote, "m/config.pbtxt", "grpc://h:1")
    assert info.value.field == "input" and "requires input 'b'" in info.value.message


def test_smaller_batches_and_wildcard_target_dims_are_accepted() -> None:
    remote = _cfg(
        'max_batch_size: 32 input [ { name: "x" data_type: TYPE_INT64 dims: [ -1 ] } ] '
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ -1, 4 ] } ]'
    )
    local = _local(
        'max_batch_size: 8 input [ { name: "x" data_type: TYPE_INT64 dims: [ 16 ] } ] '
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 16, 4 ] } ]'
    )
    check_against_remote(local, remote, "m/config.pbtxt", "grpc://h:1")
    assert local.max_batch_size == 8


def test_config_from_metadata_drops_the_batch_dim() -> None:
    meta = {
        "name": "effnet",
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 224, 224]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 1000]}],
    }
    cfg = config_from_metadata(meta, _local("max_batch_size: 16"))
    assert cfg.max_batch_size == 16
    assert list(cfg.input[0].dims) == [3, 224, 224] and cfg.input[0].data_type == mc.TYPE_FP32
    assert list(cfg.output[0].dims) == [1000]


def test_http_binary_answer_is_decoded() -> None:
    client = HttpClient(Endpoint("127.0.0.1:1", "http", "m"))
    logits = np.arange(6, dtype=np.float32).reshape(2, 3)
    words = b"\x02\x00\x00\x00hi\x03\x00\x00\x00you"
    head = (
        b'{"outputs":[{"name":"logits","datatype":"FP32","shape":[2,3],'
        b'"parameters":{"binary_data_size":24}},{"name":"w","datatype":"BYTES","shape":[2],'
        b'"parameters":{"binary_data_size":13}},{"name":"j","datatype":"INT32","shape":[2],'
        b'"data":[7,8]}]}'
    )
    out = client._decode(head + logits.tobytes() + words, str(len(head)))
    np.testing.assert_array_equal(out["logits"], logits)
    assert list(out["w"]) == [b"hi", b"you"]
    np.testing.assert_array_equal(out["j"], np.array([7, 8], dtype=np.int32))


class ScriptedClient(RemoteClient):
    """A client whose calls fail with the scripted errors first, then echo ``x + 1``."""

    def __init__(self, failures: list[RemoteError], ready: bool = True) -> None:
        super().__init__(Endpoint("127.0.0.1:1", "grpc", "m"))
        self.failures = list(failures)
        self.calls = 0
        self.is_ready = ready

    async def ready(self, timeout_s: float) -> tuple[bool, str]:
        return self.is_ready, "" if self.is_ready else "scripted: not ready"

    async def config(self, timeout_s: float) -> Any:
        return None

    async def metadata(self, timeout_s: float) -> dict[str, Any]:
        return {}

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        request_id: str,
        timeout_s: float,
        traceparent: str = "",
    ) -> dict[str, np.ndarray]:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return {"y": inputs["x"] + 1}

    async def close(self) -> None:
        pass


def _refused(answered: bool) -> RemoteError:
    return RemoteError(
        "refused", ErrorCode.UNAVAILABLE, answered=answered, retryable=True, status="UNAVAILABLE"
    )


def _target(client: ScriptedClient, extra: str = "", model: str = "m") -> RemoteTarget:
    cfg = _local(
        'parameters { key: "retry_backoff_ms" value { string_value: "1" } } '
        'parameters { key: "health_interval_ms" value { string_value: "20" } } ' + extra
    )
    return RemoteTarget(parse_params(cfg, "m/config.pbtxt"), model, client)


def test_unavailable_answers_are_retried_and_counted() -> None:
    stats_mod.TARGETS.clear()

    async def run() -> np.ndarray:
        t = _target(ScriptedClient([_refused(True), _refused(True)]), model="retry")
        out = await t.infer({"x": np.array([1.0])}, ["y"], "")
        assert t.client.calls == 3  # type: ignore[attr-defined]  # ScriptedClient
        return out["y"]

    np.testing.assert_array_equal(asyncio.run(run()), [2.0])
    st = stats_mod.TARGETS[("grpc://127.0.0.1:8001", "retry")]
    assert (st.requests, st.retries, st.errors) == (3, 2, {"UNAVAILABLE": 2})
    assert sum(st.bucket_counts) == 3 and st.up
    text = "".join(f.render() for f in remote_families())
    labels = 'target="grpc://127.0.0.1:8001",model="retry"'
    assert f"pdserve_remote_retries_total{{{labels}}} 2" in text
    assert f'pdserve_remote_errors_total{{{labels},code="UNAVAILABLE"}} 2' in text
    assert f"pdserve_remote_request_duration_seconds_count{{{labels}}} 3" in text
    assert f"pdserve_remote_up{{{labels}}} 1" in text


def test_invalid_argument_keeps_its_code_and_is_not_retried() -> None:
    bad = RemoteError("bad shape", ErrorCode.INVALID_ARG, answered=True, retryable=False)

    async def run() -> None:
        t = _target(ScriptedClient([bad]), model="bad")
        with pytest.raises(InferError) as info:
            await t.infer({"x": np.array([1.0])}, ["y"], "")
        assert info.value.code is ErrorCode.INVALID_ARG and "bad shape" in info.value.message
        assert t.client.calls == 1  # type: ignore[attr-defined]  # ScriptedClient

    asyncio.run(run())


def test_refused_connection_marks_down_fails_fast_and_probe_recovers() -> None:
    async def run() -> None:
        client = ScriptedClient(
            [_refused(False)] * 3, ready=False
        )  # retries=2: all three attempts refused
        t = _target(client, model="down")
        t.start()
        with pytest.raises(InferError) as info:
            await t.infer({"x": np.array([1.0])}, ["y"], "")
        assert info.value.code is ErrorCode.UNAVAILABLE and not t.up
        calls = client.calls
        with pytest.raises(InferError) as info:  # fails fast: the target is not called
            await t.infer({"x": np.array([1.0])}, ["y"], "")
        assert client.calls == calls and "is not ready" in info.value.message
        client.is_ready = True
        for _ in range(100):
            if t.up:
                break
            await asyncio.sleep(0.01)
        assert t.up
        out = await t.infer({"x": np.array([1.0])}, ["y"], "")
        np.testing.assert_array_equal(out["y"], [2.0])
        t.acquire()
        await t.release()
        assert not t.stats.up

    asyncio.run(run())


def test_pdserve_check_checks_a_remote_model_without_calling_its_target(tmp_path: Path) -> None:
    from pdserve.app.check import check_repository

    url = 'parameters { key: "url" value { string_value: "127.0.0.1:1" } }\n'  # nothing there
    for name, io in (
        ("full", 'input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'
         'output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] } ]\n'),
        ("bare", ""),
    ):  # fmt: skip
        (tmp_path / name / "1").mkdir(parents=True)
        (tmp_path / name / "config.pbtxt").write_text(
            f'name: "{name}" backend: "remote" max_batch_size: 8\n{io}{url}'
        )
    report = check_repository(tmp_path)
    problems = [(p.model, p.field, p.message) for p in report.problems]
    assert [(m, f) for m, f, _ in problems] == [("bare", "input")], problems
    assert "does not call" in problems[0][2]
