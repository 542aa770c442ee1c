"""How ``pdserve serve`` flags are spelled on the command line, tritonserver's way:
on/off flags that take ``--allow-grpc=false`` as well as ``--no-allow-grpc``,
repeatable ``--host-policy NAME,SETTING=VALUE``, sizes such as ``2GiB``, and the
help formatter and help sections. :func:`flag` makes a dataclass field that is a
flag; :func:`add_flags` declares such fields on an argparse parser.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from pdserve.backends.host_policy import parse_option, resolve_policy
from pdserve.core.procmem import parse_size

#: Help sections of ``pdserve serve --help``, in order.
GROUPS = (
    "server",
    "logging",
    "HTTP",
    "gRPC",
    "metrics",
    "monitoring",
    "model control",
    "response cache",
    "traffic control",
    "TLS",
    "tracing",
    "rate limiter",
    "tritonserver compatibility",
)


class StrictArgumentParser(argparse.ArgumentParser):
    """An argument parser that takes no abbreviated long flags (``--allow-grp`` is
    not ``--allow-grpc``): every pdserve parser and subparser is one
    (``add_subparsers`` makes subparsers of its parser's class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


class FlagAction(argparse.Action):
    """An argparse action whose :meth:`take` reads the flag's value into the namespace.

    A ``ValueError`` or ``argparse.ArgumentTypeError`` that :meth:`take` raises is an
    argparse error (exit code 2): ``argument FLAG: message``, the flag named as
    :meth:`named` says.
    """

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        try:
            self.take(namespace, values, option_string)
        except (ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"argument {self.named(option_string)}: {e}")

    def take(self, namespace: argparse.Namespace, values: Any, option_string: str | None) -> None:
        """Read ``values`` (the flag's value, after its ``type``) into ``namespace``."""
        raise NotImplementedError

    def named(self, option_string: str | None) -> str:
        """The flag as an error names it: all its spellings, as argparse does."""
        return "/".join(self.option_strings)


class HostPolicyAction(FlagAction):
    """``--host-policy NAME,SETTING=VALUE`` (repeatable): collect and check host policies.

    The namespace attribute holds ``policy name -> {setting: value}``; options with
    the same name merge (a later value of a setting wins), as in Triton. Each
    option is checked as soon as it is read (its syntax, the setting, and the cores
    of the merged policy: see :func:`pdserve.backends.host_policy.resolve_policy`), so a bad
    one is an argparse error (exit code 2) naming the option.
    """

    def take(self, namespace: argparse.Namespace, values: Any, option_string: str | None) -> None:
        policies: dict[str, dict[str, str]] = dict(getattr(namespace, self.dest, None) or {})
        name, setting, value = parse_option(str(values))
        settings = {**policies.get(name, {}), setting: value}
        resolve_policy(name, settings)
        policies[name] = settings
        setattr(namespace, self.dest, policies)


class RepositoryAction(FlagAction):
    """``--model-repository`` / ``--model-store``: tritonserver takes several
    repositories; pdserve serves one, so a second, different one is an argparse
    error (exit code 2) naming both."""

    def take(self, namespace: argparse.Namespace, values: Any, option_string: str | None) -> None:
        before = getattr(namespace, self.dest, None)
        if before is not None and str(before) != str(values):
            raise ValueError(f"pdserve serves one model repository, got {before} and {values}")
        setattr(namespace, self.dest, values)


def parse_bool(text: str) -> bool:
    """A boolean flag value as tritonserver reads one (its ``ParseOption<bool>``):
    true/false, 1/0, on/off in any case; pdserve also reads yes/no.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    value = text.strip().lower()
    if value in ("true", "1", "on", "yes"):
        return True
    if value in ("false", "0", "off", "no"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def int_bool(text: str) -> int:
    """``--log-verbose``'s value as tritonserver reads it (``ParseIntBoolOption``):
    an integer, or true (1) / false (0) in any case.

    Raises:
        argparse.ArgumentTypeError: anything else.
    """
    value = text.strip().lower()
    if value in ("true", "false"):
        return int(value == "true")
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected an integer, true or false, got {text!r}"
        ) from None


def lower(text: str) -> str:
    """A value tritonserver reads in any case (``--model-control-mode=EXPLICIT``)."""
    return text.strip().lower()


class TritonBoolAction(FlagAction, argparse.BooleanOptionalAction):
    """An on/off flag that takes both spellings: pdserve's ``--allow-grpc`` /
    ``--no-allow-grpc`` and tritonserver's ``--allow-grpc=false`` (any value
    :func:`parse_bool` reads; a value may also follow as the next argument).

    ``implies`` (``--grpc-use-ssl-mutual``'s ``grpc_use_ssl``): a field that the flag,
    given in its positive form with any value, also turns on, as tritonserver's parser
    does; a later ``--grpc-use-ssl=false`` turns it off again (tritonserver reads its
    flags in order too).

    Raises (through the parser, exit status 2): a value :func:`parse_bool` does not
    read, or a value after the ``--no-`` form; the error names the spelling given.
    """

    def __init__(
        self, option_strings: list[str], dest: str, implies: str | None = None, **kwargs: Any
    ) -> None:
        kwargs.setdefault("metavar", "BOOL")
        super().__init__(option_strings, dest, **kwargs)
        self.nargs = "?"  # the base class takes no value
        self.implies = implies

    def take(self, namespace: argparse.Namespace, values: Any, option_string: str | None) -> None:
        negative = option_string is not None and option_string.startswith("--no-")
        if values is None:
            setattr(namespace, self.dest, not negative)
        elif negative:
            raise ValueError(f"takes no value (got {values!r})")
        else:
            setattr(namespace, self.dest, parse_bool(values))
        if self.implies is not None and not negative:
            setattr(namespace, self.implies, True)

    def named(self, option_string: str | None) -> str:
        return str(option_string)


class ServeHelpFormatter(argparse.HelpFormatter):
    """``pdserve serve --help``: a :class:`TritonBoolAction` flag is listed as
    ``--allow-grpc [BOOL], --no-allow-grpc`` (the negative form takes no value)."""

    def _format_action_invocation(self, action: argparse.Action) -> str:
        if isinstance(action, TritonBoolAction):
            return ", ".join(
                o if o.startswith("--no-") else f"{o} [{action.metavar}]"
                for o in action.option_strings
            )
        return super()._format_action_invocation(action)


def path_arg(text: str) -> Path:
    """A file or folder flag's value.

    Raises:
        argparse.ArgumentTypeError: an empty value (``Path("")`` is the working folder).
    """
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a path, got {text!r}")
    return Path(text)


def size_arg(text: str) -> int:
    """argparse type of a size flag: ``2GiB``, ``512MiB``, ``1.5GB``, bytes."""
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def flag(
    name: str,
    default: object,
    group: str,
    help: str,
    factory: Callable[[], object] | None = None,
    aliases: tuple[str, ...] = (),
    **argparse_options: Any,
) -> Any:
    """A dataclass field that is the flag ``name`` (typed Any, as ``dataclasses.field``:
    it stands for a value of the field's type).

    ``help`` may say ``{default}``: it is replaced by the default, written for people
    (see :func:`show_default`). ``factory`` replaces ``default`` for mutable defaults.
    ``aliases`` are other spellings of the flag (tritonserver's ``--model-store``).
    """
    assert group in GROUPS, group
    metadata = {
        "flag": name,
        "aliases": aliases,
        "group": group,
        "help": help,
        "argparse": argparse_options,
    }
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def switch(name: str, default: bool, group: str, help: str) -> Any:
    """A :func:`flag` that is on or off, in both spellings (:class:`TritonBoolAction`)."""
    return flag(name, default, group, help, action=TritonBoolAction)


def show_default(value: object) -> str:
    """A default as ``--help`` writes it: ``on`` / ``off``, ``30`` for 30.0, ``64 MiB``."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, int) and value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{value >> 20} MiB"
    return str(value)


def add_flags(
    parser: argparse.ArgumentParser,
    fields: Iterable[dataclasses.Field[Any]],
    defaults: Mapping[str, object] | None = None,
) -> dict[str, argparse._ArgumentGroup]:
    """Declare each :func:`flag` field as a flag of ``parser``, in help sections
    (:data:`GROUPS`); fields that are no flag are skipped. Returns the sections by name.

    Every flag's argparse default is ``argparse.SUPPRESS``: a flag not given leaves no
    attribute, so the reader of the namespace keeps the field's default (or the
    program's own, ``defaults``: field name -> default, which the help then shows).
    """
    defaults = defaults or {}
    groups = {name: parser.add_argument_group(f"{name} options") for name in GROUPS}
    for f in fields:
        meta = f.metadata
        if "flag" not in meta:
            continue
        default = None if f.default is dataclasses.MISSING else f.default
        default = defaults.get(f.name, default)
        help_text = meta["help"].replace("{default}", show_default(default))
        groups[meta["group"]].add_argument(
            meta["flag"],
            *meta["aliases"],
            dest=f.name,
            default=argparse.SUPPRESS,
            help=help_text,
            **meta["argparse"],
        )
    return groups
