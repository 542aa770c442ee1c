"""The run of ``pdserve analyze``: set up the server (its own or a running one),
search the configurations (:mod:`.search`), measure each (:mod:`.sweep`, and the
memory from ``/proc``) and pick the recommendation (:mod:`.recommend`).

Time (``--max-minutes``): a configuration starts only while the time left covers
the mean time a configuration took so far (plus the confirmation runs); one under
way when the budget ends is stopped and kept (``partial``).

Confirmation: after the search, the shipped and the recommended configurations are
measured again, alternately (``--confirm`` times each); the confirmed gain is the
ratio of their medians. Below ``1 + min_gain`` (with the shipped configuration
meeting the objective) the search's best was picked by noise, and the shipped
configuration is recommended instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from pdserve import config as cfgmod
from pdserve.app.analyze import memory
from pdserve.app.analyze.options import AnalyzeInfo, AnalyzeOptions, Progress
from pdserve.app.analyze.recommend import ConfigResult, LevelResult, decide, recommend
from pdserve.app.analyze.search import grid_search, quick_search
from pdserve.app.analyze.server import (
    AnalyzeError,
    OwnServer,
    RepositoryClient,
    copy_repository,
    models_needed,
    walk_models,
)
from pdserve.app.analyze.space import (
    Knobs,
    Point,
    Space,
    apply_knobs,
    build_space,
    shipped_knobs,
)
from pdserve.app.analyze.sweep import SweepWatcher, bisect, sweep
from pdserve.app.perf import PerfOptions
from pdserve.config import ModelConfig

#: What ``signal.signal`` returns and takes: a handler, SIG_DFL / SIG_IGN, or None.
SigintHandler = Callable[[int, FrameType | None], object] | int | signal.Handlers | None

#: Seconds an empty server waits after starting (or the models' unload) before
#: the memory is read.
SETTLE_S = 0.3


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
    base_configs: dict[str, ModelConfig]
    #: model -> the recommended configuration (None without a recommendation).
    recommended_configs: dict[str, ModelConfig] | None
    info: AnalyzeInfo
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
        self.base: dict[str, ModelConfig] = {}
        self.shipped: dict[str, Knobs] = {}
        self.kinds: dict[str, int] = {}
        self.ensemble_mbs = 0
        self.results: list[ConfigResult] = []
        self.server_pid: int | None = None
        self.info: AnalyzeInfo = {}
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
        """(models in load order, steps to tune) as the server serves them; a model
        not loaded yet is loaded from its repository."""
        client = self.client
        assert client is not None

        def config_of(name: str) -> cfgmod.ModelConfig:
            if not client.is_ready(name):
                client.load(name)
            return cfgmod.config_from_json(client.config(name), name)

        return walk_models(model, config_of)

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

    def configs_for(self, point: Point) -> dict[str, ModelConfig]:
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
        """Load ``point`` and measure it. Own server in ``restart`` mode (default): on
        a fresh server with no model loaded, so the memory before the load is that of
        an empty server; ``reload`` mode and a running server: after the models'
        unload. The tuned models load through the repository API with their
        configuration as a ``config`` override (the ensemble, if any, as it is), then
        the concurrency sweep (:mod:`.sweep`) runs while the server's memory is
        sampled. A failure is recorded in the result (``failed``)."""
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
        watcher = self._watcher()
        sampler = memory.PeakSampler(pid) if pid else None
        timed_out = False
        try:
            if sampler is not None:
                sampler.__enter__()
            sweep(self._perf_options(), watcher, self.opts.concurrency)
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

    def _watcher(self) -> SweepWatcher:
        return SweepWatcher(self.progress, self.opts.p99_ms, self.deadline, self.opts.batch_size)

    def _bisect(self, levels: list[LevelResult]) -> bool:
        """Bisect between the levels around the SLO (:func:`.sweep.bisect`)."""
        assert self.opts.p99_ms is not None

        def measure(concurrency: int) -> SweepWatcher:
            watcher = self._watcher()
            sweep(self._perf_options(), watcher, [concurrency])
            return watcher

        return bisect(levels, self.opts.p99_ms, self.opts.bisect_steps, measure)

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

    def _catch_sigint(self) -> SigintHandler:
        """Ctrl-C sets :attr:`interrupted` as well as raising KeyboardInterrupt
        (``pdserve perf`` keeps a sweep's levels on Ctrl-C and returns; the search
        must stop too). Returns the previous handler (None off the main thread)."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def on_sigint(signum: int, frame: FrameType | None) -> None:
            self.interrupted = True
            raise KeyboardInterrupt

        return signal.signal(signal.SIGINT, on_sigint)

    def _info(self, space: Space) -> AnalyzeInfo:
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
