"""Team rules for ``pdserve check --rules rules.toml``.

A rules file is TOML (read with :mod:`tomllib`) holding an array of ``[[rule]]``
tables. Each rule tests one field of every model's *completed* configuration:
what ``serve`` would load after auto-complete and Triton's defaults, in the JSON
form ``GET /v2/models/{m}/config`` returns (field names as in config.pbtxt)::

    [[rule]]
    name = "batch-cap"                  # optional; reports say "rule:batch-cap"
    field = "max_batch_size"            # dotted path; "[*]" walks every list element
    max = 64                            # every value found must be <= 64

The keys of a rule are listed in :class:`Rule`; docs/tools/check.md has more examples.
"""

from __future__ import annotations

import fnmatch
import math
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

#: Keys a rule may have, by role.
_TESTS = ("min", "max", "one_of", "none_of", "equals", "required", "forbidden")
_FILTERS = ("models", "exclude_models", "backends", "exclude_backends")
_OTHER = ("name", "field", "severity", "message")
_SEGMENT = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)((?:\[(?:\*|\d+)\])*)$")


class RulesError(Exception):
    """A rules file that cannot be used (unreadable, not TOML, bad rule); a usage error."""


@dataclass(frozen=True)
class Rule:
    """One ``[[rule]]`` of a rules file.

    Keys of a rule:

    ``field`` (required)
        ``a.b.c``; ``name[*]`` takes every element of a list, ``name[2]`` one of them;
        a list value at the end is tested element by element (``input[*].dims``).
    Tests (at least one; all given must hold for every value found):
        ``min`` / ``max`` (numbers, inclusive), ``one_of`` / ``none_of`` (lists of
        allowed / forbidden values), ``equals``, ``required = true`` (at least one value
        is found: a section such as ``dynamic_batching`` is present) and ``forbidden =
        true`` (none is found). Scalars are always present (protobuf prints defaults:
        ``max_batch_size`` 0), so ``required`` / ``forbidden`` are for sections and lists.
    Filters (which models the rule applies to; default every model):
        ``models`` / ``exclude_models`` (glob patterns of model names),
        ``backends`` / ``exclude_backends`` (backend names; ``"ensemble"`` for ensembles).
    Reporting:
        ``name`` (default: ``rule<index>``), ``severity`` (``"error"``, the default,
        fails the check; ``"warning"`` is reported only), ``message`` (appended to each
        report, e.g. why the team has the rule).

    An unknown key, a wrong type or a rule with no test is a usage error (exit code 2)
    naming the rule, so a typo never silently disables a rule.
    """

    name: str
    field: str
    path: tuple[tuple[str, tuple[str, ...]], ...]
    tests: dict[str, Any]
    models: tuple[str, ...] = ()
    exclude_models: tuple[str, ...] = ()
    backends: tuple[str, ...] = ()
    exclude_backends: tuple[str, ...] = ()
    severity: str = "error"
    message: str = ""

    def applies_to(self, model: str, backend: str) -> bool:
        """Whether the rule's filters select ``model`` (``backend``: ``"ensemble"`` for one)."""
        if self.models and not any(fnmatch.fnmatchcase(model, p) for p in self.models):
            return False
        if any(fnmatch.fnmatchcase(model, p) for p in self.exclude_models):
            return False
        if self.backends and backend not in self.backends:
            return False
        return backend not in self.exclude_backends

    def evaluate(self, config: dict[str, object]) -> list[str]:
        """Test the rule on a configuration (Triton's JSON form).

        Returns:
            one message per broken test or value (empty: the rule holds), each naming
            the field path and the value found.
        """
        found = _lookup(config, self.path, "")
        problems: list[str] = []
        if self.tests.get("required") and not found:
            problems.append(f"{self.field} is required but not set")
        if self.tests.get("forbidden") and found:
            problems.append(f"{self.field} must not be set (found at {found[0][0]})")
        for where, value in found:
            values = value if isinstance(value, list) else [value]
            for item in values:
                problem = self._test_value(item)
                if problem:
                    problems.append(f"{where} is {_show(item)}: {problem}")
        return problems

    def _test_value(self, value: object) -> str | None:
        t = self.tests
        if "min" in t or "max" in t:
            if not _is_number(value):
                return "not a number"
            if "min" in t and value < t["min"]:
                return f"must be >= {_show(t['min'])}"
            if "max" in t and value > t["max"]:
                return f"must be <= {_show(t['max'])}"
        if "one_of" in t and value not in t["one_of"]:
            return f"must be one of {', '.join(_show(v) for v in t['one_of'])}"
        if "none_of" in t and value in t["none_of"]:
            return f"must not be any of {', '.join(_show(v) for v in t['none_of'])}"
        if "equals" in t and value != t["equals"]:
            return f"must equal {_show(t['equals'])}"
        return None


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _show(value: object) -> str:
    """A value as TOML writes it: ``"text"``, ``true``, ``64``."""
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _lookup(
    node: object, path: tuple[tuple[str, tuple[str, ...]], ...], prefix: str
) -> list[tuple[str, object]]:
    """Every ``(dotted path, value)`` that ``path`` reaches in ``node``."""
    if not path:
        return [(prefix, node)]
    (key, indices), rest = path[0], path[1:]
    if not isinstance(node, dict) or key not in node:
        return []
    here = f"{prefix}.{key}" if prefix else key
    nodes: list[tuple[str, object]] = [(here, node[key])]
    for index in indices:
        expanded: list[tuple[str, object]] = []
        for where, value in nodes:
            if not isinstance(value, list):
                continue
            if index == "*":
                expanded.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
            elif int(index) < len(value):
                expanded.append((f"{where}[{index}]", value[int(index)]))
        nodes = expanded
    out: list[tuple[str, object]] = []
    for where, value in nodes:
        out.extend(_lookup(value, rest, where))
    return out


