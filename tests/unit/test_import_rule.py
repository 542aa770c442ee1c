"""The import rule (issue 9, ``shared/DESIGN.md``): each layer imports only the layers
below it, and the python backend's worker process imports only its own modules.

Every module under ``pdserve/`` is read with :mod:`ast` (nothing is imported). An
import counts when it runs: module-level and function-level imports, and the
``"pdserve.x.y:Name"`` strings of registries that are imported by name; imports
under ``if TYPE_CHECKING:`` are for type checkers only and do not count.

The layers, lowest first (a module may import its own layer and any layer before it)::

    core <- config <- backends <- scheduling <- repository <- cache <- server
         <- observability <- frontends <- ray <- app

Where the rule (core <- config <- {repository, scheduling, backends} <- server <-
{frontends, observability} <- app) leaves an order open, the code decides:

- backends <- scheduling <- repository: schedulers run backends' model instances
  (``ExecRequest``, ``ModelInstance``); the model manager builds each version's
  backend instances and scheduler. ``backends/host_policy.py`` and
  ``backends/devices.py`` are backends.
- ``pdserve/cache.py`` (the response cache) sits between repository and server: it
  keys on a loaded ``ModelVersion``, and the server consults it.
- ``pdserve/observability/stats.py`` sits with core: every request's statistics are
  recorded into it by the repository and the schedulers, and it imports nothing from
  pdserve. The rest of observability (Prometheus metrics) reads the server.
- observability <- frontends: a frontend may serve what observability renders (the
  metrics HTTP listener).
- ``pdserve/__init__.py`` (the version only) sits with core; ``pdserve/__main__.py``
  with app. Nothing below app imports app.
- ``pdserve/ray/`` (the Ray Serve application, issue 14) sits on the frontends: its
  ingress serves the V2 HTTP app over the model deployments; app may import it.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pdserve"

#: Layers, lowest first: (name, module prefixes, exact module names).
LAYERS: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("core", ("pdserve.core", "pdserve.observability.stats"), ("pdserve",)),
    ("shm", ("pdserve.shm",), ()),
    ("config", ("pdserve.config",), ()),
    ("backends", ("pdserve.backends",), ()),
    ("scheduling", ("pdserve.scheduling",), ()),
    ("repository", ("pdserve.repository",), ()),
    ("cache", ("pdserve.cache",), ()),
    ("server", ("pdserve.server",), ()),
    ("observability", ("pdserve.observability",), ()),
    ("frontends", ("pdserve.frontends",), ()),
    ("ray", ("pdserve.ray",), ()),
    ("app", ("pdserve.app",), ("pdserve.__main__",)),
]
RANK = {name: i for i, (name, _, _) in enumerate(LAYERS)}
RULE = " <- ".join(name for name, _, _ in LAYERS)

#: The python backend's worker process: what it may import (its own modules and core).
WORKER = "pdserve.backends.python.worker"
WORKER_MAY_IMPORT = (
    "pdserve.backends.python.worker",
    "pdserve.shm",
    "pdserve.shm.records",
    "pdserve.shm.arenas",
    "pdserve.shm.tensors",
    "pdserve.shm.pools",
    "pdserve.shm.framing",
    "pdserve.backends.python.messages",
    "pdserve.backends.python.triton_python_backend_utils",
    "pdserve.backends.python.model_config",
    "pdserve.backends.python.lifetime",
)

#: Known violations of today's code: (importer, imported) -> why, and who removes it.
#: The test fails on any other violation, and on an entry here that no longer occurs.
ALLOWED: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    """One run-time import: ``importer`` (module) imports ``target`` at ``path:line``.

    ``registry``: a ``"pdserve.module:Name"`` string, imported by name when first used.
    """

    importer: str
    target: str
    path: str
    line: int
    registry: bool = False


def module_name(path: Path) -> str:
    """``pdserve/a/b.py`` -> ``pdserve.a.b``; ``pdserve/a/__init__.py`` -> ``pdserve.a``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}


