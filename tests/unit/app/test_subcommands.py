"""What the subcommand CLI modules share (:mod:`pdserve.app.subcommands`): a subcommand
built from flag groups gets its own parser in ``run``, and a flag whose value does not
parse exits 2 naming the flag."""

from __future__ import annotations

import argparse

import pytest

from pdserve.app.subcommands import add_subcommand, parsed, parsed_or_none


def test_subcommand_runs_with_its_parser_and_flag_groups() -> None:
    seen: list[argparse.ArgumentParser] = []

    def flags(p: argparse.ArgumentParser) -> None:
        p.add_argument_group("load").add_argument("-n", type=int, default=1)

    def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
        seen.append(parser)
        return args.n

    root = argparse.ArgumentParser(prog="pdserve")
    sub = add_subcommand(
        root.add_subparsers(),
        "demo",
        help="a demo",
        description="line one\nline two",
        epilog="the end",
        flags=[flags],
        run=run,
    )
    args = root.parse_args(["demo", "-n", "3"])
    assert args.run(args) == 3 and seen == [sub]
    text = sub.format_help()
    assert "line one\nline two" in text and "load:" in text and text.rstrip().endswith("the end")


def test_a_bad_value_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="pdserve demo")
    assert parsed(parser, int, "7", "--n") == 7
    assert parsed_or_none(parser, int, None, "--n") is None
    assert parsed_or_none(parser, int, "", "--n") is None
    with pytest.raises(SystemExit) as e:
        parsed_or_none(parser, int, "seven", "--n")
    assert e.value.code == 2
    assert "pdserve demo: error: --n: invalid literal" in capsys.readouterr().err
