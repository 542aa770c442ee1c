"""``pdserve check REPO``: lint a model repository for CI, serving nothing.

Every model of the repository goes through the checks below; a check that fails
never stops the others, so one run reports every problem. Nothing is loaded into a
server: ONNX models are opened with ONNX Runtime on the CPU (as auto-complete does
at load), python models are imported in a worker process that only imports them.

Checks, in order, per model (``version`` is a version folder):

``config``
    ``config.pbtxt`` parses, its name equals the folder's, platform/backend are
    known and runnable here, there is a version folder and the version policy
    selects one: :func:`pdserve.repository.prepare.read_config`, the code and
    messages of ``serve``.
``model-file`` (per version)
    the model file exists (``default_model_filename`` or the backend's default).
``onnx-checker`` (per version, ONNX models)
    ``onnx.checker.check_model(full_check=True)``: the graph is valid ONNX. Needs
    the ``onnx`` package (``pip install 'pdserve[check]'``); without it the check is
    skipped with a warning saying so.
``onnx-config`` / ``python-import`` / ``ensemble`` (per version)
    what ``serve`` does before a backend loads the version
    (:func:`pdserve.repository.prepare.complete_config`): the backend's
    auto-complete (ONNX: the graph's inputs and outputs agree with the configuration;
    python: ``model.py`` imports and its ``auto_complete_config`` runs, in a worker
    process, within ``--timeout``; ensemble: every step model exists, every tensor is
    produced once, every input is read, no cycles, datatypes and shapes agree,
    :func:`pdserve.scheduling.ensemble.validate_ensemble`), Triton's defaults, the
    generic validation, and the host-policy names (``--host-policy``). Ensembles
    that step into each other (A -> B -> A, or A into itself) are reported on every
    ensemble of the cycle, with Triton's message (``circular dependency between
    ensembles: A -> B -> A``, its ``CircularDependencyCheck``), on each step that
    leads back; every step naming a missing model is reported, and the rest of the
    configuration is still validated as written. An ensemble whose step model has
    problems of its own (a cycle included) is skipped, naming every such step.
``warmup`` (per version, models with ``model_warmup``)
    the warm-up samples as ``serve`` checks them before it runs them
    (:func:`pdserve.repository.warmup.check_samples`, serve's messages): every input
    named exists, dims are concrete, ``data_type`` is supported, an
    ``input_data_file`` stays inside ``<model>/warmup/``, exists, is a regular file
    and holds the bytes the shape needs; each sample fits the model's inputs
    (datatype, dims, ``batch_size`` <= ``max_batch_size``, required inputs). Every
    problem is reported (serve stops at the first); the field names the sample and
    input (``model_warmup[0].inputs[INPUT0].input_data_file``).
``identity`` (per version holding ``MODEL_IDENTITY.json``)
    the JSON parses; its ``model`` / ``version`` match the folder; its
    ``model_file`` is the file the configuration loads; the file's sha256 (and
    ``size_bytes``) are the recorded ones.
``golden`` (per version whose identity has a ``golden`` entry)
    the stored inputs, run through the model file with ONNX Runtime (PyTorch
    models: torch on the CPU, through the backend's loader and naming conventions) in
    this process, give the stored outputs within the stored tolerance
    (``|got - want| <= atol + rtol * |want|``; other datatypes exactly). Golden
    outputs of python models are skipped (they would need the model's workers).
``rule:<name>``
    each rule of ``--rules`` (:mod:`pdserve.app.check_rules`) on the completed
    configuration of the version ``serve`` would serve by default.

By default every version folder is checked, also those the policy does not
serve today (``pdserve rollback`` may pin them); ``--served-only`` checks only
those the policy selects. A GPU instance group passes on a machine without GPUs
(the check loads nothing onto a device).

Exit code: 0 no errors (warnings allowed), 1 errors, 2 usage (bad arguments, no
such repository, a bad rules file). Output: human-readable (default), ``--format
json`` or ``--format junit`` (:mod:`pdserve.app.check_output`).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import hashlib
import importlib.util
import inspect
import json
import math
import os
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import Backend, ModelSpec
from pdserve.repository import layout
from pdserve.repository.model import ModelVersion
from pdserve.repository.prepare import backend_for, complete_config, read_config
from pdserve.repository.traffic import TRAFFIC_FILENAME, TrafficError, read_traffic_file
from pdserve.repository.warmup import check_samples
from pdserve.scheduling.ensemble import EnsembleBackend

from .check_rules import Rule, RulesError, load_rules

#: The file in a version folder that records the model file's identity and goldens.
IDENTITY_FILENAME = "MODEL_IDENTITY.json"
#: Seconds a python model may take to import and run ``auto_complete_config``.
DEFAULT_TIMEOUT_S = 60.0
#: The pdserve extra that installs the ``onnx`` package for ``onnx-checker``.
ONNX_EXTRA = "check"

ERROR = "error"
WARNING = "warning"


@dataclass
class Problem:
    """One thing wrong (or, as a warning, worth a look) in the repository.

    Attributes:
        check: the check that found it (``config``, ``golden``, ``rule:<name>``...).
        message: what is wrong, in words.
        model / version: where (``""`` / None: the repository / the whole model).
        path: the file concerned (config.pbtxt, model.onnx, MODEL_IDENTITY.json).
        field: the field in it (``input[0].dims``, ``line:column``, ``sha256``).
        severity: ``"error"`` (fails the check) or ``"warning"``.
    """

    check: str
    message: str
    model: str = ""
    version: int | None = None
    path: str = ""
    field: str = ""
    severity: str = ERROR

    def to_json(self) -> dict[str, Any]:
        """The problem as a JSON object (the ``--format json`` schema)."""
        return {
            "model": self.model,
            "version": self.version,
            "check": self.check,
            "severity": self.severity,
            "path": self.path,
            "field": self.field,
            "message": self.message,
        }


@dataclass
class CheckResult:
    """One check run on one model (or version): a JUnit test case.

    Attributes:
        status (property): ``"failed"`` (an error), ``"skipped"`` (``skipped`` says
            why) or ``"passed"`` (possibly with warnings).
    """

    model: str
    check: str
    version: int | None = None
    problems: list[Problem] = field(default_factory=list)
    skipped: str = ""
    seconds: float = 0.0

    def add(
        self, message: str, path: str | Path = "", field: str = "", severity: str = ERROR
    ) -> None:
        """Record a problem found by this check."""
        self.problems.append(
            Problem(self.check, message, self.model, self.version, str(path), field, severity)
        )

    def skip(self, reason: str) -> None:
        """Mark the check as not run, saying why."""
        self.skipped = reason

    @property
    def status(self) -> str:
        if any(p.severity == ERROR for p in self.problems):
            return "failed"
        return "skipped" if self.skipped else "passed"

    def to_json(self) -> dict[str, Any]:
        """The result as a JSON object (the ``--format json`` schema)."""
        return {
            "check": self.check,
            "version": self.version,
            "status": self.status,
            "skipped": self.skipped,
            "seconds": round(self.seconds, 4),
            "problems": [p.to_json() for p in self.problems],
        }


@dataclass
class ModelReport:
    """Everything checked for one model folder.

    Attributes:
        versions: the version folders on disk; ``served_versions`` those the policy
            selects (what ``serve`` would load).
        config: the configuration after :func:`read_config` (None: it failed).
        completed: version -> configuration after auto-complete, defaults and
            validation (versions that passed them).
    """

    name: str
    platform: str = ""
    backend: str = ""
    versions: list[int] = field(default_factory=list)
    served_versions: list[int] = field(default_factory=list)
    results: list[CheckResult] = field(default_factory=list)
    config: cfgmod.ModelConfig | None = None
    completed: dict[int, cfgmod.ModelConfig] = field(default_factory=dict)

    @property
    def problems(self) -> list[Problem]:
        return [p for r in self.results for p in r.problems]

    @property
    def errors(self) -> int:
        return sum(p.severity == ERROR for p in self.problems)

    @property
    def ok(self) -> bool:
        return self.errors == 0

    def default_config(self) -> tuple[int, cfgmod.ModelConfig] | None:
        """The version ``serve`` would serve by default and its completed configuration."""
        for v in sorted(self.served_versions, reverse=True):
            if v in self.completed:
                return v, self.completed[v]
        return None

    def to_json(self) -> dict[str, Any]:
        """The model's report as a JSON object (the ``--format json`` schema)."""
        return {
            "name": self.name,
            "platform": self.platform,
            "backend": self.backend,
            "versions": self.versions,
            "served_versions": self.served_versions,
            "ok": self.ok,
            "checks": [r.to_json() for r in self.results],
        }


