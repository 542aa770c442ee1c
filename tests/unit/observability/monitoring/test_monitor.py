"""pdserve.observability.monitoring.monitor: a version is monitored only when its
configuration asks, bad settings fail its attach with the reason, and the samples
follow what was observed (histogram, drift, divergence between versions)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.core.types import InferRequest
from pdserve.observability.monitoring.monitor import FOLD_EVERY, Monitor
from pdserve.observability.monitoring.spec import SpecError

CONFIG = """
name: "m"
input [ { name: "IN" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "OUT" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""


def _mv(version: str, **parameters: str) -> Any:
    cfg = model_config_pb2.ModelConfig()
    text_format.Parse(CONFIG, cfg)
    for k, v in parameters.items():
        cfg.parameters[k].string_value = v
    return SimpleNamespace(name="m", version_str=version, config=cfg)


def _values(samples: list[Any], name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s[3].items())): s[4] for s in samples if s[0] == name}


def test_nothing_asked_nothing_monitored(tmp_path: Path) -> None:
    assert Monitor().attach(_mv("1"), tmp_path) is None


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"prediction_metrics": "outputs=NOPE"}, "no numeric output named 'NOPE'"),
        ({"drift": "tensors=NOPE"}, "no numeric input or output named 'NOPE'"),
        ({"drift": "on"}, "monitoring_reference.npz not found"),
        ({"payload_log": "sink=jsonl:/x,rate=5"}, "rate must be in"),
    ],
)
def test_bad_settings_fail_the_attach(
    tmp_path: Path, parameters: dict[str, str], message: str
) -> None:
    with pytest.raises(SpecError, match=message):
        Monitor().attach(_mv("1", **parameters), tmp_path)


def test_distributions_drift_and_divergence(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "ref.npz", OUT=rng.uniform(0, 1, 4000))
    monitor = Monitor()
    params = {"prediction_metrics": "bins=0:2:4,range=0:1", "drift": "reference=ref.npz,window=400"}
    v1 = monitor.attach(_mv("1", **params), tmp_path)
    v2 = monitor.attach(_mv("2", **params), tmp_path)
    assert v1 is not None and v2 is not None
    for _ in range(200):
        x = rng.uniform(0, 1, (1, 4)).astype(np.float32)
        request = InferRequest("m", inputs={"IN": x})
        v1.observe(request, {"OUT": x}, None)
        if rng.random() < 0.5:
            v2.observe(request, {"OUT": x * 2}, None)
    samples = monitor.samples()
    buckets = _values(samples, "pdserve_prediction_value_bucket")
    assert buckets[(("le", "+Inf"), ("model", "m"), ("output", "OUT"), ("version", "1"))] == 800
    out = _values(samples, "pdserve_prediction_out_of_range_total")
    assert out[(("model", "m"), ("output", "OUT"), ("version", "1"))] == 0
    assert out[(("model", "m"), ("output", "OUT"), ("version", "2"))] > 150  # ~half of 400
    psi = _values(samples, "pdserve_drift_psi")
    assert psi[(("model", "m"), ("tensor", "OUT"), ("version", "1"))] < 0.1
    assert psi[(("model", "m"), ("tensor", "OUT"), ("version", "2"))] > 1.0
    div = _values(samples, "pdserve_version_divergence_psi")
    assert list(div) == [(("baseline", "1"), ("model", "m"), ("tensor", "OUT"), ("version", "2"))]
    assert list(div.values())[0] > 1.0


def test_first_n_reference_and_errors_observed(tmp_path: Path) -> None:
    monitor = Monitor()
    vm = monitor.attach(
        _mv(
            "1", drift="reference=first:100,window=100,bins=4", payload_log=f"sink=jsonl:{tmp_path}"
        ),
        tmp_path,
    )
    assert vm is not None
    x = np.arange(100, dtype=np.float32).reshape(25, 4)
    vm.observe(InferRequest("m", inputs={"IN": x}, id="a"), {"OUT": x}, None)  # the reference
    assert _values(monitor.samples(), "pdserve_drift_window_values") == {
        (("model", "m"), ("tensor", "OUT"), ("version", "1")): 0
    }
    vm.observe(InferRequest("m", inputs={"IN": x}, id="b"), {"OUT": x + 1000}, None)
    psi = _values(monitor.samples(), "pdserve_drift_psi")
    assert list(psi.values())[0] > 5
    vm.observe(InferRequest("m", inputs={"IN": x}, id="c"), None, ValueError("bad"))
    monitor.close()
    sampled = _values(monitor.samples(), "pdserve_payload_log_written_total")
    assert sampled == {(("model", "m"),): 3}


def test_held_responses_are_counted_exactly(tmp_path: Path) -> None:
    """Responses are counted in bulk (every FOLD_EVERY, and before a read): the
    histogram, NaN, out-of-range and class counts and the drift window (an input) hold
    exactly what one-by-one counting gives."""
    rng = np.random.default_rng(3)
    np.savez(tmp_path / "ref.npz", IN=rng.uniform(0, 1, 4000))
    monitor = Monitor()
    params = {
        "prediction_metrics": "outputs=OUT,bins=0:2:4,range=0:1",
        "drift": "tensors=IN,reference=ref.npz,window=1000",
    }
    vm = monitor.attach(_mv("1", **params), tmp_path)
    assert vm is not None
    outs, ins = [], []
    for i in range(FOLD_EVERY + 37):  # one fold on the way, the rest at the read
        x = rng.uniform(-0.5, 1.5, (1 + i % 3, 4)).astype(np.float32)
        if i % 50 == 0:
            x[0, 0] = np.nan
        y = rng.uniform(0, 1, (1, 4))
        vm.observe(InferRequest("m", inputs={"IN": y}), {"OUT": x}, None)
        outs.append(x.reshape(-1))
        ins.append(y.reshape(-1))
    samples = monitor.samples()
    values = np.concatenate(outs).astype(np.float64)
    finite = values[~np.isnan(values)]
    key = (("model", "m"), ("output", "OUT"), ("version", "1"))
    buckets = _values(samples, "pdserve_prediction_value_bucket")
    for le in (0.0, 0.5, 1.0, 1.5):
        assert buckets[(("le", repr(le)), *key)] == np.count_nonzero(finite <= le)
    assert buckets[(("le", "+Inf"), *key)] == len(finite)
    assert _values(samples, "pdserve_prediction_nan_total")[key] == np.isnan(values).sum()
    assert _values(samples, "pdserve_prediction_out_of_range_total")[key] == np.count_nonzero(
        (finite < 0) | (finite > 1)
    )
    assert _values(samples, "pdserve_prediction_value_sum")[key] == pytest.approx(finite.sum())
    window = np.concatenate(ins)[-1000:]
    assert sorted(vm.drift["IN"].window.values()) == sorted(window)
    drift_key = (("model", "m"), ("tensor", "IN"), ("version", "1"))
    assert _values(samples, "pdserve_drift_window_values")[drift_key] == 1000
