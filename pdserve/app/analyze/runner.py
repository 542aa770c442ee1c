"""The run of ``pdserve analyze``: set up the server, search the configurations
(:mod:`.space`), measure each with ``pdserve perf`` and the memory from ``/proc``,
and pick the recommendation (:mod:`.recommend`).

Measuring one configuration (:meth:`Analyzer.measure`):

1. own server, ``restart`` mode (default): a fresh ``pdserve serve`` with no
   model loaded, so the memory before the load is that of an empty server and
   nothing freed by an earlier configuration is reused; ``reload`` mode (and a
   running server, ``-u``): the models are unloaded and the unload waited for;
2. the tuned models are loaded through the repository API with the
   configuration as a ``config`` override, then the ensemble (if any) as it is;
3. ``pdserve perf`` (:func:`pdserve.app.perf.run_sweep`) drives the target at the
   concurrency levels in order, while the memory of the server's processes is
   sampled; the sweep stops at the first level whose p99 exceeds the SLO, when
   two levels in a row gain less than :data:`PLATEAU_GAIN` throughput over the
   best before them (model_analyzer stops its concurrency sweep the same way),
   at a level with errors, or when the time budget is out. When it stopped at
   the SLO, up to ``bisect_steps`` concurrencies between the last level within it
   and the first above are measured (binary search), so that the score does not
   jump by a factor 2 with the concurrency.

Time (``--max-minutes``): a configuration starts only while the time left covers
the mean time a configuration took so far (plus the confirmation runs); one
under way when the budget ends is stopped and kept (``partial``).

Confirmation: after the search, the shipped and the recommended configurations
are measured again, alternately (``--confirm`` times each); the confirmed gain
is the ratio of the medians of those measurements. When it is below ``1 +
min_gain`` (and the shipped configuration met the objective), the search's best
was picked by noise: the shipped configuration is recommended instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pdserve import config as cfgmod
from pdserve.app.analyze import memory
from pdserve.app.analyze.recommend import (
    ConfigResult,
    Constraints,
    LevelResult,
    best,
    better,
    decide,
    recommend,
)
from pdserve.app.analyze.server import (
    AnalyzeError,
    OwnServer,
    RepositoryClient,
    copy_repository,
    models_needed,
)
from pdserve.app.analyze.space import (
    Knobs,
    Point,
    Space,
    apply_knobs,
    build_space,
    ensemble_steps,
    is_ensemble,
    point_key,
    shipped_knobs,
)
from pdserve.app.perf import PerfError, PerfOptions, run_sweep
from pdserve.app.perf.stats import PointResult, Window

#: A concurrency sweep stops once two levels in a row gain less than this
#: fraction of throughput over the best level before them.
PLATEAU_GAIN = 0.05

#: The quick search's widest neighbourhood (steps; model_analyzer's radius is 2).
MAX_RADIUS = 2

#: Default concurrency levels (model_analyzer doubles from 1).
DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64)

#: Seconds an empty server waits after starting (or the models' unload) before
#: the memory is read.
SETTLE_S = 0.3


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

    def as_dict(self) -> dict[str, Any]:
        """Plain JSON values."""
        d = dict(self.__dict__)
        for k in ("repository", "output_dir"):
            d[k] = None if d[k] is None else str(d[k])
        return d


class Progress:
    """Receives what happens (the CLI's terminal display); the methods do nothing
    here."""

    def start(self, info: dict[str, Any]) -> None:
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


class _StopSweep(Exception):
    """Raised from the perf progress hooks to end a concurrency sweep early."""


class _SweepWatcher:
    """A :class:`pdserve.app.perf.Progress` that forwards to analyze's progress,
    keeps the levels, and stops the sweep (SLO, plateau, deadline)."""

    def __init__(
        self, progress: Progress, p99_ms: float | None, deadline: float, batch_size: int
    ) -> None:
        self.progress = progress
        self.p99_ms = p99_ms
        self.deadline = deadline
        self.batch_size = batch_size
        self.levels: list[LevelResult] = []
        self.reason = ""
        self.timed_out = False

    def start(self, info: dict[str, Any]) -> None:
        """Nothing."""

    def window(
        self, mode: str, level: float, trial: int, window: Window, stable: bool, batch_size: int
    ) -> None:
        """Forward; stop when the time budget is out."""
        self.progress.window(int(level), trial, window, batch_size)
        if time.monotonic() > self.deadline:
            self.timed_out = True
            self.reason = "time budget"
            raise _StopSweep

    def level_done(self, point: PointResult) -> None:
        """Keep the level; stop on SLO, plateau or errors."""
        lv = level_from_point(point)
        self.levels.append(lv)
        self.progress.level(lv)
        reason = sweep_stop_reason(self.levels, self.p99_ms)
        if point.aborted:
            self.reason = point.aborted
        elif reason:
            self.reason = reason
            raise _StopSweep

    def note(self, text: str) -> None:
        """Forward."""
        self.progress.note(text)


def level_from_point(point: PointResult) -> LevelResult:
    """A perf level's result as analyze keeps it."""
    lat = point.latency_us
    return LevelResult(
        concurrency=int(point.level),
        infer_per_sec=point.infer_per_sec,
        p50_ms=lat.get("p50", 0.0) / 1000.0,
        p99_ms=lat.get("p99", 0.0) / 1000.0,
        errors=point.error_count,
        stable=point.stable,
        avg_batch=(point.server or {}).get("avg_batch_size", 0.0),
        requests=point.request_count,
        aborted=point.aborted,
    )


def sweep_stop_reason(levels: Sequence[LevelResult], p99_ms: float | None) -> str:
    """Why a concurrency sweep ends after ``levels`` ("" when it goes on): errors,
    the last p99 above the SLO, or two levels without :data:`PLATEAU_GAIN` more
    throughput than the best before them."""
    last = levels[-1]
    if last.errors or last.aborted:
        return "errors"
    if p99_ms is not None and last.p99_ms > p99_ms:
        return "p99 above the SLO"
    if len(levels) >= 3:
        before = max(lv.infer_per_sec for lv in levels[:-2])
        if max(lv.infer_per_sec for lv in levels[-2:]) < before * (1.0 + PLATEAU_GAIN):
            return "throughput stopped growing"
    return ""


def bisect_bounds(levels: Sequence[LevelResult], p99_ms: float) -> tuple[int, int] | None:
    """(highest concurrency within the SLO without errors, lowest one above it),
    the interval the SLO bisection searches; None when either is missing."""
    ok = [lv.concurrency for lv in levels if lv.usable and lv.p99_ms <= p99_ms]
    if not ok:
        return None
    above = [lv.concurrency for lv in levels if lv.concurrency > max(ok)]
    return (max(ok), min(above)) if above else None


@dataclass
class AnalyzeResult:
    """Everything a run found (the reports' input)."""

    options: AnalyzeOptions
    target: str
    steps: list[str]
    space: Space
    results: list[ConfigResult]
    recommended: ConfigResult | None
    shipped: ConfigResult | None
    #: model -> the shipped configuration (as written, or as served with ``-u``).
    base_configs: dict[str, Any]
    #: model -> the recommended configuration (None without a recommendation).
    recommended_configs: dict[str, Any] | None
    info: dict[str, Any]
    elapsed_s: float
    gain_search: float | None = None
    gain_confirmed: float | None = None
    stop_reason: str = ""
    error: str | None = None
    #: The search's best when the confirmation runs did not reproduce its gain
    #: (``recommended`` is then the shipped configuration).
    unconfirmed: ConfigResult | None = None


class Analyzer:
    """One run: :meth:`run` does everything; the server is stopped (or, with
    ``-u``, the models are loaded again from the repository) even on errors."""

    def __init__(self, opts: AnalyzeOptions, progress: Progress | None = None) -> None:
        self.opts = opts
        self.progress = progress or Progress()
        self.t0 = time.monotonic()
        self.deadline = self.t0 + opts.max_minutes * 60.0
        self.own: OwnServer | None = None
        self.client: RepositoryClient | None = None
        self.tmp: Path | None = None
        self.order: list[str] = []
        self.steps: list[str] = []
        self.base: dict[str, Any] = {}
        self.shipped: dict[str, Knobs] = {}
        self.kinds: dict[str, int] = {}
        self.ensemble_mbs = 0
        self.results: list[ConfigResult] = []
        self.server_pid: int | None = None
        self.info: dict[str, Any] = {}
        self.interrupted = False
        #: Own server after setup: (memory before the load, load seconds) of the
        #: shipped configuration, loaded there; used by its first measurement.
        self._preloaded: tuple[memory.MemoryReading | None, float] | None = None

    # ------------------------------------------------------------------ setup

    def _server_cpus(self) -> int:
        if self.opts.server_cpus:
            return len(self.opts.server_cpus)
        return os.cpu_count() or 1

    def _setup_own(self) -> None:
        from pdserve.app.settings import EXAMPLE_REPOSITORY

        repo = Path(self.opts.repository or EXAMPLE_REPOSITORY)
        if not repo.is_dir():
            raise AnalyzeError(f"no model repository at {repo}")
        self.order, self.steps = models_needed(repo, self.opts.model)
        self.tmp = Path(tempfile.mkdtemp(prefix="pdserve-analyze-"))
        copy = copy_repository(repo, self.order, self.tmp / "models")
        for m in self.steps:
            try:
                self.base[m] = cfgmod.load_model_config(copy / m)
            except cfgmod.ConfigError as e:
                raise AnalyzeError(str(e)) from None
        self.own = OwnServer(
            copy,
            self.opts.output_dir / "server.log",
            cpus=self.opts.server_cpus,
            grpc=self.opts.protocol == "grpc",
            extra_args=self.opts.server_args,
        )
        self.own.start()
        self.client = RepositoryClient(self.own.http_url)
        self.server_pid = self.own.pid
        time.sleep(SETTLE_S)
        before = memory.tree_memory(self.own.pid)
        t = time.monotonic()
        self._load_plain()
        # The shipped configuration is loaded on an empty server: its measurement
        # starts from here (restart mode) instead of another server.
        self._preloaded = (before, time.monotonic() - t)
        self._read_shipped()

    def _setup_running(self) -> None:
        assert self.opts.url is not None
        self.client = RepositoryClient(self.opts.url)
        if not self.client.ready():
            raise AnalyzeError(f"no ready server at {self.client.url}")
        self.order, self.steps = self._served_models(self.opts.model)
        # A plain load changes nothing on a model loaded from its repository, and
        # fails at once, with the server's reason, outside explicit mode.
        self._load_plain()
        for m in self.steps:
            self.base[m] = cfgmod.config_from_json(self.client.config(m), m)
        self._read_shipped()
        self.server_pid = self.opts.server_pid
        if self.server_pid is None and self.client.host in ("127.0.0.1", "localhost", "::1"):
            self.server_pid = memory.listening_pid(self.client.port)
        if self.server_pid is None:
            self.progress.note(
                "the server's process is not known (give --server-pid): memory is not "
                "measured and --memory-budget not applied"
            )
        else:
            self.progress.note(
                "a running server is reloaded, not restarted: memory freed by one "
                "configuration may be reused by the next, so figures are approximate"
            )

    def _served_models(self, model: str) -> tuple[list[str], list[str]]:
        assert self.client is not None
        order: list[str] = []
        leaves: list[str] = []

        def visit(name: str, chain: tuple[str, ...]) -> None:
            if name in chain or name in order:
                return
            assert self.client is not None
            if not self.client.is_ready(name):
                self.client.load(name)
            cfg = cfgmod.config_from_json(self.client.config(name), name)
            if is_ensemble(cfg):
                for step in ensemble_steps(cfg):
                    visit(step, (*chain, name))
            elif name not in leaves:
                leaves.append(name)
            order.append(name)

        visit(model, ())
        return order, leaves

    def _load_plain(self) -> None:
        assert self.client is not None
        for m in self.order:
            try:
                self.client.load(m)
            except AnalyzeError as e:
                raise AnalyzeError(
                    f"the shipped configuration of '{m}' does not load: {e}"
                ) from None

    def _read_shipped(self) -> None:
        assert self.client is not None
        for m in self.steps:
            served = cfgmod.config_from_json(self.client.config(m), m)
            self.shipped[m] = shipped_knobs(served)
            if len(served.instance_group):
                self.kinds[m] = int(served.instance_group[0].kind)
        if self.opts.model not in self.steps:
            target = cfgmod.config_from_json(self.client.config(self.opts.model), self.opts.model)
            self.ensemble_mbs = int(target.max_batch_size)

    # ---------------------------------------------------------------- measuring

    def configs_for(self, point: Point) -> dict[str, Any]:
        """model -> the configuration (``ModelConfig``) of ``point``."""
        return {
            m: apply_knobs(self.base[m], point[m], self.shipped[m], self.kinds.get(m))
            for m in self.steps
        }

    def _perf_options(self) -> PerfOptions:
        assert self.client is not None
        if self.opts.protocol == "grpc":
            url = self.own.grpc_url if self.own is not None else self.opts.grpc_url
        else:
            url = self.client.url
        return PerfOptions(
            model=self.opts.model,
            url=url,
            protocol=self.opts.protocol,
            batch_size=self.opts.batch_size,
            concurrency=list(self.opts.concurrency),
            input_data=self.opts.input_data,
            shapes=dict(self.opts.shapes),
            measurement_interval_ms=self.opts.measurement_interval_ms,
            stability_percentage=self.opts.stability_percentage,
            max_trials=self.opts.max_trials,
            workers=self.opts.perf_workers,
        )

    def _fresh_server(self) -> None:
        """Restart mode: a new empty server; reload mode: unload the models."""
        if self.own is not None and self.opts.server_mode == "restart":
            self.own.stop()
            self.own.start()
            self.client = RepositoryClient(self.own.http_url)
            self.server_pid = self.own.pid
        else:
            assert self.client is not None
            for m in reversed(self.order):
                self.client.unload(m)
            self.client.wait_settled(self.order)
        time.sleep(SETTLE_S)

    def measure(self, point: Point, shipped: bool = False, repeat: int = 0) -> ConfigResult:
        """Load ``point`` and measure it (see the module docstring)."""
        n = len(self.results)
        result = ConfigResult(index=n, point=point, shipped=shipped, repeat=repeat)
        self.progress.config_start(n, point, shipped, repeat, time.monotonic() - self.t0)
        started = time.monotonic()
        try:
            self._measure_into(result, point)
        except AnalyzeError as e:
            result.status, result.error = "failed", str(e)
        result.elapsed_s = time.monotonic() - started
        self.results.append(result)
        self.progress.config_done(result)
        return result

    def _load_point(self, point: Point) -> tuple[memory.MemoryReading | None, float]:
        """Load ``point`` on an empty server; (memory before, load seconds)."""
        preloaded, self._preloaded = self._preloaded, None
        if preloaded is not None and point == self.shipped and self.opts.server_mode == "restart":
            return preloaded
        self._fresh_server()
        assert self.client is not None
        before = memory.tree_memory(self.server_pid) if self.server_pid else None
        configs = self.configs_for(point)
        t = time.monotonic()
        for m in self.order:
            try:
                if m in configs:
                    self.client.load(m, cfgmod.config_to_json(configs[m]))
                else:
                    self.client.load(m)
            except AnalyzeError as e:
                raise AnalyzeError(f"'{m}' does not load: {e}") from None
        return before, time.monotonic() - t

    def _measure_into(self, result: ConfigResult, point: Point) -> None:
        before, result.load_s = self._load_point(point)
        pid = self.server_pid
        after_load = memory.tree_memory(pid) if pid else None
        if before is not None and after_load is not None:
            result.memory_loaded_bytes = float(after_load.rss - before.rss)
        self.progress.loaded(result.load_s, result.memory_loaded_bytes)
        watcher = _SweepWatcher(
            self.progress, self.opts.p99_ms, self.deadline, self.opts.batch_size
        )
        sampler = memory.PeakSampler(pid) if pid else None
        timed_out = False
        try:
            if sampler is not None:
                sampler.__enter__()
            self._sweep(watcher, self.opts.concurrency)
            if watcher.reason == "p99 above the SLO":
                timed_out = self._bisect(watcher.levels)
        finally:
            if sampler is not None:
                sampler.__exit__(None, None, None)
        result.levels = sorted(watcher.levels, key=lambda lv: lv.concurrency)
        result.stop_reason = watcher.reason or "last level"
        if watcher.timed_out or timed_out:
            result.status = "partial"
        if sampler is not None and before is not None and sampler.peak_rss:
            result.memory_bytes = float(sampler.peak_rss - before.rss)
            if sampler.peak_pss is not None and before.pss is not None:
                result.memory_pss_bytes = float(sampler.peak_pss - before.pss)

    def _sweep(self, watcher: _SweepWatcher, levels: Sequence[int]) -> None:
        """``pdserve perf`` at ``levels`` in order; the levels land in ``watcher``.

        Raises:
            AnalyzeError: perf failed before any level (e.g. the request is refused).
        """
        opts = self._perf_options()
        opts.concurrency = list(levels)
        try:
            run_sweep(opts, watcher)
        except _StopSweep:
            pass
        except PerfError as e:
            if not watcher.levels:
                raise AnalyzeError(str(e)) from None
            watcher.reason = str(e)

    def _bisect(self, levels: list[LevelResult]) -> bool:
        """The doubling sweep crossed the SLO between two levels: measure up to
        ``bisect_steps`` concurrencies between them (binary search, as
        model_analyzer searches concurrency against its latency budget), adding
        them to ``levels``. Returns whether the time budget cut it."""
        slo = self.opts.p99_ms
        assert slo is not None
        bounds = bisect_bounds(levels, slo)
        if bounds is None:
            return False
        lo, hi = bounds
        for _ in range(self.opts.bisect_steps):
            mid = (lo + hi) // 2
            if mid <= lo:
                break
            step = _SweepWatcher(self.progress, slo, self.deadline, self.opts.batch_size)
            self._sweep(step, [mid])
            levels.extend(step.levels)
            if step.timed_out:
                return True
            if not step.levels:
                break
            lv = step.levels[-1]
            if lv.usable and lv.p99_ms <= slo:
                lo = mid
            else:
                hi = mid
        return False

    # ------------------------------------------------------------------ search

    def _estimate(self) -> float:
        done = [r.elapsed_s for r in self.results if r.status != "failed"]
        return sum(done) / len(done) if done else 0.0

    def _time_for(self, configs: int) -> bool:
        """Whether ``configs`` more measurements fit in the time left."""
        return time.monotonic() + self._estimate() * configs <= self.deadline

    def _search_budget(self) -> tuple[bool, str]:
        searched = sum(1 for r in self.results if r.repeat == 0)
        if searched >= self.opts.max_configs:
            return False, f"--max-configs {self.opts.max_configs} reached"
        # Keep time to confirm a gain once a configuration beats the shipped one.
        top = recommend(self.results, self.opts.constraints)
        confirm = 2 * self.opts.confirm if top is not None and not top.shipped else 0
        if not self._time_for(1 + confirm):
            return False, "time budget"
        return True, ""

    def search(self, space: Space) -> str:
        """Measure configurations in the search's order; returns why it stopped.

        Raises:
            AnalyzeError: the shipped configuration could not be measured.
            KeyboardInterrupt: Ctrl-C (the results so far are kept).
        """

        def measure(point: Point, shipped: bool) -> ConfigResult:
            r = self.measure(point, shipped=shipped)
            if shipped and (r.status == "failed" or not r.levels):
                raise AnalyzeError(
                    f"the shipped configuration could not be measured: {r.error or 'no level'}"
                )
            if self.interrupted:
                raise KeyboardInterrupt
            return r

        searcher = grid_search if self.opts.search == "grid" else quick_search
        return searcher(
            space,
            measure,
            self._search_budget,
            self.opts.constraints,
            self.opts.min_gain,
            self.progress.note,
        )

    def confirm(self, shipped: ConfigResult, rec: ConfigResult) -> None:
        """Measure the shipped and the recommended configuration again, alternately.

        Raises:
            KeyboardInterrupt: Ctrl-C.
        """
        for i in range(1, self.opts.confirm + 1):
            if not self._time_for(2):
                self.progress.note("no time left to confirm the gain")
                return
            for point, is_shipped in ((shipped.point, True), (rec.point, False)):
                self.measure(point, shipped=is_shipped, repeat=i)
                if self.interrupted:
                    raise KeyboardInterrupt

    # --------------------------------------------------------------------- run

    def run(self) -> AnalyzeResult:
        """Set up, search, confirm, recommend; the server is released at the end.

        Raises:
            AnalyzeError: the model or server cannot be used at all (not found,
                the shipped configuration does not load, the server is not in
                explicit model control mode...). Configurations that fail later
                are recorded as failed and the run goes on.
        """
        self.opts.output_dir.mkdir(parents=True, exist_ok=True)
        if self.opts.client_cpus:
            os.sched_setaffinity(0, self.opts.client_cpus)
        stop = ""
        error: str | None = None
        previous = self._catch_sigint()
        try:
            if self.opts.url is not None:
                self._setup_running()
            else:
                self._setup_own()
            space = build_space(
                self.opts.model,
                self.shipped,
                ensemble_max_batch_size=self.ensemble_mbs,
                cpus=self._server_cpus(),
                instance_counts=self.opts.instance_counts,
                max_batch_sizes=self.opts.max_batch_sizes,
                preferred=self.opts.preferred,
                queue_delays_us=self.opts.queue_delays_us,
            )
            self.info = self._info(space)
            self.progress.start(self.info)
            c = self.opts.constraints
            try:
                stop = self.search(space)
                rec = recommend(self.results, c)
                ship = next((r for r in self.results if r.shipped and r.repeat == 0), None)
                if rec is not None and ship is not None and rec is not ship:
                    self.confirm(ship, rec)
            except KeyboardInterrupt:
                stop = error = "interrupted"
        finally:
            if previous is not None:
                signal.signal(signal.SIGINT, previous)
            self._release()
        choice = decide(self.results, c, self.opts.min_gain)
        rec = choice.recommended
        return AnalyzeResult(
            options=self.opts,
            target=self.opts.model,
            steps=list(self.steps),
            space=space,
            results=self.results,
            recommended=rec,
            shipped=choice.shipped,
            base_configs=dict(self.base),
            recommended_configs=self.configs_for(rec.point) if rec is not None else None,
            info=self.info,
            elapsed_s=time.monotonic() - self.t0,
            stop_reason=stop,
            error=error,
            gain_search=choice.gain_search,
            gain_confirmed=choice.gain_confirmed,
            unconfirmed=choice.unconfirmed,
        )

    def _catch_sigint(self) -> Any:
        """Ctrl-C sets :attr:`interrupted` as well as raising KeyboardInterrupt
        (``pdserve perf`` keeps a sweep's levels on Ctrl-C and returns; the search
        must stop too). Returns the previous handler (None off the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_sigint(signum: int, frame: Any) -> None:
            self.interrupted = True
            raise KeyboardInterrupt

        return signal.signal(signal.SIGINT, on_sigint)

    def _info(self, space: Space) -> dict[str, Any]:
        if self.own is not None:
            server = f"own pdserve ({self.opts.server_mode} per configuration)"
            if self.opts.server_cpus:
                server += f", CPUs {','.join(map(str, self.opts.server_cpus))}"
        else:
            server = f"running server at {self.opts.url} (reloaded per configuration)"
        return {
            "model": self.opts.model,
            "steps": list(self.steps),
            "pipeline": self.steps != [self.opts.model],
            "server": server,
            "cpus": os.cpu_count(),
            "dims": space.describe_dims(),
            "points": space.size(),
            "search": self.opts.search,
            "max_configs": self.opts.max_configs,
            "max_minutes": self.opts.max_minutes,
            "p99_ms": self.opts.p99_ms,
            "memory_budget": self.opts.memory_budget,
            "concurrency": list(self.opts.concurrency),
            "shipped": {m: k.describe() for m, k in self.shipped.items()},
            "memory_measured": self.server_pid is not None,
        }

    def _release(self) -> None:
        if self.own is not None:
            self.own.stop()
        elif self.client is not None and self.base:
            # A running server: serve what the repository holds again.
            for m in self.order:
                try:
                    self.client.load(m)
                except AnalyzeError as e:
                    self.progress.note(f"could not load '{m}' back from the repository: {e}")
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def run_analyze(opts: AnalyzeOptions, progress: Progress | None = None) -> AnalyzeResult:
    """Run ``pdserve analyze`` (see :class:`Analyzer`)."""
    return Analyzer(opts, progress).run()


#: ``measure(point, shipped) -> result`` (the search's view of measuring).
MeasureFn = Callable[[Point, bool], ConfigResult]
#: ``budget() -> (may measure one more, why not)``.
BudgetFn = Callable[[], tuple[bool, str]]


def grid_search(
    space: Space,
    measure: MeasureFn,
    budget: BudgetFn,
    c: Constraints,
    min_gain: float = 0.0,
    note: Callable[[str], None] = lambda _: None,
) -> str:
    """Every configuration of the lattice (:meth:`Space.grid`: the shipped one
    first), each once, while ``budget`` allows; returns why it stopped."""
    seen: set[Any] = set()
    for index in space.grid():
        point = space.knobs(index)
        if point is None or point_key(point) in seen:
            continue
        if seen:
            ok, why = budget()
            if not ok:
                return why
        seen.add(point_key(point))
        measure(point, index == space.start)
    return "every configuration measured"


def quick_search(
    space: Space,
    measure: MeasureFn,
    budget: BudgetFn,
    c: Constraints,
    min_gain: float = 0.02,
    note: Callable[[str], None] = lambda _: None,
) -> str:
    """Hill climbing from the shipped configuration (model_analyzer's quick search
    on this lattice): measure every unmeasured configuration one step from the
    current one (:meth:`Space.neighbours`), move to the best configuration measured
    so far if it :func:`~.recommend.better` the current one by ``min_gain``; when
    none does, measure the ones :data:`MAX_RADIUS` steps away and go on from the
    best; stop when those do not beat it either, or ``budget`` says so. Returns
    why it stopped."""
    seen: dict[Any, tuple[int, ...]] = {}
    start = space.shipped_point()
    seen[point_key(start)] = space.start
    current = measure(start, True)
    measured = [current]
    index = space.start
    radius = 1
    while True:
        fresh = []
        for nb in space.neighbours(index, radius):
            point = space.knobs(nb)
            if point is None or point_key(point) in seen:
                continue
            seen[point_key(point)] = nb
            fresh.append(point)
        for point in fresh:
            ok, why = budget()
            if not ok:
                return why
            measured.append(measure(point, False))
        top = best(measured, c)
        if top is not None and top is not current and better(top, current, c, min_gain):
            current = top
            index = seen[point_key(top.point)]
            radius = 1
            note(f"moving to {top.label}: {top.description}")
        elif radius < MAX_RADIUS:
            radius += 1
            note(f"no better neighbour of {current.label}: looking {radius} steps away")
        else:
            return f"no configuration within {MAX_RADIUS} steps of the best is better"
