"""Unit tests: the composition root (pdserve.app.main) builds the core from Settings."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pdserve.app.build import StartError, build_server, import_feature
from pdserve.app.settings import Settings
from pdserve.cache import ResponseCache
from pdserve.server import InferenceServer


def test_server_is_configured_at_construction(tmp_path: Path) -> None:
    core = min(os.sched_getaffinity(0))
    settings = Settings(
        model_repository=tmp_path,
        strict_readiness=True,
        model_control_mode="explicit",
        load_models=("b", "a", "b"),
        cache_config=("local,size=4096",),
        host_policy={"cpu": {"cpu-cores": str(core)}},
    )
    server = build_server(settings)
    assert server.repository == tmp_path
    assert server.model_control_mode == "explicit"
    assert server.load_models == ["b", "a"]
    assert server.strict_readiness is True
    assert isinstance(server.response_cache, ResponseCache)
    assert server.response_cache.capacity_bytes == 4096
    assert server.manager.host_policies == {"cpu": frozenset({core})}
    assert not server.ready()  # nothing loaded yet


def test_max_instance_count_reaches_the_configuration_check(tmp_path: Path) -> None:
    """--max-instance-count is the limit every model load is validated against."""
    import asyncio

    from pdserve import config as cfgmod
    from pdserve.core.errors import InferError

    (tmp_path / "m" / "1").mkdir(parents=True)
    (tmp_path / "m" / "1" / "model.py").write_text("class TritonPythonModel: pass\n")
    (tmp_path / "m" / "config.pbtxt").write_text(
        'backend: "python"\ninstance_group [ { kind: KIND_CPU count: 3 } ]\n'
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    )
    try:
        server = build_server(Settings(model_repository=tmp_path, max_instance_count=2))
        assert cfgmod.max_instance_count() == 2
        with pytest.raises(InferError, match="count 3 is more than the limit of 2 instances"):
            asyncio.run(server.manager.load_model("m"))
    finally:
        cfgmod.set_max_instance_count(cfgmod.DEFAULT_MAX_INSTANCE_COUNT)


def test_defaults_build_a_server_without_cache(tmp_path: Path) -> None:
    server = build_server(Settings(model_repository=tmp_path, model_control_mode="poll"))
    assert server.model_control_mode == "poll"
    assert server.load_models is None and server.response_cache is None


def test_library_server_defaults_to_explicit_and_checks_the_mode(tmp_path: Path) -> None:
    assert InferenceServer(tmp_path).model_control_mode == "explicit"
    with pytest.raises(ValueError, match="model control mode must be one of none, poll, explicit"):
        InferenceServer(tmp_path, model_control_mode="sometimes")


def test_feature_import_failure_names_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pdserve.frontends.grpc.server", None)
    with pytest.raises(StartError) as e:
        import_feature("pdserve.frontends.grpc.server", "gRPC", "--no-allow-grpc")
    assert "gRPC is asked for but cannot be imported (pdserve.frontends.grpc.server:" in str(
        e.value
    )
    assert "start with --no-allow-grpc" in str(e.value)


def test_optional_features_follow_their_flags(tmp_path: Path) -> None:
    from pdserve.app.main import import_features

    off = import_features(
        Settings(model_repository=tmp_path, allow_grpc=False, allow_metrics=False)
    )
    assert off == (None, None, None)
    on = import_features(Settings(model_repository=tmp_path))
    assert on.grpc_server is not None and on.grpc_server.__name__ == "pdserve.frontends.grpc.server"
    assert on.metrics is not None and on.metrics_http is not None


def test_http_listen_error_names_the_address() -> None:
    from pdserve.app.start import http_listen_error

    settings = Settings(host="127.0.0.1", http_port=8123)
    assert str(http_listen_error(settings)) == "could not listen for HTTP on 127.0.0.1:8123"
    assert str(http_listen_error(settings, "Address already in use")) == (
        "could not listen for HTTP on 127.0.0.1:8123: Address already in use"
    )


def test_serve_logging_follows_the_log_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.app.logging_setup import setup_serve_logging
    from pdserve.observability import logs

    states: list[logs.LogState] = []
    monkeypatch.setattr(
        logs, "configure", lambda state, stream=None, log_file="": states.append(state)
    )
    setup_serve_logging(
        Settings(model_repository=tmp_path, log_verbose=1, log_info=False, log_format="json")
    )
    assert states == [
        logs.LogState(
            log_info=False,
            log_warning=True,
            log_error=True,
            log_verbose_level=1,
            log_format="json",
        )
    ]
