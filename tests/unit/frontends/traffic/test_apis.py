"""API categories by HTTP path / gRPC method, and Triton's restricted-API syntax (issue 12)."""

from __future__ import annotations

import pytest

from pdserve.frontends.traffic.apis import (
    RestrictedApiError,
    classify_grpc,
    classify_http,
    parse_restricted,
    restriction_met,
)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/v2/health/live", ("health", "")),
        ("/v2/health/ready", ("health", "")),
        ("/v2/models/m/ready", ("health", "m")),
        ("/v2/models/m/versions/3/ready", ("health", "m")),
        ("/v2", ("metadata", "")),
        ("/v2/openapi.json", ("metadata", "")),
        ("/v2/models/m", ("metadata", "m")),
        ("/v2/models/m/versions/2", ("metadata", "m")),
        ("/v2/models/m/infer", ("inference", "m")),
        ("/v2/models/m/versions/1/infer", ("inference", "m")),
        ("/v2/models/m/generate", ("inference", "m")),
        ("/v2/models/m/generate_stream", ("inference", "m")),
        ("/v2/models/m/config", ("model-config", "m")),
        ("/v2/models/m/stats", ("statistics", "m")),
        ("/v2/models/stats", ("statistics", "")),
        ("/v2/repository/index", ("model-repository", "")),
        ("/v2/repository/models/m/load", ("model-repository", "")),
        ("/v2/models/m/traffic", ("model-repository", "m")),
        ("/v2/models/m/rollout", ("model-repository", "m")),
        ("/v2/systemsharedmemory/status", ("shared-memory", "")),
        ("/v2/cudasharedmemory/region/r/register", ("shared-memory", "")),
        ("/v2/trace/setting", ("trace", "")),
        ("/v2/models/m/trace/setting", ("trace", "m")),
        ("/v2/logging", ("logging", "")),
        ("/metrics", ("model-repository", "")),
        ("/v2/somethingnew", ("model-repository", "")),
    ],
)
def test_http_paths_fall_into_tritons_categories(path: str, expected: tuple[str, str]) -> None:
    assert classify_http(path) == expected


@pytest.mark.parametrize(
    ("method", "category"),
    [
        ("ServerLive", "health"),
        ("/inference.GRPCInferenceService/ModelReady", "health"),
        ("ServerMetadata", "metadata"),
        ("ModelInfer", "inference"),
        ("ModelStreamInfer", "inference"),
        ("ModelConfig", "model-config"),
        ("ModelStatistics", "statistics"),
        ("RepositoryModelLoad", "model-repository"),
        ("SystemSharedMemoryRegister", "shared-memory"),
        ("CudaSharedMemoryStatus", "shared-memory"),
        ("TraceSetting", "trace"),
        ("LogSettings", "logging"),
        ("SomeFutureAdminRpc", "model-repository"),
    ],
)
def test_grpc_methods_fall_into_tritons_categories(method: str, category: str) -> None:
    assert classify_grpc(method) == category


def test_restricted_api_takes_tritons_syntax() -> None:
    table = parse_restricted(
        ["model-repository,statistics:admin-key=s3cret", "inference:infer-key=abc"], "--x"
    )
    assert set(table) == {"model-repository", "statistics", "inference"}
    admin = table["statistics"]
    assert (admin.key, admin.value) == ("admin-key", "s3cret")
    assert table["model-repository"] is admin
    assert restriction_met(admin, "s3cret")
    assert not restriction_met(admin, "s3cre")
    assert not restriction_met(admin, None)


@pytest.mark.parametrize(
    ("option", "match"),
    [
        ("inference", "expected <api-1>"),
        ("inference:key", "expected <api-1>"),
        ("inference:=v", "expected <api-1>"),
        (":k=v", "no API named"),
        ("inferences:k=v", "unknown API 'inferences'"),
    ],
)
def test_bad_restricted_api_options(option: str, match: str) -> None:
    with pytest.raises(RestrictedApiError, match=match):
        parse_restricted([option], "--http-restricted-api")


def test_an_api_in_two_groups_is_refused_as_triton_does() -> None:
    with pytest.raises(RestrictedApiError, match="more than one restricted group"):
        parse_restricted(["inference:a=1", "metadata,inference:b=2"], "--x")
