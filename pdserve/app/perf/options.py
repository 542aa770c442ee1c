"""What one ``pdserve perf`` run measures: :class:`PerfOptions` and the parsers of
perf_analyzer's range and shape syntax.

Defaults follow perf_analyzer (``triton-inference-server/client``,
``src/c++/perf_analyzer``): one concurrency level of 1 when no range is given,
5000 ms measurement windows, 10% stability, 10 trials, batch size 1, random input
data, the binary tensor format over HTTP.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

Protocol = Literal["http", "grpc"]
Distribution = Literal["constant", "poisson"]
TensorFormat = Literal["binary", "json"]


class PerfError(Exception):
    """A run cannot start or go on: the server is unreachable, the model unknown, a
    request is rejected, an option does not fit the model. The message says which
    and is meant for the user as it is."""


#: Latency percentiles every measurement reports (perf_analyzer's set).
PERCENTILES: tuple[int, ...] = (50, 90, 95, 99)

#: Most load levels one range may expand to (keeps a typo from meaning a day's run).
MAX_LEVELS = 1000


def parse_concurrency_range(text: str) -> list[int]:
    """``start[:end[:step]]`` (perf_analyzer's ``--concurrency-range``) -> the levels.

    ``"4"`` is one level; ``"1:8"`` steps by 1; ``"1:64:2"`` is 1, 3, ..., 63 (the
    step is added, as perf_analyzer does). Levels are integers >= 1.

    Raises:
        ValueError: not three or fewer ``:``-separated integers, start < 1, end <
            start, step < 1, or more than :data:`MAX_LEVELS` levels.
    """
    parts = text.strip().split(":")
    if not 1 <= len(parts) <= 3 or any(not p.strip() for p in parts):
        raise ValueError(f"'{text}' is not start[:end[:step]]")
    try:
        nums = [int(p) for p in parts]
    except ValueError:
        raise ValueError(f"'{text}': start, end and step must be integers") from None
    start = nums[0]
    end = nums[1] if len(nums) > 1 else start
    step = nums[2] if len(nums) > 2 else 1
    if start < 1:
        raise ValueError(f"'{text}': the start must be at least 1")
    if end < start:
        raise ValueError(f"'{text}': the end ({end}) is below the start ({start})")
    if step < 1:
        raise ValueError(f"'{text}': the step must be at least 1")
    levels = list(range(start, end + 1, step))
    if len(levels) > MAX_LEVELS:
        raise ValueError(f"'{text}' gives {len(levels)} levels; at most {MAX_LEVELS}")
    return levels


def parse_rate_range(text: str) -> list[float]:
    """``start[:end[:step]]`` (perf_analyzer's ``--request-rate-range``, requests per
    second) -> the rates; ``"100:400:100"`` is 100, 200, 300, 400. Floats allowed;
    the end is included when a step lands on it (within 1e-9 relative).

    Raises:
        ValueError: not numbers, a rate <= 0, end < start, step <= 0 where end >
            start, or more than :data:`MAX_LEVELS` rates.
    """
    parts = text.strip().split(":")
    if not 1 <= len(parts) <= 3 or any(not p.strip() for p in parts):
        raise ValueError(f"'{text}' is not start[:end[:step]]")
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        raise ValueError(f"'{text}': start, end and step must be numbers") from None
    if not all(math.isfinite(n) for n in nums):
        raise ValueError(f"'{text}': values must be finite")
    start = nums[0]
    end = nums[1] if len(nums) > 1 else start
    step = nums[2] if len(nums) > 2 else 1.0
    if start <= 0:
        raise ValueError(f"'{text}': the rate must be above 0")
    if end < start:
        raise ValueError(f"'{text}': the end ({end:g}) is below the start ({start:g})")
    if end > start and step <= 0:
        raise ValueError(f"'{text}': the step must be above 0")
    if end == start:
        return [start]
    count = math.floor((end - start) / step * (1 + 1e-9)) + 1
    if count > MAX_LEVELS:
        raise ValueError(f"'{text}' gives {count} rates; at most {MAX_LEVELS}")
    return [round(start + i * step, 9) for i in range(count)]


def parse_shape(text: str) -> tuple[str, list[int]]:
    """``NAME:d1,d2,...`` (perf_analyzer's ``--shape``) -> (name, dims).

    The dims exclude the batch dimension of a batching model. The name may itself
    hold ``:``; the dims follow the last one.

    Raises:
        ValueError: no ``:``, an empty name, or a dim that is not an integer >= 0.
    """
    name, sep, dims = text.rpartition(":")
    if not sep or not name:
        raise ValueError(f"'{text}' is not NAME:d1,d2,...")
    try:
        shape = [int(d) for d in dims.split(",")] if dims.strip() else []
    except ValueError:
        raise ValueError(f"'{text}': dims must be integers") from None
    if any(d < 0 for d in shape):
        raise ValueError(f"'{text}': dims must be 0 or more")
    return name, shape


def default_url(protocol: Protocol) -> str:
    """perf_analyzer's default server address for a protocol."""
    return "localhost:8001" if protocol == "grpc" else "localhost:8000"


@dataclass
class PerfOptions:
    """One ``pdserve perf`` run (all of its CLI flags; see ``pdserve perf --help``).

    Exactly one of ``concurrency`` (closed loop: that many requests in flight) or
    ``request_rates`` (open loop: requests per second, ``distribution`` arrivals)
    is used; when both are None the run is concurrency 1.
    """

    model: str
    #: ``host:port`` (an ``http://`` prefix is accepted for HTTP); None: the
    #: protocol's default (``localhost:8000`` / ``localhost:8001``).
    url: str | None = None
    protocol: Protocol = "http"
    #: Model version ("" = the server's choice, as perf_analyzer's ``-x``).
    model_version: str = ""
    batch_size: int = 1
    concurrency: list[int] | None = None
    request_rates: list[float] | None = None
    distribution: Distribution = "constant"
    #: ``random``, ``zero`` or the path of a perf_analyzer input-data JSON file.
    input_data: str = "random"
    #: Input name -> dims without the batch dimension (for variable dims).
    shapes: dict[str, list[int]] = field(default_factory=dict)
    #: Length of each random BYTES element (perf_analyzer's ``--string-length``).
    string_length: int = 128
    input_format: TensorFormat = "binary"
    output_format: TensorFormat = "binary"
    #: Measurement window (milliseconds).
    measurement_interval_ms: int = 5000
    stability_percentage: float = 10.0
    max_trials: int = 10
    #: Stabilize on (and report as "latency") this percentile instead of the mean.
    percentile: int | None = None
    #: Stop the sweep once the stabilizing latency reaches this (milliseconds).
    latency_threshold_ms: float | None = None
    #: Load-generating processes; 0 picks (see :func:`pdserve.app.perf.runner.auto_workers`).
    workers: int = 0
    #: Open-loop mode: most connections (HTTP) or requests in flight (gRPC), all
    #: workers together; a request finding none free waits and counts as delayed.
    max_connections: int = 256
    #: A request unanswered this long fails (``timeout``) and its connection closes.
    request_timeout_s: float = 30.0
    #: Connecting (and each control request: metadata, statistics) gives up after this.
    connect_timeout_s: float = 5.0
    #: Read the statistics extension before and after each window.
    server_stats: bool = True
    #: Seed of random input data and Poisson arrivals.
    seed: int = 0
    #: gRPC load client: ``raw`` (HTTP/2 frames, :mod:`pdserve.app.perf.h2grpc`) or
    #: ``grpcio`` (``grpc.aio``; heavier per call).
    grpc_client: Literal["raw", "grpcio"] = "raw"

    def resolved_url(self) -> str:
        """``url`` or the protocol's default."""
        return self.url or default_url(self.protocol)

    def levels(self) -> tuple[Literal["concurrency", "request_rate"], list[float]]:
        """(mode, load levels) of the sweep."""
        if self.request_rates is not None:
            return "request_rate", [float(r) for r in self.request_rates]
        return "concurrency", [float(c) for c in (self.concurrency or [1])]

    def validate(self) -> None:
        """Check values that do not depend on the model.

        Raises:
            PerfError: naming the option.
        """
        if self.concurrency is not None and self.request_rates is not None:
            raise PerfError("give a concurrency range or a request-rate range, not both")
        if self.batch_size < 1:
            raise PerfError("the batch size (-b) must be at least 1")
        if self.measurement_interval_ms < 10:
            raise PerfError("the measurement interval must be at least 10 ms")
        if self.stability_percentage <= 0:
            raise PerfError("the stability percentage must be above 0")
        if self.max_trials < 1:
            raise PerfError("max trials must be at least 1")
        if self.percentile is not None and not 1 <= self.percentile <= 99:
            raise PerfError("the percentile must be between 1 and 99")
        if self.workers < 0:
            raise PerfError("workers must be 0 (pick) or more")
        if self.max_connections < 1:
            raise PerfError("max connections must be at least 1")
        if self.request_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise PerfError("timeouts must be above 0")
        if self.string_length < 0:
            raise PerfError("the string length must be 0 or more")
        if self.protocol == "grpc" and "://" in (self.url or ""):
            raise PerfError(f"a gRPC address is host:port, not '{self.url}'")

    def as_dict(self) -> dict[str, object]:
        """The options as plain JSON values (for the JSON report)."""
        d = asdict(self)
        d["url"] = self.resolved_url()
        return d
