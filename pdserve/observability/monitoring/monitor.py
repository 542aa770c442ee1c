"""The server's monitoring hook: :class:`Monitor` attaches a :class:`VersionMonitor`
to each loaded model version whose configuration asks for monitoring, and renders the
metrics of all of them.

:meth:`VersionMonitor.observe` runs once per finished request (the server calls it
where a response or an error is produced): it offers the request to the payload logger
(a non-blocking put) and keeps a reference to its tensors; every :data:`FOLD_EVERY`
requests, and before every read, :meth:`VersionMonitor.fold` counts them into the
version's histograms and drift windows in one vectorised pass per tensor.
"""

from __future__ import annotations

import functools
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from pdserve import config as cfgmod
from pdserve.observability.monitoring.distributions import (
    NUMERIC_KINDS,
    ClassHistogram,
    ScoreHistogram,
    Window,
)
from pdserve.observability.monitoring.drift import Reference, load_reference
from pdserve.observability.monitoring.logger import PayloadLogger
from pdserve.observability.monitoring.spec import (
    DriftSpec,
    LogSpec,
    ModelMonitoring,
    SpecError,
    parse_parameters,
)

#: A metric sample: (name, type, help, labels, value) as the metrics exporter takes it.
Sample = tuple[str, str, str, dict[str, str], float]

NUMERIC_TYPES = frozenset(
    (
        "UINT8",
        "UINT16",
        "UINT32",
        "UINT64",
        "INT8",
        "INT16",
        "INT32",
        "INT64",
        "FP16",
        "FP32",
        "FP64",
    )
)

#: Requests whose tensors a version holds before it counts them (:meth:`VersionMonitor.fold`).
FOLD_EVERY = 256
#: The countdown of a version with no payload log: never reached.
NEVER = 1 << 62

#: name -> (type, help) of every family this module exports.
METRICS: dict[str, tuple[str, str]] = {
    "pdserve_payload_log_sampled_total": ("counter", "Requests sampled for the payload log (written + dropped + queued)"),
    "pdserve_payload_log_written_total": ("counter", "Sampled requests whose records the sink accepted"),
    "pdserve_payload_log_dropped_total": ("counter", "Sampled requests whose records were dropped, by reason (queue_full, sink_error, encode_error, shutdown)"),
    "pdserve_payload_log_queue_size": ("gauge", "Sampled requests queued or buffered, not yet written"),
    "pdserve_prediction_value": ("histogram", "Values of a monitored output"),
    "pdserve_prediction_out_of_range_total": ("counter", "Values of a monitored output outside its configured range"),
    "pdserve_prediction_nan_total": ("counter", "NaN values of a monitored output"),
    "pdserve_prediction_class_total": ("counter", "Rows of a classification output by predicted class (argmax)"),
    "pdserve_drift_psi": ("gauge", "Population stability index of a tensor's sliding window against its reference"),
    "pdserve_drift_psi_threshold": ("gauge", "The configured PSI above which a tensor has drifted"),
    "pdserve_drift_ks_statistic": ("gauge", "Two-sample Kolmogorov-Smirnov statistic of the window against the reference"),
    "pdserve_drift_ks_pvalue": ("gauge", "Two-sample Kolmogorov-Smirnov p-value of the window against the reference"),
    "pdserve_drift_window_values": ("gauge", "Values in a tensor's drift window"),
    "pdserve_version_divergence_psi": ("gauge", "PSI of a version's window against the window of the model's baseline version (the one with the most monitored requests): canary and shadow shift"),
}  # fmt: skip


#: A sample before its type and help are added: (name, labels, value).
Row = tuple[str, dict[str, str], float]


def _samples(rows: list[Row]) -> list[Sample]:
    """Rows with their type and help from :data:`METRICS` (a histogram's ``_bucket`` /
    ``_sum`` / ``_count`` rows from its family's)."""
    out: list[Sample] = []
    for name, labels, value in rows:
        family = name.removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
        kind, doc = METRICS[family if family in METRICS else name]
        out.append((name, kind, doc, labels, value))
    return out


def _parameters(cfg: Any) -> dict[str, str]:
    return {k: v.string_value for k, v in cfg.parameters.items()}