def layer_of(module: str) -> str | None:
    """The layer of ``module`` (longest matching prefix), or None."""
    best: tuple[int, str] | None = None
    for name, prefixes, exact in LAYERS:
        if module in exact:
            return name
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), name)
    return best[1] if best else None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node except the bodies of ``if TYPE_CHECKING:`` blocks."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _top_level_names(tree: ast.Module) -> set[str]:
    """Names a module binds at top level (what ``from module import name`` can take)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return names


def _resolve_from(importer: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    if importer not in PACKAGES:
        base.pop()
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str) -> list[Import]:
    """The run-time imports of pdserve modules made by ``module``.

    ``from package import name`` imports ``package.name`` when that is a module; a name
    that is neither a module nor bound in the package is an import of the missing
    module ``package.name`` (it does not resolve).
    """
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    rel = str(path.relative_to(ROOT))
    found: list[Import] = []

    def add(target: str, line: int, registry: bool = False) -> None:
        if target == "pdserve" or target.startswith("pdserve."):
            found.append(Import(module, target, rel, line, registry))

    for node in _runtime_nodes(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            source = _resolve_from(module, node)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in MODULES:
                    add(sub, node.lineno)
                elif source in PACKAGES and alias.name not in _package_names(source):
                    add(sub, node.lineno)  # neither a module nor a name of the package
                else:
                    add(source, node.lineno)
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("pdserve.")
            and node.value.count(":") == 1
        ):  # a registry entry "pdserve.module:Name", imported by name at run time
            target = node.value.split(":")[0]
            if target.replace(".", "").replace("_", "").isalnum():
                add(target, node.lineno, registry=True)
    return found


_NAMES: dict[str, set[str]] = {}


def _package_names(package: str) -> set[str]:
    if package not in _NAMES:
        tree = ast.parse(MODULES[package].read_text(encoding="utf-8"))
        _NAMES[package] = _top_level_names(tree)
    return _NAMES[package]


def layer_violations() -> list[tuple[Import, str]]:
    """Imports against the layer order, with a message naming the arrow."""
    out = []
    for module in MODULES:
        mine = layer_of(module)
        assert mine is not None
        for imp in imports_of(module):
            theirs = layer_of(imp.target)
            if imp.target not in MODULES:
                why = (
                    f"{imp.target} does not exist (no module pdserve/"
                    f"{imp.target.removeprefix('pdserve.').replace('.', '/')}.py)"
                )
                out.append((imp, why))
                continue
            if theirs is None or RANK[theirs] <= RANK[mine]:
                continue
            if theirs == "app":
                why = f"nothing below app imports app ({mine} <- app)"
            else:
                why = f"{mine} may not import {theirs}: the rule has {mine} <- {theirs}"
            out.append((imp, why))
    return out


def worker_closure() -> list[tuple[Import, str]]:
    """Modules the worker process imports (transitively, package ``__init__`` files
    included) that are not its own modules or core. Registry strings do not count
    here: they are imported only when a backend is looked up, never in the worker."""
    out = []
    seen: set[str] = set()
    todo = [WORKER]
    while todo:
        module = todo.pop()
        if module in seen or module not in MODULES:
            continue
        seen.add(module)
        parts = module.split(".")
        parents = [".".join(parts[:i]) for i in range(1, len(parts))]
        todo.extend(p for p in parents if p in MODULES)  # importing a.b.c runs a, a.b
        for imp in imports_of(module):
            if imp.registry:
                continue
            target = imp.target
            allowed = (
                target in WORKER_MAY_IMPORT
                or layer_of(target) == "core"
                or (target in PACKAGES and WORKER.startswith(target + "."))
            )
            if not allowed:
                via = "" if module == WORKER else f" (through {module})"
                out.append(
                    (
                        Import(WORKER, target, imp.path, imp.line),
                        f"the python worker imports only {', '.join(WORKER_MAY_IMPORT[1:])} "
                        f"and core; it reaches {target}{via}",
                    )
                )
            todo.append(target)
    return out


def _report(violations: list[tuple[Import, str]]) -> list[str]:
    return [
        f"{imp.path}:{imp.line}: {imp.importer} imports {imp.target}: {why}"
        for imp, why in violations
        if (imp.importer, imp.target) not in ALLOWED
    ]


# --------------------------------------------------------------------------- tests


def test_every_module_has_a_layer() -> None:
    assert [m for m in MODULES if layer_of(m) is None] == []
    assert layer_of("pdserve.observability.stats") == "core"
    assert layer_of("pdserve.observability.metrics") == "observability"
    assert layer_of("pdserve.backends.host_policy") == "backends"
    assert layer_of("pdserve.__main__") == "app"


def test_layers_import_only_layers_below() -> None:
    problems = _report(layer_violations())
    assert not problems, f"imports against the rule {RULE}:\n" + "\n".join(problems)


def test_python_worker_imports_only_its_modules_and_core() -> None:
    problems = _report(worker_closure())
    assert not problems, "\n".join(problems)


def test_allow_list_has_no_stale_entries() -> None:
    """Each known violation still occurs: remove an entry once its import is gone."""
    found = {(imp.importer, imp.target) for imp, _ in layer_violations() + worker_closure()}
    assert sorted(set(ALLOWED) - found) == []


# --------------------------------------------------------------------------- the checker


def _check(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str]) -> list[str]:
    """Run the checks on a made-up package under ``tmp_path``."""
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    this = sys.modules[__name__]
    monkeypatch.setattr(this, "ROOT", tmp_path)
    modules = {module_name(p): p for p in sorted((tmp_path / "pdserve").rglob("*.py"))}
    monkeypatch.setattr(this, "MODULES", modules)
    monkeypatch.setattr(
        this, "PACKAGES", {m for m, p in modules.items() if p.name == "__init__.py"}
    )
    monkeypatch.setattr(this, "ALLOWED", {})
    _NAMES.clear()
    try:
        return _report(layer_violations()) + _report(worker_closure())
    finally:
        _NAMES.clear()


def test_checker_names_the_module_the_import_and_the_arrow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    problems = _check(
        tmp_path,
        monkeypatch,
        {
            "pdserve/__init__.py": "__version__ = '0'\n",
            "pdserve/core/__init__.py": "",
            "pdserve/core/types.py": "from pdserve.server import X\n",
            "pdserve/config.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pdserve.server import X\n"
            ),
            "pdserve/server.py": "from pdserve import __version__\nfrom pdserve import cli\n",
            "pdserve/repository/__init__.py": "",
            "pdserve/repository/manager.py": "def f():\n    from pdserve.app import cli\n",
            "pdserve/app/__init__.py": "",
            "pdserve/app/cli.py": "import pdserve.server\n",
            "pdserve/backends/__init__.py": "REG = {'e': 'pdserve.scheduling.x:E'}\n",
            "pdserve/backends/python/__init__.py": "",
            "pdserve/backends/python/worker.py": (
                "from pdserve import shm\nimport pdserve.config\n"
            ),
            "pdserve/shm/__init__.py": "import pdserve.core.errors\n",
            "pdserve/core/errors.py": "",
            "pdserve/scheduling/__init__.py": "",
            "pdserve/scheduling/x.py": "",
        },
    )
    assert problems == [
        "pdserve/backends/__init__.py:1: pdserve.backends imports pdserve.scheduling.x: "
        "backends may not import scheduling: the rule has backends <- scheduling",
        "pdserve/core/types.py:1: pdserve.core.types imports pdserve.server: "
        "core may not import server: the rule has core <- server",
        "pdserve/repository/manager.py:2: pdserve.repository.manager imports pdserve.app.cli: "
        "nothing below app imports app (repository <- app)",
        "pdserve/server.py:2: pdserve.server imports pdserve.cli: pdserve.cli does not exist "
        "(no module pdserve/cli.py)",
        "pdserve/backends/python/worker.py:2: pdserve.backends.python.worker imports "
        "pdserve.config: the python worker imports only pdserve.shm, pdserve.shm.records, "
        "pdserve.shm.arenas, pdserve.shm.tensors, pdserve.shm.pools, pdserve.shm.framing, "
        "pdserve.backends.python.messages, pdserve.backends.python.triton_python_backend_utils, "
        "pdserve.backends.python.model_config, pdserve.backends.python.lifetime and core; "
        "it reaches pdserve.config",
    ]