@dataclass
class Report:
    """The result of checking a repository."""

    repository: str
    models: list[ModelReport] = field(default_factory=list)
    results: list[CheckResult] = field(default_factory=list)  # repository-wide
    seconds: float = 0.0

    @property
    def all_results(self) -> list[CheckResult]:
        return self.results + [r for m in self.models for r in m.results]

    @property
    def problems(self) -> list[Problem]:
        return [p for r in self.all_results for p in r.problems]

    @property
    def errors(self) -> int:
        return sum(p.severity == ERROR for p in self.problems)

    @property
    def warnings(self) -> int:
        return sum(p.severity == WARNING for p in self.problems)

    @property
    def ok(self) -> bool:
        return self.errors == 0

    @property
    def exit_code(self) -> int:
        """0 when nothing is an error, else 1."""
        return 0 if self.ok else 1

    def to_json(self) -> dict[str, Any]:
        """The whole report (``--format json``)."""
        return {
            "repository": self.repository,
            "ok": self.ok,
            "seconds": round(self.seconds, 3),
            "summary": {
                "models": len(self.models),
                "versions": sum(len(m.versions) for m in self.models),
                "checks": len(self.all_results),
                "errors": self.errors,
                "warnings": self.warnings,
            },
            "models": [m.to_json() for m in self.models],
            "problems": [p.to_json() for p in self.problems],
        }


@dataclass
class CheckOptions:
    """How to check.

    Attributes:
        rules: the team's rules (``--rules``).
        timeout_s: seconds a python model may take to import and auto-complete.
        goldens: run golden inputs/outputs (``--no-goldens``: only the hashes).
        served_only: check only the versions the version policy selects.
        host_policies: host policy names the server is started with
            (``--host-policy``); an instance group naming another fails, as in serve.
    """

    rules: list[Rule] = field(default_factory=list)
    timeout_s: float = DEFAULT_TIMEOUT_S
    goldens: bool = True
    served_only: bool = False
    host_policies: frozenset[str] = frozenset()


# --------------------------------------------------------------------------- stages


