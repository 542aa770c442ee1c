"""ModelManager: model name + version -> loaded :class:`ModelVersion`.

Loads what the version policy selects from the model repository, one model at a time or
all together; a model that fails to load is reported UNAVAILABLE with its reason and
never stops the others. New versions load *beside* the serving ones and the switch is one
dict assignment, so a request always finds a complete set of ready versions; retired
versions drain their in-flight requests before they are closed (at most
:attr:`ModelManager.retire_timeout` seconds, then what still runs fails with 503).

With a memory budget (:mod:`pdserve.repository.budget`) loads run one at a time and evict
the least recently used idle unpinned models they need room for; on-demand loads
(:meth:`ModelManager.demand`) share one load per model among the requests waiting.
Ensembles, as Triton's ModelRepositoryManager: loading one first loads its missing steps
(as steps only); unloading a model unloads the served ensembles that use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pdserve import config as cfgmod
from pdserve.backends.base import ModelSpec
from pdserve.core import procmem
from pdserve.core.api import ModelHost
from pdserve.core.errors import ErrorCode, InferError, internal, unavailable
from pdserve.repository import dependencies, layout
from pdserve.repository.entry import (
    LOADING,
    READY,
    UNAVAILABLE,
    UNLOADING,
    ModelEntry,
    VersionState,
)
from pdserve.repository.memory import MemoryMeter
from pdserve.repository.model import ModelVersion
from pdserve.repository.prepare import backend_for, complete_config, read_config
from pdserve.repository.rollout_policy import RolloutPolicy
from pdserve.repository.serving import ServedModels
from pdserve.repository.staging import (
    OVERRIDE_WHERE,
    Staged,
    check_file_paths,
    check_model_name,
    public_message,
    shown,
    stage,
)
from pdserve.repository.traffic import (
    TRAFFIC_FILENAME,
    TrafficError,
    TrafficSpec,
    read_traffic_file,
)
from pdserve.scheduling import create_scheduler

log = logging.getLogger("pdserve.repository")


@dataclass
class _Load:
    """One load of one model, as it goes (:meth:`ModelManager._load_locked`)."""

    name: str
    entry: ModelEntry
    model_dir: Path
    staged: Staged | None
    #: the request's ``config`` override (None: config.pbtxt).
    override: cfgmod.ModelConfig | None
    #: how messages name the configuration.
    where: str
    mdir: layout.ModelDir = field(init=False)
    base_cfg: cfgmod.ModelConfig = field(init=False)
    versions: list[int] = field(default_factory=list)
    traffic: TrafficSpec | None = None
    #: version -> what serves it once the load switches.
    serving: dict[int, ModelVersion] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)

    @property
    def override_dir(self) -> Path | None:
        """The model folder when its config.pbtxt is overridden (for messages)."""
        return self.model_dir if self.override is not None else None


class ModelManager(ServedModels):
    """Loads, serves and unloads the models of one model repository (the served side:
    :class:`~pdserve.repository.serving.ServedModels`).

    Args:
        repository: the model repository root.
        server: the core (:class:`~pdserve.core.api.ModelHost`): passed to backends in
            :class:`ModelSpec` (BLS, ensembles), and its ``warmup`` runs on every
            freshly loaded version before it serves. None: neither.
        host_policies: host policy name -> CPU ids (``--host-policy``), passed to
            backends in :class:`ModelSpec`; a model whose instance group names a
            policy not in it fails to load (:mod:`pdserve.backends.host_policy`).
    """

    def __init__(
        self,
        repository: Path,
        server: ModelHost | None = None,
        host_policies: Mapping[str, Collection[int]] | None = None,
    ) -> None:
        super().__init__(repository)
        self.server = server
        self.host_policies: dict[str, frozenset[int]] = {
            name: frozenset(cores) for name, cores in (host_policies or {}).items()
        }
        #: held by every load while there is a budget (loads one at a time).
        self._budget_lock = asyncio.Lock()
        #: measures each loaded version's memory.
        self._meter = MemoryMeter()
        #: model name -> its folder's fingerprints when its size was last measured.
        self._known_folder: dict[str, layout.Snapshot | None] = {}
        #: model name -> the on-demand load in progress, shared by every request
        #: waiting for that model.
        self._demand: dict[str, asyncio.Task[ModelEntry]] = {}

    # -- loading --------------------------------------------------------------

    async def load_all(self, names: list[str] | None = None) -> None:
        """Load ``names`` (default: every model in the repository) concurrently, each
        as asked for by name (:attr:`ModelEntry.explicit`).

        Non-ensemble models load first so that ensembles find their steps; an
        ensemble's steps that are not in ``names`` are then loaded with it (as steps
        only), and a step of ``names`` that failed to load is not tried again: the
        ensemble fails, saying which step has no loaded version.
        """
        on_disk = layout.scan_repository(self.repository)
        wanted = sorted(on_disk) if names is None else names
        first: list[str] = []
        ensembles: list[str] = []
        for name in wanted:
            try:
                cfg = cfgmod.load_model_config(on_disk[name].path) if name in on_disk else None
            except Exception:
                cfg = None
            is_ensemble = cfg is not None and cfg.platform == cfgmod.ENSEMBLE_PLATFORM
            (ensembles if is_ensemble else first).append(name)
        # A model that fails is recorded (index, log) and never stops the others.
        await asyncio.gather(*(self.load_model(n) for n in first), return_exceptions=True)
        tried = frozenset(first)
        await asyncio.gather(
            *(self._load_model(n, None, None, True, (), tried) for n in ensembles),
            return_exceptions=True,
        )

    async def load_model(
        self,
        name: str,
        config_override: cfgmod.ModelConfig | None = None,
        files: dict[str, bytes] | None = None,
        *,
        explicit: bool = True,
    ) -> ModelEntry:
        """Load (or reload) ``name``: the versions its policy selects.

        Versions already serving with an unchanged fingerprint are kept; new or
        changed ones are loaded beside them and swapped in at once; versions the
        policy no longer selects are retired after their requests drain. A
        version that fails keeps the previously serving one (if any) in place.

        An ensemble's steps (recursively: steps that are ensembles bring theirs)
        that serve no version are loaded first, concurrently, as steps only (not
        :attr:`ModelEntry.explicit`), as Triton loads an ensemble's composing
        models. A step that fails fails the ensemble's load with Triton's "ensemble
        'E' depends on 'S' which has no loaded version" and the step's reason.

        Args:
            config_override: a ``ModelConfig`` that replaces config.pbtxt for this
                load; its ``name``, when set, must be ``name``. Errors in it are
                reported as ``<config override>: <field>: ...``.
            files: ``{"<version>/<file>": bytes}``, Triton's ``file:`` override
                (requires ``config_override``). As in Triton, the model is then
                loaded from a temporary folder holding only ``config_override`` and
                these files, never from the repository, which is left untouched;
                the folder is removed when the versions loaded from it are unloaded
                or replaced, or at once when the load fails.
            explicit: the model is asked for by name (:attr:`ModelEntry.explicit`
                is set once it serves); False: loaded as an ensemble's step.

        A newly selected version that fails to load or warm up never costs
        service: the versions it would have replaced keep serving (as many as the
        policy selects, highest first) and the failure is in the repository
        index. A load with ``config_override`` loads every selected version anew.
        Error messages and index reasons never hold the repository's absolute path
        (paths are relative to the repository; a staged folder is ``<override>``).

        Raises:
            InferError(INVALID_ARG): a bad name, ``file:`` path or override, the
                model is not in the repository, its configuration is invalid, a
                selected version failed (the entry records the reason; what
                served before still serves), or an ensemble's step failed to load
                (or ensembles step into each other); a step's failure keeps its
                code.
            InferError(UNAVAILABLE): the manager is closing.
            InferError(INTERNAL): the staged files cannot be written, or an
                unexpected fault (logged with its traceback).
        """
        return await self._load_model(name, config_override, files, explicit, (), ())

    async def _load_model(
        self,
        name: str,
        config_override: cfgmod.ModelConfig | None,
        files: dict[str, bytes] | None,
        explicit: bool,
        chain: tuple[str, ...],
        tried: Collection[str],
    ) -> ModelEntry:
        """:meth:`load_model`; ``chain``: the ensembles whose steps this load is for
        (outermost first); ``tried``: models whose failed load is not tried again as
        a step (:meth:`load_all`)."""
        check_model_name(name)
        if files:
            if config_override is None:
                raise InferError(
                    f"failed to load '{name}': 'file:' parameters require a 'config' parameter"
                )
            check_file_paths(files)
        if config_override is not None and config_override.name not in ("", name):
            raise InferError(
                f"failed to load '{name}': {OVERRIDE_WHERE}: name: the configuration names "
                f"model {shown(config_override.name)}, but the request loads '{name}'"
            )
        if self.closing:
            raise unavailable(f"failed to load '{name}': the server is shutting down")
        ensemble_cfg = self.ensemble_config(name, config_override)
        if ensemble_cfg is not None:

            async def load_step(step: str) -> ModelEntry:
                if step in chain or step == name:
                    cycle = " -> ".join((*chain, name, step))
                    raise InferError(f"circular dependency between ensembles: {cycle}")
                step_entry = self.models.get(step)
                if step in tried:  # failed already (load_all): not again
                    why = step_entry.reason if step_entry is not None else ""
                    raise InferError(why or f"failed to load '{step}'")
                return await self._load_model(step, None, None, False, (*chain, name), tried)

            await self._load_steps(name, ensemble_cfg, load_step)
        try:
            return await self._load_task(name, config_override, files)
        finally:
            entry = self.models.get(name)
            if explicit and entry is not None and entry.serving:
                entry.explicit = True

    async def _load_task(
        self, name: str, config_override: cfgmod.ModelConfig | None, files: dict[str, bytes] | None
    ) -> ModelEntry:
        """Run the load of ``name`` as a task :meth:`close` may abandon."""
        # The load runs as its own task so that close() can abandon it (a python
        # model's initialize() may block for ever) while the caller gets an answer.
        task = asyncio.ensure_future(self._load_budgeted(name, config_override, files))
        self._loads.add(task)
        task.add_done_callback(self._loads.discard)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if self.closing and task.cancelled() and not (current and current.cancelling()):
                raise unavailable(
                    f"failed to load '{name}': the server is shutting down (load abandoned)"
                ) from None
            raise

    def ensemble_config(
        self, name: str, config_override: cfgmod.ModelConfig | None = None
    ) -> cfgmod.ModelConfig | None:
        """The configuration ``name`` would load with when it is an ensemble (the
        override, else ``config.pbtxt``); None: not an ensemble, or unreadable (the
        load itself reports that)."""
        cfg = config_override
        if cfg is None:
            try:
                cfg = cfgmod.load_model_config(self.repository / name)
            except Exception:  # noqa: BLE001 - the load itself reports a broken config
                return None
        return cfg if cfg.platform == cfgmod.ENSEMBLE_PLATFORM else None

    #: The models an ensemble configuration steps into (:func:`dependencies.step_names`).
    step_names = staticmethod(dependencies.step_names)

    async def _load_steps(
        self, name: str, cfg: cfgmod.ModelConfig, load_step: Callable[[str], Awaitable[ModelEntry]]
    ) -> None:
        """Load the steps of ensemble ``name`` (configuration ``cfg``) that serve no
        version, concurrently, with ``load_step`` (explicit loads and on-demand loads
        pass their own).

        Raises:
            InferError: a step still serves no version: Triton's "ensemble 'E'
                depends on 'S' which has no loaded version" and the step's error
                (its code); recorded as the ensemble's reason in the index.
        """
        missing = [s for s in self.step_names(cfg) if s and s != name and not self.is_serving(s)]
        if not missing:
            return
        results = await asyncio.gather(*(load_step(s) for s in missing), return_exceptions=True)
        for step, result in zip(missing, results, strict=True):
            if not isinstance(result, BaseException) or self.is_serving(step):
                continue
            if not isinstance(result, InferError):
                raise result
            reason = (
                f"failed to load '{name}': ensemble '{name}' depends on '{step}' which has "
                f"no loaded version: {result}"
            )
            self._record_failure(name, reason)
            log.error("model %s failed to load: %s", name, reason)
            raise InferError(reason, result.code)

    def _record_failure(self, name: str, reason: str) -> None:
        """Show why a load of ``name`` failed before it started (index, readiness)."""
        entry = self.models.get(name)
        if entry is None:
            if not (self.repository / name).is_dir():  # no row for a typo
                return
            entry = self.models[name] = ModelEntry(name)
        entry.reason = reason
        entry.wanted = True
        for v in entry.serving:  # still serving: say why the reload did not happen
            entry.states[v] = VersionState(READY, f"reload failed: {reason}")

    async def _load_budgeted(
        self, name: str, config_override: cfgmod.ModelConfig | None, files: dict[str, bytes] | None
    ) -> ModelEntry:
        """:meth:`load_model` within the memory budget (when there is one): room is
        made before the load and checked again with the measured size after it."""
        if self.budget.budget_bytes is None:
            return await self._load_named(name, config_override, files)
        async with self._budget_lock:
            if self.closing:
                raise unavailable(f"failed to load '{name}': the server is shutting down")
            before = self.models.get(name)
            was_serving = before is not None and bool(before.serving)
            folder = self._folder_snapshot(name) if config_override is None else None
            estimate = self.budget.known_size.get(name, 0)
            if folder is None or self._known_folder.get(name) != folder:
                estimate = 0  # changed on disk or overridden: its old size says nothing
            try:
                await self._make_room(name, estimate)
            except InferError as e:
                if not was_serving and (self.repository / name).is_dir():
                    self.models.setdefault(name, ModelEntry(name)).reason = str(e)
                raise
            failed: InferError | None = None
            try:
                entry = await self._load_named(name, config_override, files)
            except InferError as e:  # some versions may serve all the same
                failed = e
                current = self.models.get(name)
                if current is None or not current.serving:
                    raise
                entry = current
            size = self.model_bytes(name)
            self.budget.known_size[name] = size
            if folder is not None:
                self._known_folder[name] = folder
            try:
                await self._make_room(name, size)
            except InferError as e:
                if not was_serving:  # a reload keeps what served; a new load goes
                    await self._evict(name, reason=str(e), force=True)
                else:
                    log.warning("model %s: reloaded over the memory budget: %s", name, e)
                raise
            if failed is not None:
                raise failed
            return entry

    def _folder_snapshot(self, name: str) -> layout.Snapshot | None:
        """Fingerprints of the model folder (config and files, as poll mode compares
        them), or None when it cannot be read: a remembered size is used only while
        the folder is unchanged."""
        path = self.repository / name
        try:
            return layout.snapshot(layout.ModelDir(name, path, layout.list_versions(path)))
        except Exception:  # noqa: BLE001 - the load reports a missing or broken folder
            return None

    async def _load_named(
        self, name: str, config_override: cfgmod.ModelConfig | None, files: dict[str, bytes] | None
    ) -> ModelEntry:
        """:meth:`load_model` once its arguments are checked (the model's lock held)."""
        async with self._lock(name):
            if self.closing:
                raise unavailable(f"failed to load '{name}': the server is shutting down")
            staged = None
            try:
                if files:
                    staged = await stage(name, config_override, files)
                return await self._load_locked(name, config_override, staged)
            except InferError:
                raise
            except Exception as e:  # a fault of ours: never a raw exception or a path
                log.exception("loading model %s failed", name)
                raise internal(
                    f"failed to load '{name}': {type(e).__name__}: {self._public(str(e))}"
                ) from None
            finally:
                if staged is not None and staged.users == 0:  # nothing serves from it
                    await asyncio.to_thread(staged.remove)

    def _public(self, message: str, override_dir: Path | None = None) -> str:
        """``message`` without absolute paths (:func:`staging.public_message`)."""
        return public_message(message, self.repository, override_dir)

    async def _load_locked(
        self, name: str, config_override: cfgmod.ModelConfig | None, staged: Staged | None
    ) -> ModelEntry:
        """Load ``name`` (its lock held): read its configuration, load the selected
        versions beside the serving ones, then switch to them at once."""
        entry = self.models.get(name) or ModelEntry(name)
        model_dir = staged.model_dir if staged is not None else self.repository / name
        load = _Load(
            name=name,
            entry=entry,
            model_dir=model_dir,
            staged=staged,
            override=config_override,
            where=OVERRIDE_WHERE if config_override is not None else f"{name}/config.pbtxt",
        )
        self._read_model(load)
        for v in list(entry.states):  # forget failures of versions no longer selected
            if v not in entry.serving and v not in load.versions:
                if entry.states[v].state == UNAVAILABLE:
                    del entry.states[v]
        await asyncio.gather(*(self._load_selected(load, v) for v in load.versions))
        old = entry.serving
        if self.closing:  # shut down while loading: serve nothing new
            await self._close_fresh(load.serving, old)
            raise unavailable(f"failed to load '{name}': the server is shutting down")
        if load.errors:
            # Keep the versions the failed ones were to replace, highest first, so
            # that as many versions serve as the policy asks for.
            for v in sorted(old, reverse=True):
                if len(load.serving) >= len(load.versions):
                    break
                if v not in load.serving:
                    load.serving[v] = old[v]
                    entry.states[v] = VersionState(
                        READY, "kept serving: its replacement failed to load"
                    )
        await self._recheck_cycle(load, old)
        self._switch(load, old)
        if load.errors:
            kept = f"; serving versions {sorted(entry.serving)}" if entry.serving else ""
            raise InferError(f"failed to load '{name}': {'; '.join(load.errors)}{kept}")
        return entry

    def _read_model(self, load: _Load) -> None:
        """Read the model folder, its configuration, the versions its policy selects and
        its traffic file into ``load``.

        Raises:
            InferError: any of them is missing or invalid (recorded as the model's
                reason; what serves keeps serving).
        """
        name, model_dir = load.name, load.model_dir
        try:
            if load.staged is None and not model_dir.is_dir():
                raise InferError(f"failed to load '{name}': no such model in the repository")
            load.mdir = layout.ModelDir(name, model_dir, layout.list_versions(model_dir))
            load.base_cfg = read_config(load.mdir, load.override, load.where)
            self._check_no_cycle(name, load.base_cfg)
            load.versions = layout.select_versions(load.base_cfg, load.mdir.versions)
            if not load.versions:
                raise InferError(
                    f"failed to load '{name}': no version folder selected by the version "
                    f"policy (found {load.mdir.versions})"
                )
            load.traffic = read_traffic_file(model_dir)
            if load.traffic is not None and load.traffic.rollout is not None:
                RolloutPolicy.parse(load.traffic.rollout, f"{TRAFFIC_FILENAME}: rollout")
        except (cfgmod.ConfigError, InferError, TrafficError) as e:
            said = str(e) if isinstance(e, InferError) else f"failed to load '{name}': {e}"
            reason = self._public(said, load.override_dir)
            entry = load.entry
            entry.reason = reason
            entry.wanted = True
            for v in entry.serving:  # still serving: say why the reload did not happen
                entry.states[v] = VersionState(READY, f"reload failed: {reason}")
            if (self.repository / name).is_dir() or name in self.models:  # no row for a typo
                self.models.setdefault(name, entry)
            log.error("model %s failed to load: %s", name, e)
            code = e.code if isinstance(e, InferError) else ErrorCode.INVALID_ARG
            raise InferError(reason, code) from None

    async def _load_selected(self, load: _Load, v: int) -> None:
        """Load version ``v`` into ``load.serving`` (or keep the serving one when its
        files are unchanged); a failure becomes the version's reason."""
        name, entry = load.name, load.entry
        fp = layout.fingerprint(load.mdir, v)
        current = entry.serving.get(v)
        if current is not None and entry.fingerprints.get(v) == fp and load.override is None:
            load.serving[v] = current
            entry.states[v] = VersionState(READY)
            return
        if current is None:  # a serving version stays READY while its copy loads
            entry.states[v] = VersionState(LOADING)
        try:
            mv = await self._load_version(name, v, load.base_cfg, load.model_dir, load.where)
        except Exception as e:  # every failure becomes the version's reason
            reason = self._public(str(e) or type(e).__name__, load.override_dir)
            entry.states[v] = VersionState(UNAVAILABLE, reason)
            load.errors.append(f"version {v}: {reason}")
            log.error("model %s version %d failed to load: %s", name, v, e)
            if current is not None:  # keep serving what worked
                load.serving[v] = current
                entry.states[v] = VersionState(READY, f"reload failed: {reason}")
            return
        if load.staged is not None:  # the staged folder lives as long as mv
            load.staged.users += 1
            self._staged[id(mv)] = load.staged
        load.serving[v] = mv
        # Loaded with an override: the next plain load must reload it from disk.
        entry.fingerprints[v] = fp if load.override is None else ""
        entry.states[v] = VersionState(READY)
        count = len(mv.instances)
        log.info(
            "loaded model %s version %d (backend %s, %d instance%s)",
            name,
            v,
            mv.backend,
            count,
            "" if count == 1 else "s",
        )

    async def _close_fresh(
        self, serving: dict[int, ModelVersion], old: dict[int, ModelVersion]
    ) -> None:
        """Close the versions of ``serving`` that this load made (not in ``old``)."""
        fresh = [mv for v, mv in serving.items() if old.get(v) is not mv]
        await asyncio.gather(*(mv.close() for mv in fresh), return_exceptions=True)
        for mv in fresh:
            await self._release(mv)

    async def _recheck_cycle(self, load: _Load, old: dict[int, ModelVersion]) -> None:
        """A concurrent load may have closed an ensemble cycle since :meth:`_read_model`:
        then nothing new serves.

        Raises:
            InferError(INVALID_ARG): the cycle.
        """
        try:
            self._check_no_cycle(load.name, load.base_cfg)
        except InferError as e:
            await self._close_fresh(load.serving, old)
            entry = load.entry
            for v, mv in load.serving.items():
                if old.get(v) is not mv:  # not switched to: reload it next time
                    entry.fingerprints[v] = ""
                    if v not in old:
                        entry.states[v] = VersionState(UNAVAILABLE, str(e))
            self._record_failure(load.name, str(e))
            log.error("model %s failed to load: %s", load.name, e)
            raise

    def _switch(self, load: _Load, old: dict[int, ModelVersion]) -> None:
        """Serve ``load.serving`` (one assignment) and retire what it replaces."""
        name, entry = load.name, load.entry
        entry.serving = dict(sorted(load.serving.items()))  # the atomic switch
        entry.traffic = load.traffic
        entry.traffic_gen += 1
        entry.traffic_free = False  # traffic control adopts the traffic file first
        entry.reason = "; ".join(load.errors)
        entry.wanted = True
        self.models[name] = entry
        if any(old.get(v) is not mv for v, mv in entry.serving.items()):
            self.budget.counter(name).loads += 1
            self.budget.touch(name)
        for v, mv in old.items():
            if entry.serving.get(v) is not mv:
                gone = v not in entry.serving
                if gone:
                    entry.states[v] = VersionState(UNLOADING)
                self._retire(entry, v, mv, forget=gone)

    def _check_no_cycle(self, name: str, cfg: cfgmod.ModelConfig) -> None:
        """Ensemble ``name`` about to serve configuration ``cfg`` must not reach itself
        through the steps of the ensembles that serve now (each request would recurse
        until its client leaves), as Triton refuses it.

        Raises:
            InferError(INVALID_ARG): "circular dependency between ensembles: A -> B -> A".
        """
        cycle = dependencies.find_cycle(self.models, name, cfg)
        if cycle:
            raise InferError(
                f"failed to load '{name}': circular dependency between ensembles: "
                + " -> ".join(cycle)
            )

    async def _load_version(
        self, name: str, version: int, base_cfg: cfgmod.ModelConfig, model_dir: Path, where: str
    ) -> ModelVersion:
        cfg = copy.deepcopy(base_cfg)
        spec = ModelSpec(
            name=name,
            version=version,
            config=cfg,
            model_dir=model_dir,
            version_dir=layout.version_path(model_dir, version),
            repository=self.repository,
            server=self.server,
            host_policies=self.host_policies,
        )
        backend = backend_for(cfg)
        await complete_config(spec, backend, self.host_policies, where=where)
        mv = ModelVersion(spec, cfg.platform or cfg.backend, backend.name)
        ensemble = cfg.platform == cfgmod.ENSEMBLE_PLATFORM
        in_process = backend.in_process and not ensemble
        lock = self._meter.lock if in_process else contextlib.nullcontext()
        async with lock:
            rss_before = procmem.own_rss() if in_process else None
            gpu_before = await asyncio.to_thread(procmem.gpu_memory_by_pid)
            mv.instances = await backend.load(spec)
            try:
                mv.scheduler = create_scheduler(mv)
            except Exception:  # the rate limiter refused them: stop the instances
                await mv.close()
                raise
            if self.server is not None:
                await mv.warm_up(self.server.warmup)
            self._meter.measure(mv, in_process, ensemble, rss_before, gpu_before)
        return mv

    # -- on-demand loads ------------------------------------------------------

    def can_demand(self, name: str) -> bool:
        """True when a request for ``name`` may load it on demand: a well-formed name of
        a model folder in the repository (with or without ``config.pbtxt``) that has no
        served version."""
        if self.closing:
            return False
        try:
            check_model_name(name)
        except InferError:
            return False
        entry = self.models.get(name)
        if entry is not None and entry.serving:
            return False
        return (self.repository / name).is_dir()  # config.pbtxt may be auto-completed

    async def demand(self, name: str, timeout: float | None) -> None:
        """Load ``name`` for a request that found it not loaded (on-demand mode) and
        wait for it, at most ``timeout`` s (None: no limit).

        Every request that misses counts in ``misses``; requests for a model whose
        load is already under way wait for that same load (one load, all served). A
        request that stops waiting (timeout, client gone) leaves the load running for
        the others. An ensemble's missing steps load first.

        Raises:
            InferError(UNAVAILABLE): not loaded within ``timeout``, or the budget has
                no room now; the load's own error when it failed (INVALID_ARG: e.g.
                the model alone exceeds the budget).
        """
        self.budget.counter(name).misses += 1
        try:
            await asyncio.wait_for(asyncio.shield(self._demand_task(name)), timeout)
        except TimeoutError:
            raise unavailable(
                f"model '{name}' is being loaded on demand and was not ready within "
                f"{timeout:g} s; retry later"
            ) from None

    def _demand_task(
        self, name: str, explicit: bool = True, chain: tuple[str, ...] = ()
    ) -> asyncio.Task[ModelEntry]:
        """The on-demand load of ``name`` in progress, started if there is none.

        ``explicit``: a request asked for ``name`` itself (not only for an ensemble
        it is a step of): it is :attr:`ModelEntry.explicit` once loaded. ``chain``:
        the ensembles (outermost first) whose steps this load is for.
        """
        task = self._demand.get(name)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._demand_load(name, chain))
            self._demand[name] = task

            def done(t: asyncio.Task[ModelEntry]) -> None:
                if self._demand.get(name) is t:
                    del self._demand[name]
                if not t.cancelled():
                    t.exception()  # retrieved: the waiters got it

            task.add_done_callback(done)
        if explicit:

            def mark(t: asyncio.Task[ModelEntry]) -> None:
                entry = self.models.get(name)
                if not t.cancelled() and entry is not None and entry.serving:
                    entry.explicit = True

            task.add_done_callback(mark)
        return task

    async def _demand_load(self, name: str, chain: tuple[str, ...]) -> ModelEntry:
        cfg = self.ensemble_config(name)
        if cfg is not None:  # its steps' loads are shared with requests for them

            async def load_step(step: str) -> ModelEntry:
                if step in chain:  # waiting for an ensemble that waits for this one
                    cycle = " -> ".join((*chain, name, step))
                    raise InferError(f"circular dependency between ensembles: {cycle}")
                return await self._demand_task(step, False, (*chain, name))

            await self._load_steps(name, cfg, load_step)
        log.info("model %s: not loaded; loading it on demand", name)
        return await self.load_model(name, explicit=False)
