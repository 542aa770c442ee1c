"""The house's bounds on ``pdserve/``, as a ratchet: file and function length, module
docstrings, history notes, reasons on ``# type: ignore``, and a test importing every module.

Each check has an allowlist of today's offenders. A check fails on a new offender, and on
an allowlisted one that no longer offends: then delete its entry, so the list only shrinks.
Source is read and parsed (``ast``); nothing from pdserve is imported.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pdserve"
TESTS = ROOT / "tests"

MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 80
MAX_DOCSTRING_LINES = 15
HOT_PATH = re.compile(r"^\s*# hot path: \S")
HISTORY = re.compile(r"\b(issue|session) ?#?[0-9]+", re.IGNORECASE)
TYPE_IGNORE = re.compile(r"#\s*type:\s*ignore\b(\[[^\]]*\])?(?P<rest>.*)$")
# after the ignore: another comment or a dash, then words that are not a linter pragma
REASON = re.compile(r"^\s*(#|-|—)\s*(?!noqa\b|pragma\b)\w")

# Today's offenders, one allowlist per check (paths relative to pdserve/). Delete an entry
# when it stops offending; never add one.
FILES_OVER_800: set[str] = set()
FUNCTIONS_OVER_80: set[str] = set()
LONG_DOCSTRINGS: set[str] = set()
HISTORY_NOTES: dict[str, int] = {  # path -> most notes allowed
}
IGNORES_WITHOUT_REASON: dict[str, int] = {  # path -> most such ignores allowed
}
UNTESTED_MODULES: set[str] = {  # dotted names (__main__ runs as python -m pdserve)
    "pdserve.__main__",
}


@cache
def sources() -> dict[str, str]:
    """Every ``.py`` file in pdserve/, by path relative to pdserve/."""
    return {
        p.relative_to(PACKAGE).as_posix(): p.read_text(encoding="utf-8")
        for p in sorted(PACKAGE.rglob("*.py"))
    }


@cache
def trees() -> dict[str, ast.Module]:
    return {path: ast.parse(text, path) for path, text in sources().items()}


def functions(tree: ast.Module) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method, nested ones included."""

    def walk(
        node: ast.AST, prefix: str
    ) -> Iterator[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from walk(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def docstring_lines(node: ast.AST) -> range:
    """The line numbers of ``node``'s docstring (empty when it has none)."""
    body = getattr(node, "body", None)
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        return range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1)
    return range(0)


def code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> int:
    """Lines of code from ``def`` to the end: not blank, not a comment, not the docstring."""
    doc = docstring_lines(node)
    return sum(
        1
        for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
        if n not in doc and lines[n - 1].strip() and not lines[n - 1].lstrip().startswith("#")
    )


def is_hot_path(node: ast.FunctionDef | ast.AsyncFunctionDef, lines: list[str]) -> bool:
    """``# hot path: <why>`` on the line right above the def (or above its decorators)."""
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    return first >= 2 and HOT_PATH.match(lines[first - 2]) is not None


def ratchet(found: set[str], allowed: set[str], what: str) -> None:
    """Fail on an offender not allowed, or on an allowed entry that no longer offends."""
    new = sorted(found - allowed)
    gone = sorted(allowed - found)
    assert not new, f"{what}: {new}"
    assert not gone, f"no longer {what} (delete from the allowlist): {gone}"


def ratchet_counts(found: dict[str, int], allowed: dict[str, int], what: str) -> None:
    """Fail on more offences in a file than allowed, or on an allowed file with none."""
    over = {p: n for p, n in found.items() if n > allowed.get(p, 0)}
    gone = sorted(p for p in allowed if not found.get(p))
    assert not over, f"{what} (found, allowed at most {allowed}): {over}"
    assert not gone, f"no more {what} (delete from the allowlist): {gone}"


def test_no_file_over_800_lines() -> None:
    found = {p for p, text in sources().items() if len(text.splitlines()) > MAX_FILE_LINES}
    ratchet(found, FILES_OVER_800, f"files over {MAX_FILE_LINES} lines")


def test_no_function_over_80_lines_of_code() -> None:
    found = set()
    for path, tree in trees().items():
        lines = sources()[path].splitlines()
        for name, node in functions(tree):
            if code_lines(node, lines) > MAX_FUNCTION_LINES and not is_hot_path(node, lines):
                found.add(f"{path}::{name}")
    ratchet(found, FUNCTIONS_OVER_80, f"functions over {MAX_FUNCTION_LINES} lines of code")


def test_module_docstrings_are_short() -> None:
    found = {p for p, tree in trees().items() if len(docstring_lines(tree)) > MAX_DOCSTRING_LINES}
    ratchet(found, LONG_DOCSTRINGS, f"module docstrings over {MAX_DOCSTRING_LINES} lines")


def test_no_history_notes() -> None:
    found = {p: n for p, text in sources().items() if (n := len(HISTORY.findall(text)))}
    ratchet_counts(found, HISTORY_NOTES, "history notes (issue/session numbers)")


def test_every_type_ignore_says_why() -> None:
    found: dict[str, int] = {}
    for path, text in sources().items():
        for line in text.splitlines():
            m = TYPE_IGNORE.search(line)
            if m and not REASON.match(m["rest"]):
                found[path] = found.get(path, 0) + 1
    ratchet_counts(found, IGNORES_WITHOUT_REASON, "'# type: ignore' without a reason")


def module_name(path: str) -> str:
    parts = ["pdserve", *path.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_by_tests() -> set[str]:
    """Dotted names the tests import: ``import a.b`` gives a.b and a; ``from a.b import c``
    gives a.b, a and a.b.c (c may be a submodule)."""
    names: set[str] = set()
    for test in TESTS.rglob("*.py"):
        if "data" in test.relative_to(TESTS).parts[:1]:
            continue
        for node in ast.walk(ast.parse(test.read_text(encoding="utf-8"), str(test))):
            if isinstance(node, ast.Import):
                full = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                full = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            else:
                continue
            for name in full:
                parts = name.split(".")
                names.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return names


def test_every_module_is_imported_by_a_test() -> None:
    imported = imported_by_tests()
    found = {module_name(p) for p in sources()} - imported
    ratchet(found, UNTESTED_MODULES, "modules no test imports")


def test_the_checks_see_what_they_check() -> None:
    lines = [
        "def f():",
        '    """doc',
        '    string"""',
        "    # comment",
        "",
        "    x = 1",
        "    return x",
    ]
    tree = ast.parse("\n".join(lines))
    node = tree.body[0]
    assert isinstance(node, ast.FunctionDef)
    assert code_lines(node, lines) == 3
    hot = ["# hot path: decoded per request", "@cache", "def g(): pass"]
    node = ast.parse("\n".join(hot)).body[0]
    assert isinstance(node, ast.FunctionDef) and is_hot_path(node, hot)
    assert not is_hot_path(node, ["# hot path:", *hot[1:]])
    for ok in ("x  # type: ignore[x]  # grpc stubs lack it", "x  # type: ignore[x] - why"):
        m = TYPE_IGNORE.search(ok)
        assert m and REASON.match(m["rest"]), ok
    for bad in ("x  # type: ignore[x]", "x  # type: ignore", "x  # type: ignore[x]  # noqa: F401"):
        m = TYPE_IGNORE.search(bad)
        assert m and not REASON.match(m["rest"]), bad
    assert HISTORY.search("see Issue #12") and HISTORY.search("session 3")
    assert not HISTORY.search("issues") and not HISTORY.search("tissue 4")
    assert module_name("app/__init__.py") == "pdserve.app"
    assert module_name("server.py") == "pdserve.server"


def test_a_ratchet_fails_on_new_offenders_and_on_stale_entries() -> None:
    ratchet({"a.py"}, {"a.py"}, "long")
    with pytest.raises(AssertionError, match=r"long: \['b.py'\]"):
        ratchet({"a.py", "b.py"}, {"a.py"}, "long")
    with pytest.raises(AssertionError, match="delete from the allowlist"):
        ratchet(set(), {"a.py"}, "long")
    ratchet_counts({"a.py": 1}, {"a.py": 2}, "notes")
    with pytest.raises(AssertionError, match="notes"):
        ratchet_counts({"a.py": 3}, {"a.py": 2}, "notes")
    with pytest.raises(AssertionError, match="delete from the allowlist"):
        ratchet_counts({}, {"a.py": 2}, "notes")
