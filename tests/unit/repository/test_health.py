"""Health parameters of config.pbtxt: numbers of seconds, clear errors for bad ones."""

from __future__ import annotations

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from pdserve.config import ConfigError
from pdserve.repository.health import (
    DEFAULT_HANG_TIMEOUT_S,
    HealthBoard,
    _probe_interval,
    _seconds,
)


def _config(text: str) -> mc.ModelConfig:
    return text_format.Parse(text, mc.ModelConfig())


def test_seconds_parameter() -> None:
    cfg = _config('parameters { key: "instance_hang_timeout" value { string_value: "1.5" } }')
    assert _seconds(cfg, "instance_hang_timeout", 60.0, "m/config.pbtxt") == 1.5
    assert _seconds(cfg, "probe_interval", 0.0, "m/config.pbtxt") == 0.0


@pytest.mark.parametrize("value", ["soon", "-1", "nan", "inf", ""])
def test_bad_seconds_name_the_parameter(value: str) -> None:
    cfg = _config(
        f'parameters {{ key: "instance_hang_timeout" value {{ string_value: "{value}" }} }}'
    )
    with pytest.raises(ConfigError) as e:
        _seconds(cfg, "instance_hang_timeout", 60.0, "m/config.pbtxt")
    assert "parameters.instance_hang_timeout" in str(e.value)
    assert "number of seconds >= 0" in str(e.value)


def test_board_default() -> None:
    assert HealthBoard().hang_timeout_s == DEFAULT_HANG_TIMEOUT_S == 300.0
    assert list(HealthBoard(0).samples()) == []


@pytest.mark.parametrize(("value", "want"), [("0", 0.0), ("0.1", 0.1), ("10", 10.0)])
def test_probe_interval_is_off_or_at_least_the_floor(value: str, want: float) -> None:
    cfg = _config(f'parameters {{ key: "probe_interval" value {{ string_value: "{value}" }} }}')
    assert _probe_interval(cfg, "m/config.pbtxt") == want


def test_a_probe_interval_under_the_floor_fails_the_load() -> None:
    cfg = _config('parameters { key: "probe_interval" value { string_value: "1e-9" } }')
    with pytest.raises(ConfigError) as e:
        _probe_interval(cfg, "m/config.pbtxt")
    assert "parameters.probe_interval" in str(e.value)
    assert "at least 0.1 s, got 1e-09" in str(e.value)
