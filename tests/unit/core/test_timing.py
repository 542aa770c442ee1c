"""Server-Timing values: W3C syntax, ms durations, ensemble steps prefixed; opt-in rules."""

from __future__ import annotations

from pdserve.core.timing import asked, parse_server_timing, server_timing


def test_one_model() -> None:
    value = server_timing([("tiny", 120_000, 0, 1_500_000, 0, 2_000_000)])
    assert value == (
        "queue;dur=0.120, compute_input;dur=0.000, compute_infer;dur=1.500, "
        "compute_output;dur=0.000, total;dur=2.000"
    )
    assert parse_server_timing(value) == {
        "queue": 0.12,
        "compute_input": 0.0,
        "compute_infer": 1.5,
        "compute_output": 0.0,
        "total": 2.0,
    }


def test_ensemble_steps_are_prefixed() -> None:
    value = server_timing(
        [
            ("pre process", 1000, 0, 2000, 0, 4000),
            ("classifier", 0, 0, 5_000_000, 0, 6_000_000),
            ("pipeline", 0, 0, 0, 0, 7_123_456),
        ]
    )
    parsed = parse_server_timing(value)
    assert parsed["pre_process.total"] == 0.004
    assert parsed["classifier.compute_infer"] == 5.0
    assert parsed["total"] == 7.123
    assert len(parsed) == 15


def test_asked() -> None:
    params = {"server_timing": True, "priority": 1}
    assert asked(None, params) and params == {"priority": 1}
    assert asked(b"1", {}) and asked("true", {}) and asked(b" ON ", {})
    assert not asked(b"0", {}) and not asked(None, {}) and not asked(None, {"server_timing": "yes"})


def test_one_model_with_split_compute_and_rounding() -> None:
    value = server_timing([("tiny", 1_000, 250_000, 1_000_000, 4_999_500, 7_000_000)])
    assert parse_server_timing(value) == {
        "queue": 0.001,
        "compute_input": 0.25,
        "compute_infer": 1.0,
        "compute_output": 5.0,  # 4.9995 ms to 3 decimals
        "total": 7.0,
    }
    # the 3-number format of the usual request rounds as the general one does
    for ns in (0, 999, 388_500, 1_234_567, 2_000_499, 123_456_789):
        one = parse_server_timing(server_timing([("m", ns, 0, ns + 1, 0, ns + 499)]))
        steps = parse_server_timing(
            server_timing([("m", ns, 0, ns + 1, 0, ns + 499), ("e", 0, 0, 0, 0, 0)])
        )
        assert one == {k[2:]: v for k, v in steps.items() if k.startswith("m.")}


def test_asked_pops_the_parameter_whatever_the_header_says() -> None:
    params = {"server_timing": False, "x": 1}
    assert asked(b"1", params) and params == {"x": 1}
    params = {"server_timing": True}
    assert asked(b"no", params) and params == {}
    assert asked("yes", {}) and asked(b"TRUE", {}) and asked("\tOn ", {})
    assert not asked(b"", {}) and not asked(b"2", {}) and not asked("", {"server_timing": 1})