class _Drift:
    """One tensor's window and reference (fixed, or the first N values)."""

    def __init__(self, spec: DriftSpec, reference: Reference | None) -> None:
        self.spec = spec
        self.reference = reference
        self.window = Window(spec.window)
        self._first: list[np.ndarray] = []
        self._first_count = 0

    def add(self, values: np.ndarray, what: str) -> None:
        """Add ``values`` (float64, flat) to the window, or to the reference first."""
        if self.reference is None:  # first:N: fill the reference first
            self._first.append(values)
            self._first_count += len(values)
            if self._first_count >= self.spec.first_n:
                first = np.concatenate(self._first)
                values = first[self.spec.first_n :]
                self._first = []
                try:
                    self.reference = Reference(
                        first[: self.spec.first_n], self.spec.bins, f"drift: first {what!r}"
                    )
                except SpecError:  # no finite values among them: start again
                    self._first_count = 0
                    return
                if len(values):
                    self.window.add(values)
            return
        self.window.add(values)


def _classified(requested: list[Any]) -> bool:
    """Whether a request asks for an output as classes (the extension: BYTES)."""
    return any(o.classification for o in requested)


def _numeric_of(held: list[dict[str, np.ndarray]], name: str) -> list[np.ndarray]:
    """The numeric arrays named ``name`` in ``held``, in order."""
    kinds = NUMERIC_KINDS  # numeric(a) without a call per array
    return [a for t in held if (a := t.get(name)) is not None and a.dtype.kind in kinds]


def _values_of(held: list[dict[str, np.ndarray]], name: str) -> np.ndarray | None:
    """The values of :func:`_numeric_of`, flat float64; None when there are none."""
    arrays = _numeric_of(held, name)
    if not arrays:
        return None
    try:  # rows of the same shape: joined in one pass, without flattening each array
        joined = np.concatenate(arrays)
    except ValueError:  # scalars, or rows whose shapes differ
        return np.concatenate(arrays, axis=None, dtype=np.float64)
    return joined.reshape(-1).astype(np.float64, copy=False)


