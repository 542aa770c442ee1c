"""pdserve.observability.monitoring.spec: the payload_log / prediction_metrics / drift
settings parse to what they say, and malformed ones fail with the key named."""

from __future__ import annotations

import pytest

import pdserve.observability.monitoring  # noqa: F401 - the package docstring module
from pdserve.observability.monitoring.spec import (
    DEFAULT_BINS,
    DriftSpec,
    LogSpec,
    MetricsSpec,
    SinkSpec,
    SpecError,
    parse_parameters,
)


def test_log_spec_fields() -> None:
    s = LogSpec.parse(
        "sink=parquet:s3://b/p,rate=0.25,record=outputs,status=error,versions=1|3,"
        "parameter=tenant:a,queue=50,roll_mb=0.5,roll_secs=2"
    )
    assert s is not None
    assert s.sink == SinkSpec("file", "s3://b/p", "parquet")
    assert (s.rate, s.record, s.status) == (0.25, "outputs", "error")
    assert s.versions == frozenset({"1", "3"})
    assert s.parameter == ("tenant", "a")
    assert (s.queue, s.roll_bytes, s.roll_secs) == (50, 512 * 1024, 2.0)


def test_kafka_sink_and_off() -> None:
    s = LogSpec.parse("sink=kafka://127.0.0.1:9092|h2:9092/payloads")
    assert s is not None and s.sink == SinkSpec("kafka", "127.0.0.1:9092,h2:9092", "", "payloads")
    assert LogSpec.parse("off") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rate=0.5", "sink=... is required"),
        ("sink=csv:/x", "sink must be jsonl:PATH"),
        ("sink=kafka://host", "kafka://HOST:PORT/TOPIC"),
        ("sink=jsonl:/x,rate=2", "rate must be in (0, 1]"),
        ("sink=jsonl:/x,record=everything", "record must be one of"),
        ("sink=jsonl:/x,colour=red", "bad setting 'colour=red'"),
        ("sink=jsonl:/x,queue=0", "queue must be >= 1"),
        ("sink=jsonl:/x,parameter=novalue", "parameter must be NAME:VALUE"),
        ("sink=jsonl:/x,queue_mb=-1", "queue_mb must be a number > 0, got -1"),
        ("sink=jsonl:/x,queue_mb=nan", "queue_mb must be a number > 0, got nan"),
        ("sink=jsonl:/x,roll_mb=inf", "roll_mb must be a number > 0, got inf"),
        ("sink=jsonl:/x,roll_secs=nan", "roll_secs must be > 0, got nan"),
    ],
)
def test_log_spec_errors(text: str, message: str) -> None:
    with pytest.raises(SpecError, match="payload_log") as e:
        LogSpec.parse(text)
    assert message in str(e.value)


def test_metrics_spec() -> None:
    m = MetricsSpec.parse("outputs=A|B,bins=0:1:4,range=0:0.5,classification=C,max_classes=3")
    assert m is not None
    assert m.outputs == ("A", "B") and m.classification == ("C",)
    assert m.bins == (0.0, 0.25, 0.5, 0.75, 1.0)
    assert m.range == (0.0, 0.5) and m.max_classes == 3
    on = MetricsSpec.parse("on")
    assert on is not None and on.bins == DEFAULT_BINS and list(on.bins) == sorted(on.bins)
    ranged = MetricsSpec.parse("range=0:10")
    assert ranged is not None and ranged.bins[0] == 0 and ranged.bins[-1] == 10
    with pytest.raises(SpecError, match="LOW < HIGH"):
        MetricsSpec.parse("range=3:1")


def test_drift_spec() -> None:
    d = DriftSpec.parse("tensors=OUT|IN,reference=first:500,window=1000,bins=5,threshold=0.1")
    assert d is not None
    assert (d.tensors, d.first_n, d.window, d.bins, d.threshold) == (
        ("OUT", "IN"),
        500,
        1000,
        5,
        0.1,
    )
    assert DriftSpec.parse("on") == DriftSpec()
    with pytest.raises(SpecError, match="beside config.pbtxt"):
        DriftSpec.parse("reference=../elsewhere.npz")
    with pytest.raises(SpecError, match="N >= 5 \\* bins"):
        DriftSpec.parse("reference=first:10")


def test_parse_parameters_default_log() -> None:
    m = parse_parameters({}, "sink=jsonl:/logs")
    assert m.log is not None and m.active and m.metrics is None
    assert not parse_parameters({"payload_log": "off"}, "sink=jsonl:/logs").active
    assert parse_parameters({"drift": "on"}).drift == DriftSpec()
