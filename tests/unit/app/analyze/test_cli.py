"""``pdserve analyze``'s flags (:mod:`pdserve.app.analyze.cli`): list, delay and
size syntax, flags that do not go together (exit 2), and ``--help``."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.app.analyze.cli import (
    add_parser,
    options_from_args,
    parse_delays,
    parse_int_list,
    parse_memory,
)
from pdserve.app.analyze.options import AnalyzeOptions
from tests.conftest import ROOT


def options(*argv: str) -> AnalyzeOptions:
    parser = argparse.ArgumentParser(prog="pdserve")
    sub = add_parser(parser.add_subparsers())
    return options_from_args(sub.parse_args(list(argv)), sub)


def test_int_lists_take_values_and_ranges() -> None:
    assert parse_int_list("4,1,2") == [1, 2, 4]
    assert parse_int_list("1:4") == [1, 2, 3, 4]
    assert parse_int_list("1:16:4,32") == [1, 5, 9, 13, 32]
    for bad in ("x", "0", "4:1", "1:2:0", "1:2:3:4", ""):
        with pytest.raises(ValueError):
            parse_int_list(bad)


def test_delays_take_off_and_microseconds() -> None:
    assert parse_delays("off,0,500,0") == [None, 0, 500]
    assert parse_delays("OFF") == [None]
    for bad in ("-1", "soon"):
        with pytest.raises(ValueError):
            parse_delays(bad)


def test_memory_sizes() -> None:
    assert parse_memory("2GiB") == 2 * 1024**3
    assert parse_memory("2G") == 2 * 1024**3
    assert parse_memory("512MiB") == 512 * 1024**2
    assert parse_memory("1.5GB") == 1_500_000_000
    assert parse_memory("1048576") == 1048576
    assert parse_memory("64k") == 65536
    for bad in ("", "2 GiBs", "many", "0"):
        with pytest.raises(ValueError):
            parse_memory(bad)


def test_flags_become_options() -> None:
    o = options(
        "-m",
        "tiny",
        "--p99-ms",
        "20",
        "--memory-budget",
        "1GiB",
        "--instance-counts",
        "1:3",
        "--preferred-batch-sizes",
        "none,8+4",
        "--queue-delays-us",
        "off,100",
        "--server-cpus",
        "0",
        "--min-gain",
        "5",
        "--concurrency",
        "1,8",
    )
    assert o.model == "tiny" and o.p99_ms == 20 and o.memory_budget == 1024**3
    assert o.instance_counts == [1, 2, 3] and o.preferred == ["none", "4+8"]
    assert o.queue_delays_us == [None, 100] and o.server_cpus == [0]
    assert o.min_gain == pytest.approx(0.05) and o.concurrency == [1, 8]
    assert o.output_dir == Path("analyze-tiny") and o.url is None and o.search == "quick"


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "x", "-u", "h:1", "--model-repository", "r"],
        ["-m", "x", "--server-pid", "1"],
        ["-m", "x", "-u", "h:1", "-i", "grpc"],
        ["-m", "x", "--max-minutes", "0"],
        ["-m", "x", "--p99-ms", "-1"],
        ["-m", "x", "--memory-budget", "lots"],
        ["-m", "x", "--preferred-batch-sizes", "none,big"],
        ["-m", "x", "--server-cpus", "0-99999"],
        ["-m", "x", "--queue-delays-us", "-5"],
        ["-m", "x", "--shape", "nocolon"],
    ],
)
def test_bad_flags_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        options(*argv)
    assert e.value.code == 2
    assert "pdserve analyze: error:" in capsys.readouterr().err


def test_help_exits_0() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", "analyze", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0
    assert "--p99-ms" in out.stdout and "--memory-budget" in out.stdout
    assert "hill climbing" in out.stdout