class VersionMonitor:
    """What is monitored of one model version.

    Raises (constructor):
        SpecError: the monitoring settings or the reference file are invalid.
    """

    def __init__(
        self, monitor: Monitor | None, mv: Any, model_dir: Path, spec: ModelMonitoring
    ) -> None:
        self.model = mv.name
        self.version = mv.version_str
        self.spec = spec
        self.observed = 0
        cfg = mv.config
        outputs = {o.name: cfgmod.datatype_of(o) for o in cfg.output}
        inputs = {i.name: cfgmod.datatype_of(i) for i in cfg.input}
        self.logger = None
        if monitor is not None and spec.log is not None:
            self.logger = monitor.logger_for(self.model, spec.log)
            self._sent = functools.partial(self.logger.sent, self.version)
        #: a sampled JSON request is recorded from its bodies, once answered: the sink
        #: writes JSON Lines and no output is BYTES (JSON text there, base64 in the log)
        self._defer = (
            self.logger is not None
            and self.logger.encoder is not None
            and "BYTES" not in outputs.values()
        )
        self.scores: dict[str, ScoreHistogram] = {}
        self.classes: dict[str, ClassHistogram] = {}
        m = spec.metrics
        if m is not None:
            for name in (*m.outputs, *m.classification):
                if outputs.get(name) not in NUMERIC_TYPES:
                    raise SpecError(f"prediction_metrics: no numeric output named {name!r}")
            labels = {o.name: o.label_filename for o in cfg.output}
            for name in m.classification:
                label_file = labels.get(name)
                names = (model_dir / label_file).read_text().splitlines() if label_file else None
                self.classes[name] = ClassHistogram(names, m.max_classes)
            watched = m.outputs or tuple(
                n for n, t in outputs.items() if t in NUMERIC_TYPES and n not in m.classification
            )
            for name in watched:
                self.scores[name] = ScoreHistogram(m.bins, m.range)
        self.drift: dict[str, _Drift] = {}
        self.drift_inputs: list[str] = []
        d = spec.drift
        if d is not None:
            try:
                import scipy.stats  # noqa: F401 - the KS test, at scrape time
            except ImportError as e:
                raise SpecError(f"drift needs scipy (pdserve[monitoring]): {e}") from None
            tensors = list(d.tensors) or [n for n, t in outputs.items() if t in NUMERIC_TYPES]
            for name in tensors:
                if {**inputs, **outputs}.get(name) not in NUMERIC_TYPES:
                    raise SpecError(f"drift: no numeric input or output named {name!r}")
            refs = {} if d.first_n else load_reference(model_dir / d.reference, tensors, d.bins)
            for name in tensors:
                self.drift[name] = _Drift(d, refs.get(name))
            self.drift_inputs = [n for n in tensors if n not in outputs]
        #: whether responses are counted at all, and whether drift reads inputs too
        self._counts = bool(self.scores or self.classes or self.drift)
        self._inputs = bool(self.drift_inputs)
        #: tensors of responses not counted yet: outputs, then inputs when drift reads them
        self._held: list[dict[str, np.ndarray]] = []
        #: requests until the next one the payload log samples (:meth:`PayloadLogger.gap`;
        #: the version draws its own gaps: each request is sampled with the log's rate)
        self._countdown = NEVER if self.logger is None else self.logger.gap()

    def observe(
        self, request: Any, outputs: dict[str, np.ndarray] | None, error: BaseException | None
    ) -> None:
        """One finished request: ``outputs`` on success, ``error`` on failure. Its
        tensors are held by reference (not copied) until the next :meth:`fold`; an
        unsampled request costs a decrement of the payload log's countdown."""
        self.observed += 1
        self._countdown -= 1
        if self._countdown <= 0:
            self._sampled(request, outputs, error)
        if outputs is not None and self._counts:
            held = self._held
            held.append(outputs)
            if self._inputs:
                held.append(request.inputs)
            if len(held) >= FOLD_EVERY:
                self.fold()

    def _sampled(
        self, request: Any, outputs: dict[str, np.ndarray] | None, error: BaseException | None
    ) -> None:
        """A request the payload log's draw sampled: deferred to the front end's answer
        for a JSON request (``InferRequest.answered``), else recorded now."""
        logger = self.logger
        if logger is None:  # nothing logged: the countdown starts again, far off
            self._countdown = NEVER
            return
        self._countdown = logger.gap()
        if (
            error is None
            and self._defer
            and request.json_body is not None
            and (request.outputs is None or not _classified(request.outputs))
        ):
            request.answered = self._sent  # recorded once the response is sent
        else:
            self._record(logger, request, outputs, error)

    def _record(
        self,
        logger: PayloadLogger,
        request: Any,
        outputs: dict[str, np.ndarray] | None,
        error: BaseException | None,
    ) -> None:
        message = (
            None
            if error is None
            else (getattr(error, "message", None) or str(error) or type(error).__name__)
        )
        logger.record(
            self.version, request.id, request.inputs, outputs, message, request.parameters
        )

    def fold(self) -> None:
        """Count the held responses into the histograms and drift windows: per tensor,
        its values of all of them at once (same counts as one response at a time)."""
        held = self._held
        if not held:
            return
        self._held = []
        outs = held[::2] if self._inputs else held
        flat: dict[str, np.ndarray | None] = {}  #: an output's values, for scores and drift
        for name, h in self.scores.items():
            values = flat[name] = _values_of(outs, name)
            if values is not None:
                h.add(values)
        for name, c in self.classes.items():
            if arrays := _numeric_of(outs, name):
                c.add_all(arrays)
        for name, d in self.drift.items():
            if name in self.drift_inputs:
                values = _values_of(held[1::2], name)
            else:
                values = flat[name] if name in flat else _values_of(outs, name)
            if values is not None:
                d.add(values, name)

    def samples(self) -> list[Sample]:
        """The version's distribution and drift samples."""
        self.fold()
        base = {"model": self.model, "version": self.version}
        rows: list[Row] = []
        for name, h in self.scores.items():
            out = {**base, "output": name}
            for le, n in h.cumulative():
                rows.append(("pdserve_prediction_value_bucket", {**out, "le": le}, n))
            rows.append(("pdserve_prediction_value_sum", {**base, "output": name}, h.sum))
            rows.append(("pdserve_prediction_value_count", {**base, "output": name}, h.count))
            if h.range is not None:
                rows.append(
                    (
                        "pdserve_prediction_out_of_range_total",
                        {**base, "output": name},
                        h.out_of_range,
                    )
                )
            rows.append(("pdserve_prediction_nan_total", {**base, "output": name}, h.nan))
        for name, c in self.classes.items():
            for label, n in c.items():
                rows.append(
                    ("pdserve_prediction_class_total", {**base, "output": name, "class": label}, n)
                )
        for name, d in self.drift.items():
            window = d.window.values()
            rows.append(("pdserve_drift_window_values", {**base, "tensor": name}, len(window)))
            if d.reference is None or len(window) < d.spec.min_values:
                continue
            psi = d.reference.psi(window)
            stat, p = d.reference.ks(window)
            rows.append(("pdserve_drift_psi", {**base, "tensor": name}, psi))
            rows.append(("pdserve_drift_psi_threshold", {**base, "tensor": name}, d.spec.threshold))
            rows.append(("pdserve_drift_ks_statistic", {**base, "tensor": name}, stat))
            rows.append(("pdserve_drift_ks_pvalue", {**base, "tensor": name}, p))
        return _samples(rows)


