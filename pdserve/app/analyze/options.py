"""What a ``pdserve analyze`` run is given: its options (the flags) and the
progress hooks through which it reports what happens."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TypedDict

from pdserve.app.analyze.recommend import ConfigResult, Constraints, LevelResult
from pdserve.app.analyze.space import Point
from pdserve.app.perf.stats import Window

#: Default concurrency levels (model_analyzer doubles from 1).
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)


@dataclass
class AnalyzeOptions:
    """One ``pdserve analyze`` run (its flags; see ``pdserve analyze --help``)."""

    model: str
    #: Own server on a copy of this repository (None with ``url``: the example one).
    repository: Path | None = None
    #: A running server's HTTP address (``host:port``): no own server.
    url: str | None = None
    protocol: Literal["http", "grpc"] = "http"
    #: With ``url`` and gRPC: the server's gRPC address.
    grpc_url: str | None = None
    #: With ``url``: the server's process (memory); None: found from the port.
    server_pid: int | None = None
    server_cpus: list[int] | None = None
    client_cpus: list[int] | None = None
    server_mode: Literal["restart", "reload"] = "restart"
    server_args: list[str] = field(default_factory=list)
    p99_ms: float | None = None
    memory_budget: int | None = None
    search: Literal["quick", "grid"] = "quick"
    instance_counts: list[int] | None = None
    max_batch_sizes: list[int] | None = None
    preferred: list[str] | None = None
    queue_delays_us: list[int | None] | None = None
    max_configs: int = 40
    max_minutes: float = 10.0
    #: A move of the quick search needs this much more throughput (fraction).
    min_gain: float = 0.02
    concurrency: list[int] = field(default_factory=lambda: list(DEFAULT_CONCURRENCY))
    batch_size: int = 1
    input_data: str = "random"
    shapes: dict[str, list[int]] = field(default_factory=dict)
    measurement_interval_ms: int = 1000
    stability_percentage: float = 15.0
    max_trials: int = 6
    perf_workers: int = 0
    #: Concurrencies bisected between the last level within the SLO and the first
    #: above it.
    bisect_steps: int = 2
    confirm: int = 1
    output_dir: Path = Path("analyze")

    @property
    def constraints(self) -> Constraints:
        """The SLO and the memory budget."""
        return Constraints(self.p99_ms, self.memory_budget)

    def as_dict(self) -> dict[str, object]:
        """Plain JSON values."""
        d = dict(self.__dict__)
        for k in ("repository", "output_dir"):
            d[k] = None if d[k] is None else str(d[k])
        return d


class AnalyzeInfo(TypedDict, total=False):
    """What a search covers, as :meth:`Progress.start` is told and the reports keep it
    (empty before the search starts)."""

    model: str
    steps: list[str]
    pipeline: bool
    server: str
    cpus: int | None
    dims: list[str]
    points: int
    search: str
    max_configs: int
    max_minutes: float
    p99_ms: float | None
    memory_budget: int | None
    concurrency: list[int]
    shipped: dict[str, str]
    memory_measured: bool


class Progress:
    """Receives what happens (the CLI's terminal display); the methods do nothing
    here."""

    def start(self, info: AnalyzeInfo) -> None:
        """Before the first configuration: ``model``, ``steps``, ``server``,
        ``dims`` (lines), ``points``, ``search``, ``constraints``..."""

    def config_start(self, n: int, point: Point, shipped: bool, repeat: int, t: float) -> None:
        """A configuration's measurement begins (``n`` from 0; ``t`` seconds since
        the start)."""

    def loaded(self, load_s: float, memory_bytes: float | None) -> None:
        """The configuration loaded."""

    def window(self, level: int, trial: int, window: Window, batch_size: int) -> None:
        """A perf window ended."""

    def level(self, level: LevelResult) -> None:
        """A concurrency level ended."""

    def config_done(self, result: ConfigResult) -> None:
        """The configuration's result."""

    def note(self, text: str) -> None:
        """A remark for the user."""
