"""The findings of ``pdserve check``: one :class:`Problem` per thing wrong, one
:class:`CheckResult` per check run (a JUnit test case), a :class:`ModelReport` per
model folder and the repository's :class:`Report`, each with its ``--format json``
form."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pdserve import config as cfgmod

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

    def to_json(self) -> dict[str, object]:
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

    def to_json(self) -> dict[str, object]:
        """The result as a JSON object (the ``--format json`` schema)."""
        return {
            "check": self.check,
            "version": self.version,
            "status": self.status,
            "skipped": self.skipped,
            "seconds": round(self.seconds, 4),
            "problems": [p.to_json() for p in self.problems],
        }


class _Findings:
    """What the check results of a model, or of the whole repository, found."""

    @property
    def all_results(self) -> list[CheckResult]:
        raise NotImplementedError

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


@dataclass
class ModelReport(_Findings):
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
    def all_results(self) -> list[CheckResult]:
        return self.results

    def default_config(self) -> tuple[int, cfgmod.ModelConfig] | None:
        """The version ``serve`` would serve by default and its completed configuration."""
        for v in sorted(self.served_versions, reverse=True):
            if v in self.completed:
                return v, self.completed[v]
        return None

    def to_json(self) -> dict[str, object]:
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
class Report(_Findings):
    """The result of checking a repository."""

    repository: str
    models: list[ModelReport] = field(default_factory=list)
    results: list[CheckResult] = field(default_factory=list)  # repository-wide
    seconds: float = 0.0

    @property
    def all_results(self) -> list[CheckResult]:
        return self.results + [r for m in self.models for r in m.results]

    @property
    def exit_code(self) -> int:
        """0 when nothing is an error, else 1."""
        return 0 if self.ok else 1

    def to_json(self) -> dict[str, object]:
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