def validate(cfg: Any, model_dir: Path) -> ModelMonitoring:
    """Check a model's monitoring parameters and reference file as a load would
    (``pdserve check``), without starting a payload logger.

    Raises:
        SpecError: what would fail the load.
    """
    spec = parse_parameters(_parameters(cfg))
    if spec.active:
        VersionMonitor(
            None, SimpleNamespace(name=cfg.name, version_str="", config=cfg), model_dir, spec
        )
    return spec


class Monitor:
    """The server's monitoring hook (``InferenceServer.monitor``) and metrics source.

    Args:
        default_log: the ``payload_log`` of models that set none (``--payload-log``).
        source: the events' ``source`` attribute (default ``pdserve://<hostname>``).
    """

    def __init__(self, default_log: str | None = None, source: str | None = None) -> None:
        if default_log:
            LogSpec.parse(default_log, "--payload-log")  # SpecError at start, not per model
        self.default_log = default_log
        self.source = source or f"pdserve://{socket.gethostname()}"
        self.versions: dict[tuple[str, str], VersionMonitor] = {}
        self.loggers: dict[tuple[str, LogSpec], PayloadLogger] = {}

    def attach(self, mv: Any, model_dir: Path) -> VersionMonitor | None:
        """The monitor of a freshly loaded version; None when nothing is monitored.

        Raises:
            SpecError: a malformed setting, a missing / invalid reference file, a sink
                whose package is missing or whose local folder cannot be written (the
                version's load fails with it).
        """
        spec = parse_parameters(_parameters(mv.config), self.default_log)
        if not spec.active:
            self.versions.pop((mv.name, mv.version_str), None)
            return None
        vm = VersionMonitor(self, mv, model_dir, spec)
        self.versions[(mv.name, mv.version_str)] = vm
        return vm

    def logger_for(self, model: str, spec: LogSpec) -> PayloadLogger:
        """The payload logger of ``model`` with ``spec`` (one per model and spec).

        Raises:
            SpecError: the sink's package is missing, or its local folder cannot be made
                or written to.
        """
        key = (model, spec)
        logger = self.loggers.get(key)
        if logger is None:
            try:
                logger = PayloadLogger(model, spec, self.source)
            except ImportError as e:
                raise SpecError(
                    f"payload_log: sink {spec.sink.kind} needs a package: {e}"
                ) from None
            except OSError as e:  # a local folder that cannot be made or written to
                raise SpecError(f"payload_log: cannot write to {spec.sink.url}: {e}") from None
            self.loggers[key] = logger
        return logger

    def samples(self) -> list[Sample]:
        """Every monitoring sample, read at each scrape."""
        rows: list[Row] = []
        for (model, _), logger in sorted(self.loggers.items(), key=lambda kv: kv[0][0]):
            rows.append(("pdserve_payload_log_sampled_total", {"model": model}, logger.sampled))
            rows.append(("pdserve_payload_log_written_total", {"model": model}, logger.written))
            rows.append(("pdserve_payload_log_queue_size", {"model": model}, logger.queued))
            for reason in ("queue_full", "sink_error", "encode_error", "shutdown"):
                dropped = logger.dropped[reason]
                rows.append(
                    (
                        "pdserve_payload_log_dropped_total",
                        {"model": model, "reason": reason},
                        dropped,
                    )
                )
        out = _samples(rows)
        for _, vm in sorted(self.versions.items()):
            out += vm.samples()
        out += _samples(self.divergence())
        return out

    def divergence(self) -> list[Row]:
        """PSI of each version's drift window against the baseline version's (the
        version of the model with the most monitored requests; of equals, the lowest:
        a shadow mirrors every request of its primary)."""
        by_model: dict[str, list[VersionMonitor]] = {}
        for (model, _), vm in self.versions.items():
            vm.fold()
            if vm.drift:
                by_model.setdefault(model, []).append(vm)
        out: list[Row] = []
        for model, vms in sorted(by_model.items()):
            if len(vms) < 2:
                continue
            base = max(vms, key=lambda v: (v.observed, -int(v.version)))
            for name, bd in base.drift.items():
                ref_values = bd.window.values()
                if len(ref_values) < bd.spec.min_values:
                    continue
                try:
                    ref = Reference(ref_values, bd.spec.bins, name)
                except SpecError:
                    continue
                for vm in vms:
                    d = vm.drift.get(name)
                    if vm is base or d is None:
                        continue
                    window = d.window.values()
                    if len(window) < d.spec.min_values:
                        continue
                    out.append(
                        (
                            "pdserve_version_divergence_psi",
                            {
                                "model": model,
                                "version": vm.version,
                                "baseline": base.version,
                                "tensor": name,
                            },
                            ref.psi(window),
                        )
                    )
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Write what the payload loggers hold and stop their threads."""
        for logger in self.loggers.values():
            logger.close(timeout)
