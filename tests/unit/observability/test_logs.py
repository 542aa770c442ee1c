"""pdserve.observability.logs: traceparent parsing, formats, level switches, redaction."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from pdserve.app.cli import build_parser
from pdserve.core import context
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.tracing import parse_traceparent
from pdserve.frontends.admission import begin_request
from pdserve.observability import logs

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"


@pytest.fixture
def stream() -> Iterator[io.StringIO]:
    saved = logs.settings_dict()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    out = io.StringIO()
    logs.configure(logs.LogState(), stream=out)
    yield out
    root.handlers[:] = handlers
    root.setLevel(level)
    saved.pop("log_file")
    logs.update_settings(saved)


@pytest.mark.parametrize(
    ("value", "want"),
    [
        (f"00-{TRACE}-00f067aa0ba902b7-01", TRACE),
        (f"00-{TRACE}-00f067aa0ba902b7-00".encode(), TRACE),
        (f"ff-{TRACE}-00f067aa0ba902b7-01", None),  # version ff is invalid
        (f"00-{'0' * 32}-00f067aa0ba902b7-01", None),  # zero trace id
        (f"00-{TRACE}-{'0' * 16}-01", None),  # zero parent id
        (f"00-{TRACE.upper()}-00f067aa0ba902b7-01", None),  # uppercase
        ("00-abc-def-01", None),
        ("", None),
        (b"\xff\xfe", None),
        (None, None),
    ],
)
def test_parse_traceparent(value: str | bytes | None, want: str | None) -> None:
    parsed = parse_traceparent(value)
    assert (parsed[0] if parsed is not None else None) == want


def test_json_lines_carry_ids_inside_a_request_only(stream: io.StringIO) -> None:
    logs.update_settings({"log_format": "json"})
    log = logging.getLogger("pdserve.test")
    log.info("outside")

    def inside() -> None:
        begin_request("rid-1", f"00-{TRACE}-00f067aa0ba902b7-01")
        log.warning("inside %d", 7)

    import contextvars

    contextvars.copy_context().run(inside)
    assert context.request_id.get() is None  # the request's context did not leak
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["message"] == "outside" and "request_id" not in first
    assert first["level"] == "INFO" and first["logger"] == "pdserve.test"
    assert second == {**second, "message": "inside 7", "request_id": "rid-1", "trace_id": TRACE}


def test_text_formats_and_suffix(stream: io.StringIO) -> None:
    log = logging.getLogger("pdserve.test")
    logs.update_settings({"log_format": "ISO8601"})
    import contextvars

    def inside() -> None:
        begin_request("")
        log.info("hello")

    contextvars.copy_context().run(inside)
    line = stream.getvalue().strip()
    stamp, level, name, *rest = line.split(" ")
    assert stamp.endswith("Z") and "T" in stamp and level == "I" and name == "pdserve.test:"
    assert rest[0] == "hello" and rest[1].startswith("[request_id=") and len(rest[1]) == 45


def test_level_switches_and_verbose(stream: io.StringIO) -> None:
    log = logging.getLogger("pdserve.test")
    logs.update_settings({"log_info": False, "log_error": False})
    log.info("no-info")
    log.warning("yes-warning")
    log.error("no-error")
    log.debug("no-debug")
    logs.update_settings({"log_verbose_level": 2})
    log.debug("yes-debug")
    text = stream.getvalue()
    assert "yes-warning" in text and "yes-debug" in text
    assert "no-" not in text


def test_credentials_are_redacted(stream: io.StringIO) -> None:
    logging.getLogger("pdserve.test").warning("got Authorization: Bearer abc.def and token=xyz")
    text = stream.getvalue()
    assert "abc.def" not in text and "xyz" not in text and "<redacted>" in text


def test_update_is_all_or_nothing() -> None:
    before = logs.settings_dict()
    with pytest.raises(InferError) as info:
        logs.update_settings({"log_info": not before["log_info"], "log_verbose_level": -3})
    assert info.value.code is ErrorCode.INVALID_ARG
    assert logs.settings_dict() == before


@pytest.mark.parametrize("value", ["maybe", "2", ""])
def test_bad_log_info_flag_is_an_argparse_error(value: str) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", "--log-info", value])
    assert info.value.code == 2


def test_log_flags_parse() -> None:
    args = build_parser().parse_args(
        ["serve", "--log-info", "false", "--log-warning=off", "--log-format", "json"]
    )
    assert (args.log_info, args.log_warning, args.log_format) == (False, False, "json")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-format", "xml"])