def _parse_field(text: str, where: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    parts = []
    for segment in text.split("."):
        m = _SEGMENT.match(segment)
        if m is None:
            raise RulesError(
                f"{where}: field '{text}': segment '{segment}' is not NAME, NAME[*] or NAME[N]"
            )
        parts.append((m.group(1), tuple(re.findall(r"\[(\*|\d+)\]", m.group(2)))))
    return tuple(parts)


def _strings(value: object, key: str, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RulesError(f"{where}: '{key}' must be a list of strings")
    return tuple(value)


def parse_rules(data: dict[str, object], source: str = "rules") -> list[Rule]:
    """Rules from a parsed TOML document (``{"rule": [{...}, ...]}``).

    Raises:
        RulesError: an unknown top-level key or rule key, a value of the wrong
            type, a bad ``field``, a rule without a test, or duplicate names.
    """
    unknown = set(data) - {"rule"}
    if unknown:
        raise RulesError(
            f"{source}: unknown top-level key(s) {', '.join(sorted(unknown))}; "
            "a rules file holds [[rule]] tables"
        )
    raw = data.get("rule", [])
    if not isinstance(raw, list):
        raise RulesError(f"{source}: 'rule' must be an array of tables ([[rule]])")
    rules: list[Rule] = []
    names: set[str] = set()
    for index, item in enumerate(raw):
        where = f"{source}: rule[{index}]"
        if not isinstance(item, dict):
            raise RulesError(f"{where}: must be a table")
        bad = set(item) - set(_TESTS) - set(_FILTERS) - set(_OTHER)
        if bad:
            raise RulesError(
                f"{where}: unknown key(s) {', '.join(sorted(bad))}; known: "
                + ", ".join((*_OTHER, *_TESTS, *_FILTERS))
            )
        name = item.get("name", f"rule{index}")
        if not isinstance(name, str) or not name:
            raise RulesError(f"{where}: 'name' must be a non-empty string")
        if name in names:
            raise RulesError(f"{where}: duplicate rule name '{name}'")
        names.add(name)
        where = f"{source}: rule '{name}'"
        field_text = item.get("field")
        if not isinstance(field_text, str) or not field_text:
            raise RulesError(f"{where}: 'field' (a dotted path) is required")
        tests = {k: item[k] for k in _TESTS if k in item}
        if not tests:
            raise RulesError(f"{where}: no test; give one of {', '.join(_TESTS)}")
        for key in ("min", "max"):
            if key in tests and not _is_number(tests[key]):
                raise RulesError(f"{where}: '{key}' must be a number")
        for key in ("one_of", "none_of"):
            if key in tests and not isinstance(tests[key], list):
                raise RulesError(f"{where}: '{key}' must be a list")
        for key in ("required", "forbidden"):
            if key in tests and not isinstance(tests[key], bool):
                raise RulesError(f"{where}: '{key}' must be true or false")
        severity = item.get("severity", "error")
        if severity not in ("error", "warning"):
            raise RulesError(f'{where}: \'severity\' must be "error" or "warning"')
        message = item.get("message", "")
        if not isinstance(message, str):
            raise RulesError(f"{where}: 'message' must be a string")
        filters = {k: _strings(item[k], k, where) for k in _FILTERS if k in item}
        rules.append(
            Rule(
                name=name,
                field=field_text,
                path=_parse_field(field_text, where),
                tests=tests,
                severity=severity,
                message=message,
                **filters,
            )
        )
    return rules


def load_rules(path: Path) -> list[Rule]:
    """Read and parse a rules file.

    Raises:
        RulesError: the file cannot be read, is not TOML (with tomllib's line and
            column), or holds a bad rule (:func:`parse_rules`).
    """
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise RulesError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise RulesError(f"{path}: not UTF-8 text: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise RulesError(f"{path}: not valid TOML: {e}") from None
    return parse_rules(data, str(path))
