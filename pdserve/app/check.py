"""``pdserve check REPO``: lint a model repository for CI, serving nothing.

Every model goes through the checks ``serve`` would make before loading it, with
serve's code and messages: ``config``, ``model-file``, ``onnx-checker``, the backend's
auto-complete (``onnx-config`` / ``python-import`` / ``pytorch-config`` / ``ensemble``),
``warmup``, ``health``, ``identity``, ``golden`` and each ``rule:<name>`` of ``--rules``
(the docs/tools/check.md says what each proves). A failing check never stops
the others, so one run reports every problem. Nothing is loaded into a server: ONNX
models are opened with ONNX Runtime on the CPU, python models are imported in a
worker process.

Exit code: 0 no errors (warnings allowed), 1 errors, 2 usage (bad arguments, no
such repository, a bad rules file).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import inspect
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from pdserve import config as cfgmod
from pdserve.backends.base import Backend, ModelSpec
from pdserve.observability.monitoring.monitor import validate as validate_monitoring
from pdserve.observability.monitoring.spec import SpecError
from pdserve.repository import layout
from pdserve.repository.health import DEFAULT_HANG_TIMEOUT_S, HEALTH_PARAMETERS, health_params
from pdserve.repository.model import ModelVersion
from pdserve.repository.prepare import backend_for, complete_config, read_config
from pdserve.repository.traffic import TRAFFIC_FILENAME, TrafficError, read_traffic_file
from pdserve.repository.warmup import check_samples
from pdserve.scheduling.ensemble import EnsembleBackend

from .check_backend_golden import check_backend_golden, runs_golden
from .check_ensembles import Cycles, ensemble_cycles, ensemble_order
from .check_files import (
    IDENTITY_FILENAME,
    check_identity,
    check_onnx_file,
    guess_model_file,
    read_identity,
)
from .check_golden import check_fil_golden, check_golden, check_torch_golden
from .check_output import render
from .check_python_golden import check_python_golden
from .check_report import WARNING, CheckResult, ModelReport, Report
from .check_rules import Rule, RulesError, load_rules

#: Seconds a python model may take to import and run ``auto_complete_config``.
DEFAULT_TIMEOUT_S = 60.0


@dataclass
class CheckOptions:
    """How to check.

    Attributes:
        rules: the team's rules (``--rules``).
        timeout_s: seconds a python model may take to import and auto-complete (and,
            for its golden check, to initialize and then to answer).
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
    body: Callable[[CheckResult], Awaitable[None] | None],
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


def _validate_as_written(
    mdir: layout.ModelDir, mr: ModelReport, errors: list[cfgmod.ConfigError]
) -> None:
    """Validate the model's configuration as written (no auto-complete: the checks it
    could satisfy are skipped) into ``errors``."""
    assert mr.config is not None
    cfgmod.validate_config(
        copy.deepcopy(mr.config),
        mdir.config_path,
        model_dir=mdir.path,
        complete=False,
        errors=errors,
    )


