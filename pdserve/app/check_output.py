"""The reports of ``pdserve check``: human text, JSON and JUnit XML.

* ``human`` (default): one line per model (``ok`` / ``warn`` / ``FAIL``, backend,
  versions), each problem under its model as ``severity: path: field: message
  [check vN]``, then a summary line.
* ``json``: :meth:`pdserve.app.check_report.Report.to_json` (a ``summary``, each
  model's ``checks`` with status and problems, and the flat list of ``problems``).
* ``junit``: JUnit XML as CI systems read it (GitLab ``artifacts:reports:junit``,
  GitHub test-report actions, Jenkins): one ``<testsuite>`` per model, one
  ``<testcase>`` per check run (``classname`` ``pdserve.check.<model>``, name
  ``<check> vN``), a ``<failure>`` holding its errors, ``<skipped>`` with the
  reason, warnings in ``<system-out>``.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

from .check_report import ERROR, CheckResult, ModelReport, Problem, Report

_RED, _YELLOW, _GREEN, _DIM, _RESET = "\033[31m", "\033[33m", "\033[32m", "\033[2m", "\033[0m"


def render(report: Report, fmt: str, *, color: bool = False, verbose: bool = False) -> str:
    """The report in ``fmt``: ``human``, ``json``, ``junit`` or ``summary`` (one line).

    ``color`` and ``verbose`` (every check with its time and status) concern ``human``.

    Raises:
        ValueError: an unknown format.
    """
    if fmt == "human":
        return human(report, color=color, verbose=verbose)
    if fmt == "json":
        return json.dumps(report.to_json(), indent=2) + "\n"
    if fmt == "junit":
        return junit(report)
    if fmt == "summary":
        return summary(report)
    raise ValueError(f"unknown report format {fmt!r}")


def _relative(path: str) -> str:
    """``path`` relative to the working directory when it is below it."""
    if not path:
        return ""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return path


def problem_line(p: Problem) -> str:
    """``path: field: message [check vN]`` (parts left out when empty)."""
    where = ": ".join(x for x in (_relative(p.path), p.field) if x)
    tag = p.check + (f" v{p.version}" if p.version is not None else "")
    return f"{where + ': ' if where else ''}{p.message} [{tag}]"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def summary(report: Report) -> str:
    """One line: what was checked, how long it took, what was found."""
    versions = sum(len(m.versions) for m in report.models)
    verdict = "clean" if report.ok else "FAILED"
    return (
        f"pdserve check: {_count(len(report.models), 'model')}, {_count(versions, 'version')}, "
        f"{_count(len(report.all_results), 'check')} in {report.seconds:.1f} s: "
        f"{_count(report.errors, 'error')}, {_count(report.warnings, 'warning')}: {verdict}"
    )


def _model_line(m: ModelReport, paint: dict[str, str]) -> str:
    warnings = len(m.problems) - m.errors
    if m.errors:
        status = f"{paint['red']}FAIL{paint['reset']}"
    elif warnings:
        status = f"{paint['yellow']}warn{paint['reset']}"
    else:
        status = f"{paint['green']}ok  {paint['reset']}"
    kind = m.platform if m.platform == "ensemble" else (m.backend or "?")
    versions = ",".join(str(v) for v in m.versions) or "-"
    served = ",".join(str(v) for v in m.served_versions) or "-"
    skipped = sum(r.status == "skipped" for r in m.results)
    extra = f"  {paint['dim']}{skipped} skipped{paint['reset']}" if skipped else ""
    return f"{status}  {m.name:<24} {kind:<12} versions {versions} (serves {served}){extra}"


def human(report: Report, *, color: bool = False, verbose: bool = False) -> str:
    """The terminal report (ANSI colours when ``color``; every check run when ``verbose``)."""
    paint = {
        "red": _RED if color else "",
        "yellow": _YELLOW if color else "",
        "green": _GREEN if color else "",
        "dim": _DIM if color else "",
        "reset": _RESET if color else "",
    }
    lines = [f"pdserve check {_relative(report.repository) or report.repository}"]
    for p in [p for r in report.results for p in r.problems]:
        lines.append(f"      {p.severity}: {problem_line(p)}")
    for m in report.models:
        lines.append(_model_line(m, paint))
        for r in m.results:
            for p in r.problems:
                sev = (
                    paint["red" if p.severity == ERROR else "yellow"] + p.severity + paint["reset"]
                )
                lines.append(f"      {sev}: {problem_line(p)}")
            if verbose:
                tag = r.check + (f" v{r.version}" if r.version is not None else "")
                why = f": {r.skipped}" if r.status == "skipped" else ""
                lines.append(
                    f"      {paint['dim']}{r.status:<7} {tag} ({r.seconds:.2f} s){why}"
                    f"{paint['reset']}"
                )
    lines.append(summary(report))
    return "\n".join(lines) + "\n"


def _testcase(parent: ET.Element, r: CheckResult) -> None:
    name = r.check + (f" v{r.version}" if r.version is not None else "")
    case = ET.SubElement(
        parent,
        "testcase",
        classname=f"pdserve.check.{r.model or 'repository'}",
        name=name,
        time=f"{r.seconds:.3f}",
    )
    paths = [p.path for p in r.problems if p.path]
    if paths:
        case.set("file", _relative(paths[0]))
    errors = [p for p in r.problems if p.severity == ERROR]
    warnings = [p for p in r.problems if p.severity != ERROR]
    if errors:
        failure = ET.SubElement(case, "failure", message=errors[0].message, type=r.check)
        failure.text = "\n".join(problem_line(p) for p in errors)
    elif r.skipped:
        ET.SubElement(case, "skipped", message=r.skipped)
    if warnings:
        out = ET.SubElement(case, "system-out")
        out.text = "\n".join(f"warning: {problem_line(p)}" for p in warnings)


def _suite(parent: ET.Element, name: str, results: list[CheckResult]) -> None:
    suite = ET.SubElement(
        parent,
        "testsuite",
        name=name,
        tests=str(len(results)),
        failures=str(sum(r.status == "failed" for r in results)),
        errors="0",
        skipped=str(sum(r.status == "skipped" for r in results)),
        time=f"{sum(r.seconds for r in results):.3f}",
    )
    for r in results:
        _testcase(suite, r)


def junit(report: Report) -> str:
    """The report as JUnit XML (a ``<testsuites>`` document)."""
    results = report.all_results
    root = ET.Element(
        "testsuites",
        name="pdserve check",
        tests=str(len(results)),
        failures=str(sum(r.status == "failed" for r in results)),
        errors="0",
        skipped=str(sum(r.status == "skipped" for r in results)),
        time=f"{report.seconds:.3f}",
    )
    if report.results:
        _suite(root, "(repository)", report.results)
    for m in report.models:
        _suite(root, m.name, m.results)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
