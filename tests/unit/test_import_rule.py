"""The import rule (``shared/DESIGN.md``): each layer imports only the layers below it,
no pdserve module takes part in an import cycle, and the python backend's worker
process imports only its own modules and core.

Every module under ``pdserve/`` is read with :mod:`ast` (nothing is imported). Every
import counts: module-level, function-level and ``if TYPE_CHECKING:`` ones, and the
``"pdserve.x.y:Name"`` strings of registries that are imported by name.

The layers, lowest first (a module may import its own layer and any layer before it)::

    core <- shm <- config <- backends <- scheduling <- repository <- cache <- server
         <- observability <- frontends <- ray <- app

Where the rule (core <- config <- {repository, scheduling, backends} <- server <-
{frontends, observability} <- app) leaves an order open, the code decides:

- backends <- scheduling <- repository: schedulers run backends' model instances; the
  model manager builds each version's instances and scheduler.
- ``pdserve/cache.py`` sits between repository and server: it keys on a loaded model
  version, and the server consults it.
- observability <- frontends: a frontend may serve what observability renders.
- ``pdserve/shm`` (shared-memory arenas and framing) sits just above core: the python
  backend's workers and the ``--http-workers`` channel both use it.
- ``pdserve/__init__.py`` (the version only) sits with core; ``pdserve/__main__.py``
  with app. Nothing below app imports app; ``pdserve/ray/`` sits on the frontends.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "pdserve"

#: Layers, lowest first: (name, module prefixes, exact module names).
LAYERS: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
    ("core", ("pdserve.core",), ("pdserve",)),
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

#: Import cycles of today's code, each the set of modules of one cycle (a strongly
#: connected component of the import graph) -> who cuts it. The test fails on any
#: other cycle, and on an entry here that no longer occurs exactly.
ALLOWED_CYCLES: dict[frozenset[str], str] = {}


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
    """Every import of a pdserve module made by ``module`` (``TYPE_CHECKING`` ones too).

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

    for node in ast.walk(tree):
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


def import_cycles() -> list[frozenset[str]]:
    """The import cycles: every strongly connected component of the import graph
    (modules as nodes, every import an edge) with more than one module, or one module
    that imports itself."""
    graph = {m: sorted({i.target for i in imports_of(m) if i.target in MODULES}) for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[frozenset[str]] = []
    for root in graph:  # Tarjan's algorithm, iterative (no recursion limit)
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            targets = graph[node]
            if i < len(targets):
                work.append((node, i + 1))
                nxt = targets[i]
                if nxt not in index:
                    work.append((nxt, 0))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            if work and work[-1][0] != node:  # returning to the caller: pass low up
                caller = work[-1][0]
                low[caller] = min(low[caller], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    cycles.append(frozenset(component))
    return cycles


def _cycle_report(cycles: list[frozenset[str]], allowed: dict[frozenset[str], str]) -> list[str]:
    return ["import cycle among " + ", ".join(sorted(c)) for c in cycles if c not in allowed]


def _report(violations: list[tuple[Import, str]]) -> list[str]:
    return [
        f"{imp.path}:{imp.line}: {imp.importer} imports {imp.target}: {why}"
        for imp, why in violations
        if (imp.importer, imp.target) not in ALLOWED
    ]


# --------------------------------------------------------------------------- tests


def test_every_module_has_a_layer() -> None:
    assert [m for m in MODULES if layer_of(m) is None] == []
    assert layer_of("pdserve.core.stats") == "core"
    assert [m for m in MODULES if layer_of(m) == "core"] == [
        m for m in MODULES if m == "pdserve" or m.startswith("pdserve.core")
    ]
    assert layer_of("pdserve.observability.metrics") == "observability"
    assert layer_of("pdserve.backends.host_policy") == "backends"
    assert layer_of("pdserve.__main__") == "app"


def test_layers_import_only_layers_below() -> None:
    problems = _report(layer_violations())
    assert not problems, f"imports against the rule {RULE}:\n" + "\n".join(problems)


def test_python_worker_imports_only_its_modules_and_core() -> None:
    problems = _report(worker_closure())
    assert not problems, "\n".join(problems)


def test_no_import_cycles() -> None:
    problems = _cycle_report(import_cycles(), ALLOWED_CYCLES)
    assert not problems, "\n".join(problems)


def test_cycle_allow_list_has_no_stale_entries() -> None:
    """Each known cycle still occurs as it is: remove (or narrow) an entry once cut."""
    assert sorted(map(sorted, set(ALLOWED_CYCLES) - set(import_cycles()))) == []


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
        "pdserve/config.py:3: pdserve.config imports pdserve.server: "
        "config may not import server: the rule has config <- server",
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
        "pdserve/config.py:3: pdserve.backends.python.worker imports pdserve.server: "
        "the python worker imports only pdserve.shm, pdserve.shm.records, "
        "pdserve.shm.arenas, pdserve.shm.tensors, pdserve.shm.pools, pdserve.shm.framing, "
        "pdserve.backends.python.messages, pdserve.backends.python.triton_python_backend_utils, "
        "pdserve.backends.python.model_config, pdserve.backends.python.lifetime and core; "
        "it reaches pdserve.server "
        "(through pdserve.config)",
        "pdserve/server.py:2: pdserve.backends.python.worker imports pdserve.cli: "
        "the python worker imports only pdserve.shm, pdserve.shm.records, "
        "pdserve.shm.arenas, pdserve.shm.tensors, pdserve.shm.pools, pdserve.shm.framing, "
        "pdserve.backends.python.messages, pdserve.backends.python.triton_python_backend_utils, "
        "pdserve.backends.python.model_config, pdserve.backends.python.lifetime and core; "
        "it reaches pdserve.cli "
        "(through pdserve.server)",
    ]


def test_checker_finds_cycles_through_function_level_and_type_checking_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _check(
        tmp_path,
        monkeypatch,
        {
            "pdserve/__init__.py": "",
            "pdserve/app/__init__.py": "",
            "pdserve/app/a.py": "def f():\n    from pdserve.app import b\n",
            "pdserve/app/b.py": "from pdserve.app.c import X\n",
            "pdserve/app/c.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n    from pdserve.app.a import f\n"
            ),
            "pdserve/app/d.py": "import pdserve.app.d\nimport pdserve.app.a\n",
            "pdserve/app/e.py": "import pdserve.app.a\n",
        },
    )
    cycles = import_cycles()
    assert sorted(map(sorted, cycles)) == [
        ["pdserve.app.a", "pdserve.app.b", "pdserve.app.c"],
        ["pdserve.app.d"],
    ]
    allowed = {frozenset({"pdserve.app.d"}): "someone"}
    assert _cycle_report(cycles, allowed) == [
        "import cycle among pdserve.app.a, pdserve.app.b, pdserve.app.c"
    ]