async def _run(
    target: list[CheckResult],
    model: str,
    check: str,
    version: int | None,
    body: Callable[[CheckResult], Any],
) -> CheckResult:
    """Run one check; whatever it raises becomes a problem of that check."""
    result = CheckResult(model, check, version)
    started = time.perf_counter()
    try:
        out = body(result)
        if inspect.isawaitable(out):
            await out
    except cfgmod.ConfigError as e:
        result.add(e.message, e.path, e.field)
    except Exception as e:  # never crash: the problem is the exception
        result.add(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
    result.seconds = time.perf_counter() - started
    target.append(result)
    return result


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _guess_model_file(version_dir: Path, identity: dict[str, Any] | None) -> Path | None:
    """The model file when the configuration is unusable: the identity's, or a default name."""
    if identity and isinstance(identity.get("model_file"), str):
        return version_dir / identity["model_file"]
    for name in cfgmod.DEFAULT_MODEL_FILENAMES.values():
        if (version_dir / name).exists():
            return version_dir / name
    return None


def _read_identity(path: Path) -> dict[str, Any] | None:
    """MODEL_IDENTITY.json as a dict, None when it is unusable (the identity check says why)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class Checker:
    """Checks one repository (:meth:`run`); see the module docstring for the checks."""

    def __init__(self, repository: Path, options: CheckOptions | None = None) -> None:
        self.repository = Path(repository)
        self.options = options or CheckOptions()
        self.report = Report(str(repository))
        self.models: dict[str, ModelReport] = {}
        self._python: Backend | None = None
        #: ensemble -> its steps that lead back to it (:meth:`_ensemble_cycles`)
        self._cycles: dict[str, list[tuple[int, list[str]]]] = {}

    async def run(self) -> Report:
        """Check every model; the report.

        Raises:
            FileNotFoundError / NotADirectoryError: the repository does not exist.
        """
        started = time.perf_counter()
        found = layout.scan_repository(self.repository)
        if not found:
            await _run(
                self.report.results,
                "",
                "repository",
                None,
                lambda r: r.add(
                    "the repository holds no model folder", self.repository, "", WARNING
                ),
            )
        ensembles: list[layout.ModelDir] = []
        for name, mdir in found.items():
            mr = ModelReport(name, versions=list(mdir.versions))
            self.models[name] = mr
            self.report.models.append(mr)
            await _run(mr.results, name, "config", None, self._config_check(mdir, mr))
            if mr.config is not None and mr.config.platform == cfgmod.ENSEMBLE_PLATFORM:
                ensembles.append(mdir)
            else:
                await self._check_versions(mdir, mr)
        self._cycles = self._ensemble_cycles(self._ensemble_steps(ensembles))
        for mdir in self._ensemble_order(ensembles):
            await self._check_ensemble(mdir, self.models[mdir.name])
        for mr in self.report.models:
            await self._check_rules(mr)
        self.report.seconds = time.perf_counter() - started
        return self.report

    # -- config -----------------------------------------------------------------

    def _config_check(
        self, mdir: layout.ModelDir, mr: ModelReport
    ) -> Callable[[CheckResult], None]:
        return lambda r: self._config(r, mdir, mr)

    def _config(self, r: CheckResult, mdir: layout.ModelDir, mr: ModelReport) -> None:
        cfg = read_config(mdir)
        mr.config = cfg
        mr.platform, mr.backend = cfg.platform, cfg.backend
        try:
            read_traffic_file(mdir.path)
        except TrafficError as e:  # as serve: the model would fail to load
            r.add(str(e), mdir.path / TRAFFIC_FILENAME)
        if not mdir.versions:
            r.add(
                "no version folder: a model needs at least one numeric folder (1/, 2/ ...) "
                "holding its model file",
                mdir.path,
            )
            return
        mr.served_versions = layout.select_versions(cfg, mdir.versions)
        if not mr.served_versions:
            r.add(
                f"no version folder selected by the version policy (found {mdir.versions})",
                mdir.config_path,
                "version_policy",
            )
        missing = layout.missing_versions(cfg, mdir.versions)
        if missing:
            r.add(
                f"the version policy names version(s) {missing}, which have no folder "
                "(serve skips them)",
                mdir.config_path,
                "version_policy",
                WARNING,
            )

    def _versions_to_check(self, mdir: layout.ModelDir, mr: ModelReport) -> list[int]:
        if self.options.served_only and mr.config is not None:
            return list(mr.served_versions)
        return list(mdir.versions)

    def _backend(self, cfg: cfgmod.ModelConfig) -> Backend:
        if cfg.backend == cfgmod.PYTHON_BACKEND:
            if self._python is None:
                from pdserve.backends.python.backend import PythonBackend

                self._python = PythonBackend(
                    import_always=True, autocomplete_timeout_s=self.options.timeout_s
                )
            return self._python
        if cfg.backend == cfgmod.REMOTE_BACKEND:
            from pdserve.backends.remote.backend import OfflineRemoteBackend

            return OfflineRemoteBackend()  # a check does not call the target
        return backend_for(cfg)

    # -- versions of a non-ensemble model -----------------------------------------

    async def _check_versions(self, mdir: layout.ModelDir, mr: ModelReport) -> None:
        for v in self._versions_to_check(mdir, mr):
            await self._check_version(mdir, mr, v)

    async def _check_version(self, mdir: layout.ModelDir, mr: ModelReport, v: int) -> None:
        """The per-version checks of a model that is not an ensemble."""
        cfg = mr.config
        vdir = mdir.version_path(v)
        identity_path = vdir / IDENTITY_FILENAME
        identity = _read_identity(identity_path) if identity_path.is_file() else None
        model_path: Path | None = None
        if cfg is None:
            model_path = _guess_model_file(vdir, identity)
        else:
            try:
                model_path = cfgmod.model_file_path(cfg, vdir)
            except ValueError:
                model_path = None
        present = model_path is not None and model_path.is_file()
        is_onnx = model_path is not None and (
            cfg.backend == cfgmod.ONNXRUNTIME_BACKEND
            if cfg is not None
            else model_path.suffix == ".onnx"
        )

        def model_file(r: CheckResult) -> None:
            if cfg is None:
                r.skip("the configuration is unusable (see config)")
                return
            if cfg.backend == cfgmod.REMOTE_BACKEND:
                r.skip("a remote model has no model file: its target is checked at load")
                return
            try:
                cfgmod.find_model_file(cfg, vdir)
            except FileNotFoundError as e:
                r.add(str(e), vdir)

        await _run(mr.results, mr.name, "model-file", v, model_file)
        if is_onnx and present and model_path is not None:
            onnx_file = model_path
            await _run(
                mr.results, mr.name, "onnx-checker", v, lambda r: _onnx_checker(r, onnx_file)
            )
        if cfg is not None:

            async def complete(r: CheckResult) -> None:
                if not present and cfg.backend != cfgmod.REMOTE_BACKEND:
                    r.skip("no model file")
                    return
                await self._complete(r, mdir, mr, v, vdir, self._backend(cfg), model_path)

            name = {
                cfgmod.ONNXRUNTIME_BACKEND: "onnx-config",
                cfgmod.PYTHON_BACKEND: "python-import",
                cfgmod.PYTORCH_BACKEND: "pytorch-config",
            }.get(cfg.backend, "complete")
            await _run(mr.results, mr.name, name, v, complete)
            if cfg.model_warmup:
                await _run(mr.results, mr.name, "warmup", v, lambda r: self._warmup(r, mdir, mr, v))
        if identity_path.is_file():
            await _run(
                mr.results,
                mr.name,
                "identity",
                v,
                lambda r: _identity(r, identity_path, mdir, v, model_path),
            )
            golden = identity.get("golden") if identity is not None else None
            if golden is not None and self.options.goldens:
                is_torch = cfg is not None and cfg.backend == cfgmod.PYTORCH_BACKEND
                runnable = model_path if (is_onnx or is_torch) and present else None
                if is_torch and cfg is not None:
                    torch_cfg = mr.completed.get(v, cfg)
                    await _run(
                        mr.results,
                        mr.name,
                        "golden",
                        v,
                        lambda r: _torch_golden(r, golden, vdir, runnable, torch_cfg, mr.name),
                    )
                else:
                    await _run(
                        mr.results,
                        mr.name,
                        "golden",
                        v,
                        lambda r: _golden(r, golden, vdir, runnable, is_onnx),
                    )

    async def _complete(
        self,
        r: CheckResult,
        mdir: layout.ModelDir,
        mr: ModelReport,
        version: int,
        vdir: Path,
        backend: Backend,
        model_path: Path | None = None,
    ) -> None:
        """What serve does before loading the version; its completed config in ``mr``."""
        assert mr.config is not None
        spec = ModelSpec(
            name=mr.name,
            version=version,
            config=copy.deepcopy(mr.config),
            model_dir=mdir.path,
            version_dir=vdir,
            repository=self.repository,
        )
        policies = {n: frozenset[int]() for n in self.options.host_policies}
        errors: list[cfgmod.ConfigError] = []
        try:
            warnings = await complete_config(spec, backend, policies, errors=errors)
        except Exception as exc:
            # auto-complete failed, so validation did not run: report what it finds in
            # the configuration as written too (checks auto-complete could satisfy skipped;
            # a field auto-complete already complained about is not repeated)
            cfgmod.validate_config(
                copy.deepcopy(mr.config),
                mdir.config_path,
                model_dir=mdir.path,
                complete=False,
                errors=errors,
            )
            if isinstance(exc, cfgmod.ConfigError):
                r.add(exc.message, exc.path, exc.field)
            else:  # the backend could not open the model file (ONNX Runtime's error)
                r.add(f"{type(exc).__name__}: {exc}", model_path or vdir)
            for e in errors:
                if not isinstance(exc, cfgmod.ConfigError) or e.field != exc.field:
                    r.add(e.message, e.path, e.field)
            return
        for e in errors:
            r.add(e.message, e.path, e.field)
        for w in warnings:
            r.add(w, severity=WARNING)
        if not errors:
            mr.completed[version] = spec.config

    async def _warmup(
        self, r: CheckResult, mdir: layout.ModelDir, mr: ModelReport, version: int
    ) -> None:
        """``model_warmup`` as serve checks it before running the samples
        (:func:`pdserve.repository.warmup.check_samples`), on the completed configuration."""
        completed = mr.completed.get(version)
        if completed is None:
            r.skip("the configuration did not pass the checks above")
            return
        spec = ModelSpec(
            name=mr.name,
            version=version,
            config=copy.deepcopy(completed),
            model_dir=mdir.path,
            version_dir=mdir.version_path(version),
            repository=self.repository,
        )
        mv = ModelVersion(spec, completed.platform or completed.backend, completed.backend)
        for problem in await check_samples(mv):
            r.add(str(problem), mdir.config_path, problem.field)

    # -- ensembles ------------------------------------------------------------------

    def _ensemble_steps(self, ensembles: list[layout.ModelDir]) -> dict[str, list[str]]:
        """Ensemble name -> the model name of each of its steps, in order."""
        steps: dict[str, list[str]] = {}
        for m in ensembles:
            cfg = self.models[m.name].config
            steps[m.name] = [s.model_name for s in cfg.ensemble_scheduling.step] if cfg else []
        return steps

    @staticmethod
    def _ensemble_cycles(steps: dict[str, list[str]]) -> dict[str, list[tuple[int, list[str]]]]:
        """Circular dependencies between ensembles (A steps into B, which steps into A).

        Returns:
            ensemble -> ``(step index, cycle)`` for each of its steps that leads back to
            it, ``cycle`` the shortest path of ensemble names from it back to it
            (``[A, B, A]``). Every ensemble of a cycle is in the map, each with its own
            steps: Triton's ``CircularDependencyCheck`` marks every node of the cycle.
        """
        found: dict[str, list[tuple[int, list[str]]]] = {}
        for start, models in steps.items():
            for index, first in enumerate(models):
                if first not in steps:
                    continue
                # breadth first from the step's ensemble until ``start`` is reached
                parent: dict[str, str | None] = {first: None}
                queue = deque([first])
                while queue and start not in parent:
                    node = queue.popleft()
                    for nxt in steps[node]:
                        if nxt in steps and nxt not in parent:
                            parent[nxt] = node
                            queue.append(nxt)
                if start not in parent:
                    continue
                chain: list[str] = []
                at: str | None = start
                while at is not None:
                    chain.append(at)
                    at = parent[at]
                found.setdefault(start, []).append((index, [start, *chain[::-1]]))
        return found

    def _ensemble_order(self, ensembles: list[layout.ModelDir]) -> list[layout.ModelDir]:
        """Ensembles whose steps are ensembles come after those; a step into a cycle
        (reported as such, never validated) does not order."""
        names = {m.name for m in ensembles}
        steps = {n: set(models) & names for n, models in self._ensemble_steps(ensembles).items()}
        for name, cycles in self._cycles.items():
            steps[name] -= {cycle[1] for _, cycle in cycles}
        done: set[str] = set()
        order: list[layout.ModelDir] = []
        todo = list(ensembles)
        while todo:
            ready = [m for m in todo if not steps[m.name] - done] or todo[:1]
            for m in ready:
                todo.remove(m)
                done.add(m.name)
                order.append(m)
        return order

    def _step_lookup(self, model_name: str, version: str) -> cfgmod.ModelConfig | None:
        other = self.models.get(model_name)
        if other is None:
            return None
        if not version:
            found = other.default_config()
            return found[1] if found else None
        v = int(version)
        return other.completed.get(v) if v in other.served_versions else None

    async def _check_ensemble(self, mdir: layout.ModelDir, mr: ModelReport) -> None:
        cfg = mr.config
        assert cfg is not None
        backend = EnsembleBackend(self._step_lookup)
        for v in self._versions_to_check(mdir, mr):
            vdir = mdir.version_path(v)

            async def body(r: CheckResult, v: int = v, vdir: Path = vdir) -> None:
                # every problem of the steps is reported before giving up on the wiring
                blocked = False
                for i, cycle in self._cycles.get(mr.name, []):
                    r.add(
                        "circular dependency between ensembles: " + " -> ".join(cycle),
                        mdir.config_path,
                        f"ensemble_scheduling.step[{i}].model_name",
                    )
                    blocked = True
                in_cycle = {i for i, _ in self._cycles.get(mr.name, [])}
                broken: list[str] = []
                for i, step in enumerate(cfg.ensemble_scheduling.step):
                    if i in in_cycle:
                        continue
                    other = self.models.get(step.model_name)
                    if other is None and step.model_name:
                        r.add(
                            f"ensemble '{mr.name}': step {i} uses model '{step.model_name}', "
                            "which is not in the repository",
                            mdir.config_path,
                            f"ensemble_scheduling.step[{i}].model_name",
                        )
                        blocked = True
                    elif other is not None and not other.ok:
                        broken.append(f"step {i} uses model '{step.model_name}'")
                if broken and not blocked:
                    r.skip(
                        f"{', '.join(broken)}, which "
                        + ("has" if len(broken) == 1 else "have")
                        + " problems of "
                        + ("its" if len(broken) == 1 else "their")
                        + " own (fix them first)"
                    )
                if blocked or broken:
                    # the wiring cannot be validated without every step; the rest of the
                    # configuration can (as when auto-complete fails)
                    errors: list[cfgmod.ConfigError] = []
                    assert mr.config is not None
                    cfgmod.validate_config(
                        copy.deepcopy(mr.config),
                        mdir.config_path,
                        model_dir=mdir.path,
                        complete=False,
                        errors=errors,
                    )
                    for e in errors:
                        r.add(e.message, e.path, e.field)
                    return
                await self._complete(r, mdir, mr, v, vdir, backend)

            await _run(mr.results, mr.name, "ensemble", v, body)

    # -- rules ----------------------------------------------------------------------

    async def _check_rules(self, mr: ModelReport) -> None:
        if not self.options.rules or mr.config is None:
            return
        found = mr.default_config()
        kind = (
            cfgmod.ENSEMBLE_PLATFORM
            if mr.config.platform == cfgmod.ENSEMBLE_PLATFORM
            else mr.config.backend
        )
        for rule in self.options.rules:
            if not rule.applies_to(mr.name, kind):
                continue

            def body(r: CheckResult, rule: Rule = rule) -> None:
                if found is None:
                    r.skip("no version passed the configuration checks")
                    return
                for message in rule.evaluate(cfgmod.config_to_json(found[1])):
                    text = f"{message} ({rule.message})" if rule.message else message
                    r.add(
                        text, self.repository / mr.name / cfgmod.CONFIG_FILENAME, "", rule.severity
                    )

            await _run(mr.results, mr.name, f"rule:{rule.name}", found[0] if found else None, body)


# --------------------------------------------------------------------------- file checks


def _onnx_checker(r: CheckResult, path: Path) -> None:
    """``onnx.checker.check_model(full_check=True)`` on a model file."""
    if importlib.util.find_spec("onnx") is None:
        reason = (
            f"the onnx package is not installed: pip install 'pdserve[{ONNX_EXTRA}]' "
            "to run onnx.checker"
        )
        r.skip(reason)
        r.add(reason, path, severity=WARNING)
        return
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as e:
        r.add(f"onnx.checker: {str(e).strip()}", path)
    except Exception as e:  # not even a protobuf: DecodeError, shape inference errors
        r.add(f"not a valid ONNX model: {type(e).__name__}: {str(e).strip()}", path)


def _identity(
    r: CheckResult, path: Path, mdir: layout.ModelDir, version: int, model_path: Path | None
) -> None:
    """MODEL_IDENTITY.json: parses, names this model and version and the file served,
    and the file's sha256 and size are the recorded ones."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        r.add(f"not valid JSON: {e}", path)
        return
    if not isinstance(data, dict):
        r.add("must hold a JSON object", path)
        return
    if "model" in data and data["model"] != mdir.name:
        r.add(
            f"records model {data['model']!r}, but it is in the folder of '{mdir.name}'",
            path,
            "model",
        )
    if "version" in data and data["version"] != version:
        r.add(
            f"records version {data['version']!r}, but it is in version folder {version}",
            path,
            "version",
        )
    recorded = data.get("model_file")
    if recorded is not None and not isinstance(recorded, str):
        r.add("must be a file name", path, "model_file")
        return
    vdir = mdir.version_path(version)
    if recorded and not _inside(vdir, vdir / recorded):
        r.add(f"'{recorded}' is not a file of the version folder {vdir}", path, "model_file")
        return
    target = vdir / recorded if recorded else model_path
    if target is None:
        r.skip("no model file to verify (no model_file and an unusable configuration)")
        return
    if recorded and model_path is not None and target.resolve() != model_path.resolve():
        r.add(
            f"describes '{recorded}', but the configuration loads '{model_path.name}'",
            path,
            "model_file",
        )
    if not target.is_file():
        r.add(f"model file {target} does not exist", path, "model_file")
        return
    sha = data.get("sha256")
    if sha is None:
        r.add("records no sha256: the model file cannot be verified", path, "sha256", WARNING)
    elif not isinstance(sha, str):
        r.add("must be a hex string", path, "sha256")
    else:
        actual = _sha256(target)
        if actual != sha.lower():
            r.add(
                f"{target.name} has sha256 {actual}, but {path.name} records {sha}: the model "
                "file is not the one recorded",
                path,
                "sha256",
            )
    size = data.get("size_bytes")
    if isinstance(size, int) and not isinstance(size, bool):
        actual_size = target.stat().st_size
        if actual_size != size:
            r.add(
                f"{target.name} has {actual_size} bytes, {path.name} records {size}",
                path,
                "size_bytes",
            )


def _golden_arrays(
    r: CheckResult, golden: Any, vdir: Path
) -> tuple[dict[str, str], dict[str, str], float, float, dict[str, np.ndarray], Path] | None:
    """Read and check a golden entry and its npz; None (problem recorded) when unusable."""
    where = vdir / IDENTITY_FILENAME
    if not isinstance(golden, dict) or not isinstance(golden.get("file"), str):
        r.add("must be an object {file, inputs, outputs, atol, rtol}", where, "golden")
        return None
    inputs, outputs = golden.get("inputs"), golden.get("outputs")
    atol, rtol = golden.get("atol", 0.0), golden.get("rtol", 0.0)
    if not (_str_map(inputs) and _str_map(outputs) and outputs and _tolerance(atol)) or not (
        _tolerance(rtol) and isinstance(inputs, dict) and isinstance(outputs, dict)
    ):
        r.add("malformed golden entry (want file, inputs, outputs, atol, rtol)", where, "golden")
        return None
    npz_path = vdir / golden["file"]
    if not _inside(vdir, npz_path):
        r.add(f"'{golden['file']}' is not a file of the version folder {vdir}", where)
        return None
    try:
        with np.load(npz_path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as e:
        r.add(f"cannot read {npz_path.name}: {type(e).__name__}: {e}", npz_path)
        return None
    missing = [k for k in (*inputs.values(), *outputs.values()) if k not in arrays]
    if missing:
        r.add(f"{npz_path.name} has no array(s) {', '.join(missing)}", npz_path)
        return None
    return inputs, outputs, float(atol), float(rtol), arrays, npz_path


def _torch_golden(
    r: CheckResult,
    golden: Any,
    vdir: Path,
    model_path: Path | None,
    cfg: cfgmod.ModelConfig,
    model: str,
) -> None:
    """The golden check of a PyTorch model: the stored inputs through the model on the
    CPU (the backend's own loading and naming conventions), compared like ONNX's."""
    read = _golden_arrays(r, golden, vdir)
    if read is None:
        return
    inputs, outputs, atol, rtol, arrays, npz_path = read
    if model_path is None:
        r.skip("no model file")
        return
    from pdserve.backends.registry import unavailable_reason

    reason = unavailable_reason(cfgmod.PYTORCH_BACKEND)
    if reason:
        r.skip(reason)
        return
    from pdserve.backends.pytorch.backend import run_on_cpu

    try:
        got = run_on_cpu(
            model, cfg, vdir, {name: arrays[key] for name, key in inputs.items()}, list(outputs)
        )
    except Exception as e:
        r.add(f"running the golden inputs failed: {type(e).__name__}: {e}", npz_path)
        return
    for name, key in outputs.items():
        problem = _compare(np.asarray(got[name]), arrays[key], atol, rtol)
        if problem:
            r.add(f"output '{name}': {problem}", npz_path, name)


def _golden(
    r: CheckResult, golden: Any, vdir: Path, model_path: Path | None, is_onnx: bool
) -> None:
    """Run the stored golden inputs through the model file; compare with the stored outputs.

    Args:
        golden: MODEL_IDENTITY.json's ``golden`` entry.
        model_path: the ONNX model file (None: missing).
        is_onnx: whether the model is an ONNX model (others are skipped).
    """
    where = vdir / IDENTITY_FILENAME
    if not isinstance(golden, dict):
        r.add("must be an object {file, inputs, outputs, atol, rtol}", where, "golden")
        return
    file_name = golden.get("file")
    inputs, outputs = golden.get("inputs"), golden.get("outputs")
    atol, rtol = golden.get("atol", 0.0), golden.get("rtol", 0.0)
    bad = [
        f"golden.{k}"
        for k, ok in (
            ("file", isinstance(file_name, str) and file_name),
            ("inputs", _str_map(inputs)),
            ("outputs", _str_map(outputs) and outputs),
            ("atol", _tolerance(atol)),
            ("rtol", _tolerance(rtol)),
        )
        if not ok
    ]
    if (
        bad
        or not isinstance(file_name, str)
        or not isinstance(inputs, dict)
        or not isinstance(outputs, dict)
    ):
        r.add(
            f"malformed golden entry: {', '.join(bad)} (want file: name, inputs/outputs: "
            "{tensor: npz key}, atol/rtol: numbers >= 0)",
            where,
            bad[0] if bad else "golden",
        )
        return
    if not _inside(vdir, vdir / file_name):
        r.add(f"'{file_name}' is not a file of the version folder {vdir}", where, "golden.file")
        return
    if not is_onnx:
        r.skip("golden outputs are run for ONNX models only (a python model's need its workers)")
        return
    if model_path is None:
        r.skip("no model file")
        return
    npz_path = vdir / file_name
    try:
        with np.load(npz_path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except Exception as e:
        r.add(f"cannot read {npz_path.name}: {type(e).__name__}: {e}", npz_path)
        return
    missing = [k for k in (*inputs.values(), *outputs.values()) if k not in arrays]
    if missing:
        r.add(f"{npz_path.name} has no array(s) {', '.join(missing)}", npz_path)
        return
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(
            str(model_path), sess_options=options, providers=["CPUExecutionProvider"]
        )
    except Exception as e:
        r.skip(f"ONNX Runtime cannot open the model ({type(e).__name__})")
        return
    types = {i.name: i.type for i in session.get_inputs()}
    unknown = [n for n in inputs if n not in types]
    known_out = {o.name for o in session.get_outputs()}
    unknown += [n for n in outputs if n not in known_out]
    if unknown:
        r.add(
            f"golden names tensor(s) {', '.join(unknown)} the model does not have "
            f"(inputs {sorted(types)}, outputs {sorted(known_out)})",
            where,
            "golden",
        )
        return
    feeds = {}
    for name, key in inputs.items():
        array = arrays[key]
        if types[name] == "tensor(string)":
            array = array.astype(object)
        feeds[name] = array
    try:
        got = session.run(list(outputs), feeds)
    except Exception as e:
        r.add(f"running the golden inputs failed: {type(e).__name__}: {e}", npz_path)
        return
    for (name, key), value in zip(outputs.items(), got, strict=True):
        problem = _compare(np.asarray(value), arrays[key], float(atol), float(rtol))
        if problem:
            r.add(f"output '{name}': {problem}", npz_path, name)


def _inside(folder: Path, path: Path) -> bool:
    """Whether ``path`` names something in ``folder`` (lexically: a symlink there counts)."""
    rel = os.path.normpath(os.path.relpath(path, folder))
    return not os.path.isabs(rel) and rel != ".." and not rel.startswith(".." + os.sep)


def _str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _tolerance(value: Any) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value >= 0
    )


def _compare(got: np.ndarray, want: np.ndarray, atol: float, rtol: float) -> str | None:
    """Why ``got`` does not reproduce ``want``, or None when it does."""
    if want.dtype.kind in "US":
        if got.shape != want.shape:
            return f"shape {list(got.shape)}, golden {list(want.shape)}"
        same = np.array_equal(got.astype(str), want.astype(str))
        return None if same else "strings differ from the golden ones"
    if got.dtype != want.dtype:
        return f"datatype {got.dtype}, golden {want.dtype}"
    if got.shape != want.shape:
        return f"shape {list(got.shape)}, golden {list(want.shape)}"
    if want.dtype.kind in "fc":
        g, w = got.astype(np.float64), want.astype(np.float64)
        close = np.isclose(g, w, atol=atol, rtol=rtol, equal_nan=True)
        if close.all():
            return None
        diff = np.abs(g - w)
        diff[np.isnan(diff)] = np.inf
        worst = np.unravel_index(int(np.argmax(diff)), diff.shape)
        return (
            f"{int((~close).sum())} of {close.size} values differ by more than atol {atol:g} + "
            f"rtol {rtol:g} * |golden|; the largest: {g[worst]:.6g} vs golden {w[worst]:.6g} "
            f"at {list(int(i) for i in worst)}"
        )
    if np.array_equal(got, want):
        return None
    wrong = int((got != want).sum())
    return f"{wrong} of {want.size} values differ from the golden ones (exact match required)"


# --------------------------------------------------------------------------- entry points


def check_repository(repository: Path, options: CheckOptions | None = None) -> Report:
    """Check a model repository; the report (see the module docstring).

    Runs its own event loop (python models are imported in worker processes).

    Raises:
        FileNotFoundError / NotADirectoryError: the repository does not exist.
    """
    return asyncio.run(Checker(repository, options).run())


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``pdserve check`` to the CLI's subcommands; its defaults set ``run``."""
    p = sub.add_parser(
        "check",
        help="lint a model repository for CI (loads nothing into a server)",
        description="Check every model of a Triton-layout model repository as `pdserve serve` "
        "would load it, without serving: configurations (same code and messages as serve), "
        "ONNX files (onnx.checker, inputs/outputs against the configuration), ensemble "
        "wiring, python models (imported in a worker process), MODEL_IDENTITY.json hashes "
        "and golden outputs, and the team's --rules. Every problem is reported. Exit code: "
        "0 no errors, 1 errors, 2 usage.",
    )
    p.add_argument(
        "repository",
        type=_repository_arg,
        help="the model repository folder, or an fsspec URL (s3://bucket/prefix...: "
        "downloaded to a temporary folder first)",
    )
    p.add_argument(
        "--rules",
        type=Path,
        metavar="FILE",
        help="TOML rules file (README: 'Checking a repository')",
    )
    p.add_argument(
        "--format",
        choices=("human", "json", "junit"),
        default="human",
        help="report format (default %(default)s)",
    )
    p.add_argument(
        "-o",
        "--output",
        type=Path,
        metavar="FILE",
        help="write the report to FILE instead of stdout (a one-line summary still goes to stderr)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds a python model may take to import and run auto_complete_config "
        "(default %(default)g)",
    )
    p.add_argument("--no-goldens", action="store_true", help="skip golden inputs/outputs")
    p.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="human format: list every check run, with its time (and why one was skipped)",
    )
    p.add_argument(
        "--served-only",
        action="store_true",
        help="check only the versions the version policy selects (default: every version folder)",
    )
    p.add_argument(
        "--host-policy",
        action="append",
        default=[],
        metavar="NAME[,SETTING=VALUE]",
        help="a host policy the server is started with (as serve's flag; only NAME counts): "
        "instance groups may name it (repeatable)",
    )
    p.add_argument(
        "--version-ready-marker",
        default="",
        metavar="FILENAME",
        help="as serve's flag: only version folders holding this file (e.g. READY) are "
        "versions; the others are not checked (default: off)",
    )
    p.add_argument(
        "--max-instance-count",
        type=int,
        default=cfgmod.DEFAULT_MAX_INSTANCE_COUNT,
        metavar="N",
        help="most instances a model may ask for, as serve's flag (default %(default)s)",
    )
    p.set_defaults(run=run)
    return p


def _repository_arg(text: str) -> Path | str:
    """A repository URL stays a string (see :mod:`pdserve.repository.remote_store`)."""
    from pdserve.repository.remote_store import is_remote_url

    return text if is_remote_url(text) else Path(text)


def run(args: argparse.Namespace) -> int:
    """Run ``pdserve check``; the process exit code (0 clean, 1 problems, 2 usage)."""
    if isinstance(args.repository, str):
        import tempfile

        from pdserve.repository.remote_store import RemoteRepository, StoreUnavailable

        with tempfile.TemporaryDirectory(prefix="pdserve-check-") as tmp:
            try:
                remote = RemoteRepository(args.repository, Path(tmp))
                remote.sync()
            except (ImportError, ValueError, StoreUnavailable) as e:
                print(f"pdserve check: {args.repository}: {e}", file=sys.stderr)
                return 2
            args.repository = remote.local_path
            return run(args)
    from .check_output import render

    if not args.timeout > 0:
        print("pdserve check: --timeout must be a positive number of seconds", file=sys.stderr)
        return 2
    if args.max_instance_count < 1:
        print("pdserve check: --max-instance-count must be >= 1", file=sys.stderr)
        return 2
    cfgmod.set_max_instance_count(args.max_instance_count)
    try:
        layout.set_ready_marker(args.version_ready_marker or None)
    except ValueError as e:
        print(f"pdserve check: --version-ready-marker: {e}", file=sys.stderr)
        return 2
    try:
        rules = load_rules(args.rules) if args.rules is not None else []
    except RulesError as e:
        print(f"pdserve check: {e}", file=sys.stderr)
        return 2
    options = CheckOptions(
        rules=rules,
        timeout_s=args.timeout,
        goldens=not args.no_goldens,
        served_only=args.served_only,
        host_policies=frozenset(h.split(",", 1)[0] for h in args.host_policy),
    )
    # What model code and libraries print while they are checked (a python model's
    # import, ONNX Runtime) goes to stderr: stdout carries only the report, which a
    # CI job may parse. Worker processes inherit the redirection.
    sys.stdout.flush()
    real_stdout = os.dup(1)
    os.dup2(2, 1)
    try:
        report = check_repository(args.repository, options)
    except (FileNotFoundError, NotADirectoryError) as e:
        print(f"pdserve check: {e}", file=sys.stderr)
        return 2
    finally:
        sys.stdout.flush()
        os.dup2(real_stdout, 1)
        os.close(real_stdout)
    color = args.output is None and sys.stdout.isatty() and "NO_COLOR" not in os.environ
    text = render(report, args.format, color=color, verbose=args.verbose)
    if args.output is not None:
        try:
            args.output.write_text(text, encoding="utf-8")
        except OSError as e:
            print(f"pdserve check: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
            return 2
        print(render(report, "summary"), file=sys.stderr)
    else:
        sys.stdout.write(text)
    return report.exit_code
