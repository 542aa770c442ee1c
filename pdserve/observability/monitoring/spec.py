"""The monitoring settings of a model: ``payload_log``, ``prediction_metrics`` and
``drift``, each a ``key=value,...`` string (config.pbtxt parameters of those names; the
server flag ``--payload-log`` gives the default ``payload_log``). Lists inside a value
are separated by ``|`` (``versions=1|2``), ranges by ``:`` (``range=0:1``). ``off``
turns a setting off. A malformed setting raises :class:`SpecError`, which fails the
model's load with the message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: config.pbtxt parameter names.
PAYLOAD_LOG = "payload_log"
PREDICTION_METRICS = "prediction_metrics"
DRIFT = "drift"

#: What a payload log records: each request's inputs, outputs, both, or metadata only.
RECORDS = ("all", "inputs", "outputs", "metadata")
#: Which requests a payload log keeps, by outcome.
STATUSES = ("all", "success", "error")
#: File formats of the file sink.
FORMATS = ("jsonl", "parquet")
#: The reference file of drift, beside config.pbtxt, when ``reference`` names none.
DEFAULT_REFERENCE = "monitoring_reference.npz"


class SpecError(ValueError):
    """A monitoring setting is malformed (the message says which key and why)."""


def _items(text: str, what: str, keys: tuple[str, ...]) -> dict[str, str] | None:
    """``key=value,...`` -> dict; None for ``off``; SpecError for unknown keys."""
    text = text.strip()
    if text.lower() in ("off", "false", "none", "0"):
        return None
    out: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in keys:
            raise SpecError(
                f"{what}: bad setting {item!r}; expected KEY=VALUE with KEY one of {', '.join(keys)}"
            )
        out[key] = value.strip()
    return out


def _float(items: dict[str, str], key: str, default: float, what: str) -> float:
    try:
        return float(items.get(key, default))
    except ValueError:
        raise SpecError(f"{what}: {key} must be a number, got {items[key]!r}") from None


def _mebibytes(items: dict[str, str], key: str, default: float, what: str) -> int:
    """A size setting in MiB (finite, > 0) as bytes, at least 1."""
    value = _float(items, key, default, what)
    if not 0 < value < math.inf:
        raise SpecError(f"{what}: {key} must be a number > 0, got {items[key]}")
    return max(int(value * (1 << 20)), 1)


def _int(items: dict[str, str], key: str, default: int, what: str, low: int = 1) -> int:
    try:
        value = int(items.get(key, default))
    except ValueError:
        raise SpecError(f"{what}: {key} must be an integer, got {items[key]!r}") from None
    if value < low:
        raise SpecError(f"{what}: {key} must be >= {low}, got {value}")
    return value


def _choice(items: dict[str, str], key: str, choices: tuple[str, ...], what: str) -> str:
    value = items.get(key, choices[0])
    if value not in choices:
        raise SpecError(f"{what}: {key} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _range(text: str, key: str, what: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(":")
    try:
        low, high = float(lo), float(hi)
    except ValueError:
        raise SpecError(f"{what}: {key} must be LOW:HIGH, got {text!r}") from None
    if not sep or not low < high:
        raise SpecError(f"{what}: {key} must be LOW:HIGH with LOW < HIGH, got {text!r}")
    return low, high


@dataclass(frozen=True)
class SinkSpec:
    """Where payload records go.

    Attributes:
        kind: ``file`` or ``kafka``.
        url: files: a local folder or an fsspec URL (``s3://bucket/prefix``); kafka:
            ``host:port[,host:port]`` bootstrap servers (``|``-separated in the setting).
        format: files: ``jsonl`` or ``parquet``.
        topic: kafka: the topic.
    """

    kind: str
    url: str
    format: str = "jsonl"
    topic: str = ""

    @classmethod
    def parse(cls, text: str, what: str) -> SinkSpec:
        """``jsonl:PATH`` | ``parquet:PATH`` (PATH local or ``s3://...``) |
        ``kafka://HOST:PORT[|HOST:PORT]/TOPIC``.

        Raises:
            SpecError: another form, or an empty path / topic.
        """
        if text.startswith("kafka://"):
            servers, _, topic = text[len("kafka://") :].partition("/")
            if not servers or not topic:
                raise SpecError(f"{what}: sink must be kafka://HOST:PORT/TOPIC, got {text!r}")
            return cls("kafka", servers.replace("|", ","), "", topic)
        fmt, sep, path = text.partition(":")
        if not sep or fmt not in FORMATS or not path:
            raise SpecError(
                f"{what}: sink must be jsonl:PATH, parquet:PATH or kafka://HOST:PORT/TOPIC, "
                f"got {text!r}"
            )
        return cls("file", path, fmt)


@dataclass(frozen=True)
class LogSpec:
    """A model's payload log.

    Attributes:
        sink: where records go.
        rate: the share of requests recorded, 0 < rate <= 1.
        record: ``all`` | ``inputs`` | ``outputs`` | ``metadata``.
        status: ``all`` | ``success`` | ``error``: which outcomes are recorded.
        versions: record only these versions (empty: all).
        parameter: record only requests whose parameter ``[0]`` equals ``[1]``.
        queue: bound of the queue between the request path and the sink (requests).
        queue_bytes: ... and of the tensor bytes it holds (``queue_mb``).
        roll_bytes: files: a file is closed once this many bytes are in it.
        roll_secs: files: ... or once its first record is this old.
    """

    sink: SinkSpec
    rate: float = 1.0
    record: str = "all"
    status: str = "all"
    versions: frozenset[str] = frozenset()
    parameter: tuple[str, str] | None = None
    queue: int = 10000
    queue_bytes: int = 256 << 20
    roll_bytes: int = 64 << 20
    roll_secs: float = 60.0

    KEYS = (
        "sink",
        "rate",
        "record",
        "status",
        "versions",
        "parameter",
        "queue",
        "queue_mb",
        "roll_mb",
        "roll_secs",
    )

    @classmethod
    def parse(cls, text: str, what: str = PAYLOAD_LOG) -> LogSpec | None:
        """Parse a ``payload_log`` setting; None for ``off``.

        Raises:
            SpecError: unknown key, bad value, or no ``sink``.
        """
        items = _items(text, what, cls.KEYS)
        if items is None:
            return None
        if "sink" not in items:
            raise SpecError(f"{what}: sink=... is required (jsonl:PATH, parquet:PATH, kafka://...)")
        rate = _float(items, "rate", 1.0, what)
        if not 0 < rate <= 1:
            raise SpecError(f"{what}: rate must be in (0, 1], got {rate:g}")
        parameter = None
        if "parameter" in items:
            key, sep, value = items["parameter"].partition(":")
            if not sep or not key:
                raise SpecError(f"{what}: parameter must be NAME:VALUE, got {items['parameter']!r}")
            parameter = (key, value)
        roll_secs = _float(items, "roll_secs", 60.0, what)
        if not 0 < roll_secs < math.inf:
            raise SpecError(f"{what}: roll_secs must be > 0, got {roll_secs:g}")
        return cls(
            sink=SinkSpec.parse(items["sink"], what),
            rate=rate,
            record=_choice(items, "record", RECORDS, what),
            status=_choice(items, "status", STATUSES, what),
            versions=frozenset(v for v in items.get("versions", "").split("|") if v),
            parameter=parameter,
            queue=_int(items, "queue", 10000, what),
            queue_bytes=_mebibytes(items, "queue_mb", 256.0, what),
            roll_bytes=_mebibytes(items, "roll_mb", 64.0, what),
            roll_secs=roll_secs,
        )


@dataclass(frozen=True)
class MetricsSpec:
    """A model's prediction distributions.

    Attributes:
        outputs: outputs to watch (empty: every numeric output).
        bins: score histogram bucket bounds, ascending (``LOW:HIGH:N`` -> N equal bins).
        range: values outside ``[low, high]`` count as out of range; None: not counted.
        classification: outputs whose argmax per row is a class (a class histogram).
        max_classes: classes with their own label; higher indices count as ``other``.
    """

    outputs: tuple[str, ...] = ()
    bins: tuple[float, ...] = ()
    range: tuple[float, float] | None = None
    classification: tuple[str, ...] = ()
    max_classes: int = 32

    KEYS = ("outputs", "bins", "range", "classification", "max_classes")

    @classmethod
    def parse(cls, text: str, what: str = PREDICTION_METRICS) -> MetricsSpec | None:
        """Parse a ``prediction_metrics`` setting; None for ``off``; ``on``: defaults.

        Raises:
            SpecError: unknown key or bad value.
        """
        if text.strip().lower() in ("on", "true", "1", ""):
            return cls(bins=DEFAULT_BINS)
        items = _items(text, what, cls.KEYS)
        if items is None:
            return None
        rng = _range(items["range"], "range", what) if "range" in items else None
        if "bins" in items:
            parts = items["bins"].split(":")
            if len(parts) != 3:
                raise SpecError(f"{what}: bins must be LOW:HIGH:N, got {items['bins']!r}")
            low, high = _range(f"{parts[0]}:{parts[1]}", "bins", what)
            n = _int({"n": parts[2]}, "n", 1, f"{what}: bins")
            if n > 200:
                raise SpecError(f"{what}: bins may have at most 200 buckets, got {n}")
            bins = tuple(low + (high - low) * i / n for i in range(n + 1))
        elif rng is not None:
            bins = tuple(rng[0] + (rng[1] - rng[0]) * i / 20 for i in range(21))
        else:
            bins = DEFAULT_BINS
        return cls(
            outputs=tuple(o for o in items.get("outputs", "").split("|") if o),
            bins=bins,
            range=rng,
            classification=tuple(o for o in items.get("classification", "").split("|") if o),
            max_classes=_int(items, "max_classes", 32, what),
        )


#: Score buckets when none are configured: symmetric, roughly logarithmic.
DEFAULT_BINS: tuple[float, ...] = tuple(
    sorted(
        {s * b for s in (-1, 1) for b in (0.001, 0.01, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 100, 1000)}
        | {0.0}
    )
)


@dataclass(frozen=True)
class DriftSpec:
    """A model's drift monitoring.

    Attributes:
        tensors: tensors compared with the reference (outputs or inputs; empty: every
            numeric output).
        reference: a file beside config.pbtxt (``.npz``: one array per tensor name), or
            ``first:N``: the first N values of each tensor after the version loads.
        window: the sliding window: the last N values of each tensor.
        bins: PSI bins (quantiles of the reference).
        threshold: the PSI above which the shipped alert fires (exported as a gauge).
        min_values: no score is exported until the window holds this many values.
    """

    tensors: tuple[str, ...] = ()
    reference: str = DEFAULT_REFERENCE
    first_n: int = 0
    window: int = 10000
    bins: int = 10
    threshold: float = 0.2
    min_values: int = 100

    KEYS = ("tensors", "reference", "window", "bins", "threshold", "min_values")

    @classmethod
    def parse(cls, text: str, what: str = DRIFT) -> DriftSpec | None:
        """Parse a ``drift`` setting; None for ``off``; ``on``: defaults.

        Raises:
            SpecError: unknown key or bad value.
        """
        if text.strip().lower() in ("on", "true", "1", ""):
            return cls()
        items = _items(text, what, cls.KEYS)
        if items is None:
            return None
        reference, first_n = items.get("reference", DEFAULT_REFERENCE), 0
        if reference.startswith("first:"):
            first_n = _int({"n": reference[6:]}, "n", 1, f"{what}: reference=first:N")
        elif not reference or "/" in reference or reference.startswith("."):
            raise SpecError(
                f"{what}: reference must be a file name beside config.pbtxt or first:N, "
                f"got {reference!r}"
            )
        bins = _int(items, "bins", 10, what, low=2)
        if first_n and first_n < 5 * bins:
            raise SpecError(
                f"{what}: reference=first:N needs N >= 5 * bins ({5 * bins}), got {first_n}"
            )
        window = _int(items, "window", 10000, what, low=10)
        threshold = _float(items, "threshold", 0.2, what)
        if threshold <= 0:
            raise SpecError(f"{what}: threshold must be > 0, got {threshold:g}")
        return cls(
            tensors=tuple(t for t in items.get("tensors", "").split("|") if t),
            reference=reference,
            first_n=first_n,
            window=window,
            bins=bins,
            threshold=threshold,
            min_values=min(window, _int(items, "min_values", 100, what)),
        )


@dataclass
class ModelMonitoring:
    """Everything monitored of one model version (None: that part is off)."""

    log: LogSpec | None = None
    metrics: MetricsSpec | None = None
    drift: DriftSpec | None = None

    @property
    def active(self) -> bool:
        """True when any part is on."""
        return self.log is not None or self.metrics is not None or self.drift is not None


def parse_parameters(parameters: dict[str, str], default_log: str | None = None) -> ModelMonitoring:
    """The monitoring of a model from its config.pbtxt ``parameters`` (name -> string
    value), ``default_log`` (``--payload-log``) applying when it has no ``payload_log``.

    Raises:
        SpecError: a malformed setting (the message names the parameter).
    """
    log_text = parameters.get(PAYLOAD_LOG, default_log)
    return ModelMonitoring(
        log=LogSpec.parse(log_text) if log_text else None,
        metrics=MetricsSpec.parse(parameters[PREDICTION_METRICS])
        if PREDICTION_METRICS in parameters
        else None,
        drift=DriftSpec.parse(parameters[DRIFT]) if DRIFT in parameters else None,
    )
