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
