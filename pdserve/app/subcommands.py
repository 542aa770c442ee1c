"""What the subcommands' CLI modules share: adding a subcommand with its flag groups,
turning a flag's text into a value (a bad one exits 2, naming the flag), and where
live progress goes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import IO, TypeAlias, TypeVar

T = TypeVar("T")

#: What ``ArgumentParser.add_subparsers`` returns; each subcommand adds itself to it
#: (a string: the class is not subscriptable at run time).
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

#: A subcommand's run: its parsed flags and its parser (for ``parser.error``) -> exit code.
Run = Callable[[argparse.Namespace, argparse.ArgumentParser], int]


def add_subcommand(
    sub: Subparsers,
    name: str,
    *,
    help: str,  # noqa: A002 - argparse's own name for it
    description: str,
    epilog: str,
    flags: Sequence[Callable[[argparse.ArgumentParser], None]],
    run: Run,
) -> argparse.ArgumentParser:
    """Add subcommand ``name``: its description and epilog printed as written, each
    of ``flags`` adding a group of flags, and ``run(args, parser)`` as its ``run``
    default."""
    p = sub.add_parser(
        name,
        help=help,
        description=description,
        epilog=epilog,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for add in flags:
        add(p)
    p.set_defaults(run=lambda args: run(args, p))
    return p


def parsed(parser: argparse.ArgumentParser, parse: Callable[[str], T], text: str, flag: str) -> T:
    """``parse(text)``; a ValueError exits 2 through ``parser.error``, naming ``flag``."""
    try:
        return parse(text)
    except ValueError as e:
        parser.error(f"{flag}: {e}")  # exits 2


def parsed_or_none(
    parser: argparse.ArgumentParser, parse: Callable[[str], T], text: str | None, flag: str
) -> T | None:
    """:func:`parsed`, or None when the flag was not given (or given empty)."""
    return parsed(parser, parse, text, flag) if text else None


def progress_stream(quiet: bool) -> IO[str]:
    """Where live progress goes: stderr, or (``--quiet``) a null stream."""
    return open(os.devnull, "w") if quiet else sys.stderr  # noqa: SIM115 - process-long
