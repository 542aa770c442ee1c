"""Unit tests: ``pdserve perf`` options (pdserve.app.perf.options) and its CLI flags."""

from __future__ import annotations

import pytest

from pdserve.app import cli
from pdserve.app.perf.cli import options_from_args
from pdserve.app.perf.options import (
    MAX_LEVELS,
    PerfError,
    PerfOptions,
    parse_concurrency_range,
    parse_rate_range,
    parse_shape,
)


@pytest.mark.parametrize(
    ("text", "levels"),
    [
        ("4", [4]),
        ("1:4", [1, 2, 3, 4]),
        ("1:8:4", [1, 5]),
        ("1:64:2", list(range(1, 64, 2))),
        ("2:10:4", [2, 6, 10]),
        (" 3:3 ", [3]),
    ],
)
def test_concurrency_range(text: str, levels: list[int]) -> None:
    assert parse_concurrency_range(text) == levels


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("0", "at least 1"),
        ("4:2", "below the start"),
        ("1:4:0", "step must be at least 1"),
        ("a:4", "integers"),
        ("1.5", "integers"),
        ("1:2:3:4", "start[:end[:step]]"),
        ("1::2", "start[:end[:step]]"),
        ("", "start[:end[:step]]"),
        (f"1:{MAX_LEVELS + 1}", "at most"),
    ],
)
def test_concurrency_range_errors(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why.replace("[", r"\[").replace("]", r"\]")):
        parse_concurrency_range(text)


@pytest.mark.parametrize(
    ("text", "rates"),
    [
        ("100", [100.0]),
        ("100:400:100", [100.0, 200.0, 300.0, 400.0]),
        ("0.5:1.5:0.5", [0.5, 1.0, 1.5]),
        ("0.1:0.3:0.1", [0.1, 0.2, 0.3]),  # the end is reached despite float steps
        ("10:25:10", [10.0, 20.0]),
        ("10:11", [10.0, 11.0]),
    ],
)
def test_rate_range(text: str, rates: list[float]) -> None:
    assert parse_rate_range(text) == pytest.approx(rates)


@pytest.mark.parametrize("text", ["0", "-5", "10:5", "1:10:0", "x", "1:nan", "1:inf"])
def test_rate_range_errors(text: str) -> None:
    with pytest.raises(ValueError):
        parse_rate_range(text)


def test_shape() -> None:
    assert parse_shape("INPUT0:3,224,224") == ("INPUT0", [3, 224, 224])
    assert parse_shape("a:b:1") == ("a:b", [1])  # the dims follow the last ':'
    assert parse_shape("SCALAR:") == ("SCALAR", [])
    for bad in ("INPUT0", ":1,2", "X:1,a", "X:-1"):
        with pytest.raises(ValueError):
            parse_shape(bad)


def _parse(*argv: str) -> PerfOptions:
    parser = cli.build_parser()
    args = parser.parse_args(["perf", *argv])
    sub = parser._subparsers._group_actions[0].choices["perf"]  # type: ignore[union-attr]
    return options_from_args(args, sub)


def test_flags_follow_perf_analyzer() -> None:
    o = _parse(
        "-m", "tiny", "-u", "h:1", "-i", "grpc", "-b", "4", "-x", "2",
        "--concurrency-range", "1:8:2", "-p", "1500", "-s", "5", "-r", "7",
        "--percentile", "95", "--shape", "IN:3,4", "--input-data", "zero",
        "-l", "20",
    )  # fmt: skip
    assert (o.model, o.url, o.protocol, o.batch_size, o.model_version) == (
        "tiny",
        "h:1",
        "grpc",
        4,
        "2",
    )
    assert o.concurrency == [1, 3, 5, 7]
    assert (o.measurement_interval_ms, o.stability_percentage, o.max_trials) == (1500, 5.0, 7)
    assert o.percentile == 95 and o.shapes == {"IN": [3, 4]} and o.input_data == "zero"
    assert o.latency_threshold_ms == 20.0
    assert o.levels() == ("concurrency", [1.0, 3.0, 5.0, 7.0])


def test_defaults_are_perf_analyzers() -> None:
    o = _parse("-m", "tiny")
    assert o.levels() == ("concurrency", [1.0])
    assert o.resolved_url() == "localhost:8000"
    assert (o.measurement_interval_ms, o.stability_percentage, o.max_trials) == (5000, 10.0, 10)
    assert (o.input_format, o.output_format, o.input_data, o.batch_size) == (
        "binary",
        "binary",
        "random",
        1,
    )
    assert _parse("-m", "tiny", "-i", "grpc").resolved_url() == "localhost:8001"


def test_rate_flags() -> None:
    o = _parse("-m", "t", "--request-rate-range", "50:150:50", "--request-distribution", "poisson")
    assert o.levels() == ("request_rate", [50.0, 100.0, 150.0])
    assert o.distribution == "poisson"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--concurrency-range", "4:1"], "--concurrency-range: '4:1': the end"),
        (["--request-rate-range", "0"], "--request-rate-range"),
        (["--concurrency-range", "1", "--request-rate-range", "5"], "not both"),
        (["--shape", "IN"], "--shape"),
        (["-b", "0"], "batch size"),
        (["-p", "5"], "measurement interval"),
        (["--percentile", "100"], "percentile"),
        (["-i", "grpc", "-u", "http://h:1"], "gRPC address"),
    ],
)
def test_bad_flags_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        _parse("-m", "tiny", *argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_validate_in_python() -> None:
    with pytest.raises(PerfError, match="not both"):
        PerfOptions(model="m", concurrency=[1], request_rates=[1.0]).validate()
    with pytest.raises(PerfError, match="max trials"):
        PerfOptions(model="m", max_trials=0).validate()
    PerfOptions(model="m").validate()


def test_help_lists_the_flags(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["perf", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for flag in (
        "-m MODEL", "-u URL", "-i {http,grpc}", "-b BATCH_SIZE", "--concurrency-range",
        "--request-rate-range", "--request-distribution", "--input-data", "--shape",
        "--measurement-interval", "--stability-percentage", "--max-trials", "--percentile",
        "-f FILE.csv", "--json", "--plot",
    ):  # fmt: skip
        assert flag in out, flag