class Checker:
    """Checks one repository (:meth:`run`); see the module docstring for the checks."""

    def __init__(self, repository: Path, options: CheckOptions | None = None) -> None:
        self.repository = Path(repository)
        self.options = options or CheckOptions()
        self.report = Report(str(repository))
        self.models: dict[str, ModelReport] = {}
        self._python: Backend | None = None
        #: ensemble -> its steps that lead back to it
        self._cycles: Cycles = {}

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
        steps = self._ensemble_steps(ensembles)
        self._cycles = ensemble_cycles(steps)
        for mdir in ensemble_order(ensembles, steps, self._cycles):
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
        try:  # payload_log / prediction_metrics / drift and the drift reference file
            validate_monitoring(cfg, mdir.path)
        except SpecError as e:
            r.add(f"monitoring: {e}", mdir.config_path, "parameters")
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
        identity = read_identity(identity_path) if identity_path.is_file() else None
        model_path: Path | None = None
        if cfg is None:
            model_path = guess_model_file(vdir, identity)
        else:
            try:
                model_path = cfgmod.model_file_path(cfg, vdir)
            except ValueError:
                model_path = None
        present = model_path is not None and (
            model_path.is_file()
            or (model_path.is_dir() and cfg is not None and cfgmod.model_may_be_folder(cfg))
        )
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
                mr.results, mr.name, "onnx-checker", v, lambda r: check_onnx_file(r, onnx_file)
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
                cfgmod.FIL_BACKEND: "fil-config",
                cfgmod.OPENVINO_BACKEND: "openvino-config",
                cfgmod.TENSORFLOW_BACKEND: "tensorflow-config",
            }.get(cfg.backend, "complete")
            await _run(mr.results, mr.name, name, v, complete)
            if cfg.model_warmup:
                await _run(mr.results, mr.name, "warmup", v, lambda r: self._warmup(r, mdir, mr, v))
            if HEALTH_PARAMETERS.intersection(cfg.parameters):
                await _run(mr.results, mr.name, "health", v, lambda r: self._health(r, mdir, mr, v))
        if identity_path.is_file():
            await _run(
                mr.results,
                mr.name,
                "identity",
                v,
                lambda r: check_identity(r, identity_path, mdir, v, model_path),
            )
            golden = identity.get("golden") if identity is not None else None
            if golden is not None and self.options.goldens:
                await self._golden(mdir, mr, v, golden, model_path if present else None, is_onnx)

    async def _golden(
        self,
        mdir: layout.ModelDir,
        mr: ModelReport,
        v: int,
        golden: object,
        model_path: Path | None,
        is_onnx: bool,
    ) -> None:
        """The ``golden`` check of one version, by the model's backend."""
        cfg, vdir = mr.config, mdir.version_path(v)
        is_torch = cfg is not None and cfg.backend == cfgmod.PYTORCH_BACKEND
        runnable = model_path if is_onnx or is_torch else None
        if runs_golden(cfg):
            await _run(
                mr.results,
                mr.name,
                "golden",
                v,
                lambda r: self._backend_golden(r, golden, mdir, mr, v),
            )
        elif cfg is not None and cfg.backend == cfgmod.PYTHON_BACKEND:
            await _run(
                mr.results,
                mr.name,
                "golden",
                v,
                lambda r: self._python_golden(r, golden, mdir, mr, v),
            )
        elif is_torch and cfg is not None:
            torch_cfg = mr.completed.get(v, cfg)
            await _run(
                mr.results,
                mr.name,
                "golden",
                v,
                lambda r: check_torch_golden(r, golden, vdir, runnable, torch_cfg, mr.name),
            )
        elif cfg is not None and cfg.backend == cfgmod.FIL_BACKEND:
            fil_cfg = mr.completed.get(v)
            await _run(
                mr.results,
                mr.name,
                "golden",
                v,
                lambda r: check_fil_golden(r, golden, vdir, model_path, fil_cfg),
            )
        else:
            await _run(
                mr.results,
                mr.name,
                "golden",
                v,
                lambda r: check_golden(r, golden, vdir, runnable, is_onnx),
            )

    async def _python_golden(
        self, r: CheckResult, golden: object, mdir: layout.ModelDir, mr: ModelReport, v: int
    ) -> None:
        """The golden inputs through a python model's worker, on its completed
        configuration (:func:`~.check_python_golden.check_python_golden`)."""
        spec = self._completed_spec(r, mdir, mr, v)
        if spec is not None:
            await check_python_golden(r, golden, spec, self.options.timeout_s)

    async def _backend_golden(
        self, r: CheckResult, golden: object, mdir: layout.ModelDir, mr: ModelReport, v: int
    ) -> None:
        """The golden inputs through one CPU instance of a framework backend
        (:func:`~.check_backend_golden.check_backend_golden`)."""
        spec = self._completed_spec(r, mdir, mr, v)
        if spec is not None:
            await check_backend_golden(r, golden, spec)

    def _spec(
        self, mdir: layout.ModelDir, mr: ModelReport, version: int, config: cfgmod.ModelConfig
    ) -> ModelSpec:
        """The load spec serve builds for ``version``, on a copy of ``config``."""
        return ModelSpec(
            name=mr.name,
            version=version,
            config=copy.deepcopy(config),
            model_dir=mdir.path,
            version_dir=mdir.version_path(version),
            repository=self.repository,
        )

    def _completed_spec(
        self, r: CheckResult, mdir: layout.ModelDir, mr: ModelReport, version: int
    ) -> ModelSpec | None:
        """:meth:`_spec` on the version's completed configuration; None (``r`` skipped)
        when the configuration did not pass the checks before."""
        completed = mr.completed.get(version)
        if completed is None:
            r.skip("the configuration did not pass the checks above")
            return None
        return self._spec(mdir, mr, version, completed)

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
        spec = self._spec(mdir, mr, version, mr.config)
        policies = {n: frozenset[int]() for n in self.options.host_policies}
        errors: list[cfgmod.ConfigError] = []
        try:
            warnings = await complete_config(spec, backend, policies, errors=errors)
        except Exception as exc:
            # auto-complete failed, so validation did not run: report what it finds in
            # the configuration as written too (checks auto-complete could satisfy skipped;
            # a field auto-complete already complained about is not repeated)
            _validate_as_written(mdir, mr, errors)
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
        spec = self._completed_spec(r, mdir, mr, version)
        if spec is None:
            return
        cfg = spec.config
        mv = ModelVersion(spec, cfg.platform or cfg.backend, cfg.backend)
        for problem in await check_samples(mv):
            r.add(str(problem), mdir.config_path, problem.field)

    async def _health(
        self, r: CheckResult, mdir: layout.ModelDir, mr: ModelReport, version: int
    ) -> None:
        """The health parameters (hang bound, readiness hook and probe settings, the
        probe's input) as a load checks them (:func:`pdserve.repository.health.health_params`)."""
        spec = self._completed_spec(r, mdir, mr, version)
        if spec is None:
            return
        cfg = spec.config
        mv = ModelVersion(spec, cfg.platform or cfg.backend, cfg.backend)
        try:
            health_params(mv, DEFAULT_HANG_TIMEOUT_S, str(mdir.config_path))
        except cfgmod.ConfigError as e:
            r.add(e.message, mdir.config_path, e.field)

    # -- ensembles ------------------------------------------------------------------
    def _ensemble_steps(self, ensembles: list[layout.ModelDir]) -> dict[str, list[str]]:
        """Ensemble name -> the model name of each of its steps, in order."""
        steps: dict[str, list[str]] = {}
        for m in ensembles:
            cfg = self.models[m.name].config
            steps[m.name] = [s.model_name for s in cfg.ensemble_scheduling.step] if cfg else []
        return steps

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
                    _validate_as_written(mdir, mr, errors)
                    for e in errors:
                        r.add(e.message, e.path, e.field)
                    return
                await self._complete(r, mdir, mr, v, vdir, backend)

            await _run(mr.results, mr.name, "ensemble", v, body)
            if HEALTH_PARAMETERS.intersection(cfg.parameters):
                await _run(
                    mr.results,
                    mr.name,
                    "health",
                    v,
                    partial(self._health, mdir=mdir, mr=mr, version=v),
                )

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
        help="TOML rules file (docs/tools/check.md)",
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
        help="seconds a python model may take to import and run auto_complete_config, "
        "and for its goldens to initialize, then to answer (default %(default)g)",
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
