"""ModelManager: model name + version -> loaded :class:`ModelVersion`.

Loads what the version policy selects from the model repository, one model at a
time or all together; a model that fails to load is reported UNAVAILABLE with its
reason and never stops the others. New versions are loaded *beside* the serving
ones and the switch is one dict assignment, so a request always finds a complete
set of ready versions; retired versions drain their in-flight requests before
they are closed (at most :attr:`ModelManager.retire_timeout` seconds; then what is
still running is failed with 503 and its instances are stopped, python workers
killed).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve import config as cfgmod
from pdserve.backends.base import ModelSpec
from pdserve.core.api import ModelHost
from pdserve.core.errors import InferError, not_found, unavailable
from pdserve.repository import layout
from pdserve.repository.model import ModelVersion
from pdserve.repository.prepare import backend_for, complete_config, read_config
from pdserve.scheduling import create_scheduler

log = logging.getLogger("pdserve.repository")

#: Seconds a retired (unloaded or replaced) version may take to finish its
#: in-flight requests before they fail with 503 and its instances are stopped.
RETIRE_TIMEOUT_S = 60.0

READY = "READY"
UNAVAILABLE = "UNAVAILABLE"
LOADING = "LOADING"
UNLOADING = "UNLOADING"


@dataclass
class VersionState:
    """What the repository index reports for one version."""

    state: str
    reason: str = ""


@dataclass
class ModelEntry:
    """Everything known about one model name.

    Attributes:
        serving: version -> ready ModelVersion; replaced as a whole, never mutated.
        states: version -> state and reason (for the repository index).
        default_version: served when a request names no version (highest ready).
        wanted: the model is meant to be served (a load was asked for and no unload
            since); ``--strict-readiness`` waits for every wanted model.
    """

    name: str
    serving: dict[int, ModelVersion] = field(default_factory=dict)
    states: dict[int, VersionState] = field(default_factory=dict)
    reason: str = ""
    fingerprints: dict[int, str] = field(default_factory=dict)
    wanted: bool = False

    @property
    def default_version(self) -> ModelVersion | None:
        """The highest ready version."""
        return self.serving[max(self.serving)] if self.serving else None


def check_model_name(name: str) -> None:
    """Refuse a model name that is not one plain folder name of the repository.

    A model name becomes a path (``<repository>/<name>``) when the repository API
    loads it and writes ``file:`` contents, so ``..``, ``.``, separators, NUL and
    absolute paths are refused before anything touches the disk.

    Raises:
        InferError(INVALID_ARG): the name is empty, ``.``/``..``, hidden, or holds ``/``,
            ``\\`` or NUL.
    """
    if (
        not name
        or name in (".", "..")
        or name.startswith(".")
        or any(c in name for c in ("/", "\\", "\0"))
    ):
        raise InferError(
            f"invalid model name {name!r}: it must be one folder name of the repository"
        )


def _write_files(files: dict[Path, bytes]) -> None:
    """Write each file through a temporary name and a rename."""
    for target, data in files.items():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.pdserve-tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)


class ModelManager:
    """Loads, serves and unloads the models of one model repository.

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
        self.repository = Path(repository)
        self.server = server
        self.host_policies: dict[str, frozenset[int]] = {
            name: frozenset(cores) for name, cores in (host_policies or {}).items()
        }
        self.models: dict[str, ModelEntry] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        #: set by :meth:`close`: loads are refused from then on.
        self.closing = False
        #: seconds a retired version may drain before it is closed by force.
        self.retire_timeout = RETIRE_TIMEOUT_S
        #: set by :meth:`close` once its own timeout has passed: retirements in
        #: progress stop waiting for their requests.
        self._cut: asyncio.Event | None = None

    # -- lookups (hot path) ---------------------------------------------------

    def get(self, name: str, version: str = "") -> ModelVersion:
        """The ready model version for a request.

        Raises:
            InferError(NOT_FOUND): unknown model, or a version that is not served.
            InferError(UNAVAILABLE): the model exists but no version is ready.
        """
        entry = self.models.get(name)
        if entry is None:
            raise not_found(f"Request for unknown model: '{name}' is not found")
        if not version:
            mv = entry.default_version
            if mv is None:
                reason = f": {entry.reason}" if entry.reason else ""
                raise unavailable(
                    f"Request for unknown model: '{name}' has no available versions{reason}"
                )
            return mv
        if not (version.isascii() and version.isdigit()):  # int() would take "+2", "٢", "2_0"
            raise InferError(f"model version '{version}' is not a number")
        mv = entry.serving.get(int(version))
        if mv is None:
            raise not_found(f"Request for unknown model: '{name}' version {version} is not found")
        return mv

    def ready_versions(self, name: str) -> list[str]:
        """Served versions of ``name``, ascending, as strings."""
        entry = self.models.get(name)
        return [str(v) for v in sorted(entry.serving)] if entry else []

    def index(self) -> list[dict[str, str]]:
        """Repository index rows ``{name, version, state, reason}`` (Triton's shape).

        Models present in the repository but never loaded are listed with no
        version and no state, as Triton does in explicit mode.
        """
        rows: list[dict[str, str]] = []
        try:
            on_disk = layout.scan_repository(self.repository)
        except Exception:  # repository vanished: index what we know
            on_disk = {}
        for name in sorted(set(on_disk) | set(self.models)):
            entry = self.models.get(name)
            if entry is None or not entry.states:
                row = {"name": name}
                if entry is not None and entry.reason:
                    row.update(state=UNAVAILABLE, reason=entry.reason)
                rows.append(row)
                continue
            for v, st in sorted(entry.states.items()):
                rows.append(
                    {"name": name, "version": str(v), "state": st.state, "reason": st.reason}
                )
        return rows

    # -- loading --------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    async def load_all(self, names: list[str] | None = None) -> None:
        """Load ``names`` (default: every model in the repository) concurrently.

        Non-ensemble models load first so that ensembles find their steps.
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
        await asyncio.gather(*(self.load_model(n) for n in ensembles), return_exceptions=True)

    async def load_model(
        self, name: str, config_override: Any = None, files: dict[str, bytes] | None = None
    ) -> ModelEntry:
        """Load (or reload) ``name``: the versions its policy selects.

        Versions already serving with an unchanged fingerprint are kept; new or
        changed ones are loaded beside them and swapped in at once; versions the
        policy no longer selects are retired after their requests drain. A
        version that fails keeps the previously serving one (if any) in place.

        Args:
            config_override: a ``ModelConfig`` that replaces config.pbtxt.
            files: ``{"<version>/<file>": bytes}`` written into the model folder first.

        A newly selected version that fails to load or warm up never costs
        service: the versions it would have replaced keep serving (as many as the
        policy selects, highest first) and the failure is in the repository
        index. A load with ``config_override`` loads every selected version anew.

        Raises:
            InferError(INVALID_ARG): the model is not in the repository, its
                configuration is invalid, or a selected version failed (the
                entry records the reason; what served before still serves).
            InferError(UNAVAILABLE): the manager is closing.
        """
        check_model_name(name)
        if self.closing:
            raise unavailable(f"failed to load '{name}': the server is shutting down")
        async with self._lock(name):
            if self.closing:
                raise unavailable(f"failed to load '{name}': the server is shutting down")
            return await self._load_locked(name, config_override, files)

    async def _load_locked(
        self, name: str, config_override: Any, files: dict[str, bytes] | None
    ) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None:
            entry = ModelEntry(name)
        model_dir = self.repository / name
        if files:
            root = model_dir.resolve()
            targets = {}
            for rel in files:
                target = (model_dir / rel).resolve()
                if target == root or not target.is_relative_to(root):
                    raise InferError(f"file path '{rel}' escapes the model folder")
                targets[rel] = target
            # Off the event loop (model files are large); each file appears whole.
            await asyncio.to_thread(_write_files, {targets[r]: d for r, d in files.items()})
        try:
            if not model_dir.is_dir():
                raise InferError(f"failed to load '{name}': no such model in the repository")
            mdir = layout.scan_repository(self.repository).get(name)
            if mdir is None:
                raise InferError(f"failed to load '{name}': no such model in the repository")
            base_cfg = read_config(mdir, config_override)
            versions = layout.select_versions(base_cfg, mdir.versions)
            if not versions:
                raise InferError(
                    f"failed to load '{name}': no version folder selected by the version "
                    f"policy (found {mdir.versions})"
                )
        except (cfgmod.ConfigError, InferError) as e:
            entry.reason = str(e)
            entry.wanted = True
            for v in entry.serving:  # still serving: say why the reload did not happen
                entry.states[v] = VersionState(READY, f"reload failed: {e}")
            if model_dir.is_dir() or name in self.models:  # no index row for a typo
                self.models.setdefault(name, entry)
            log.error("model %s failed to load: %s", name, e)
            raise InferError(str(e)) from e

        for v in list(entry.states):  # forget failures of versions no longer selected
            if v not in entry.serving and v not in versions:
                if entry.states[v].state == UNAVAILABLE:
                    del entry.states[v]
        new_serving: dict[int, ModelVersion] = {}
        errors: list[str] = []

        async def load_version(v: int) -> None:
            fp = layout.fingerprint(mdir, v)
            current = entry.serving.get(v)
            if current is not None and entry.fingerprints.get(v) == fp and config_override is None:
                new_serving[v] = current
                entry.states[v] = VersionState(READY)
                return
            if current is None:  # a serving version stays READY while its copy loads
                entry.states[v] = VersionState(LOADING)
            try:
                mv = await self._load_version(name, v, base_cfg, model_dir)
            except Exception as e:  # every failure becomes the version's reason
                reason = str(e) or type(e).__name__
                entry.states[v] = VersionState(UNAVAILABLE, reason)
                errors.append(f"version {v}: {reason}")
                log.error("model %s version %d failed to load: %s", name, v, reason)
                if current is not None:  # keep serving what worked
                    new_serving[v] = current
                    entry.states[v] = VersionState(READY, f"reload failed: {reason}")
                return
            new_serving[v] = mv
            # Loaded with an override: the next plain load must reload it from disk.
            entry.fingerprints[v] = fp if config_override is None else ""
            entry.states[v] = VersionState(READY)
            log.info(
                "loaded model %s version %d (backend %s, %d instance%s)",
                name,
                v,
                mv.backend,
                len(mv.instances),
                "" if len(mv.instances) == 1 else "s",
            )

        await asyncio.gather(*(load_version(v) for v in versions))
        old = entry.serving
        if self.closing:  # shut down while loading: serve nothing new
            fresh = [mv for v, mv in new_serving.items() if old.get(v) is not mv]
            await asyncio.gather(*(mv.close() for mv in fresh), return_exceptions=True)
            raise unavailable(f"failed to load '{name}': the server is shutting down")
        if errors:
            # Keep the versions the failed ones were to replace, highest first, so
            # that as many versions serve as the policy asks for.
            for v in sorted(old, reverse=True):
                if len(new_serving) >= len(versions):
                    break
                if v not in new_serving:
                    new_serving[v] = old[v]
                    entry.states[v] = VersionState(
                        READY, "kept serving: its replacement failed to load"
                    )
        entry.serving = dict(sorted(new_serving.items()))  # the atomic switch
        entry.reason = "; ".join(errors)
        entry.wanted = True
        self.models[name] = entry
        for v, mv in old.items():
            if entry.serving.get(v) is not mv:
                gone = v not in entry.serving
                if gone:
                    entry.states[v] = VersionState(UNLOADING)
                self._retire(entry, v, mv, forget=gone)
        if errors:
            kept = f"; serving versions {sorted(entry.serving)}" if entry.serving else ""
            raise InferError(f"failed to load '{name}': {'; '.join(errors)}{kept}")
        return entry

    async def _load_version(
        self, name: str, version: int, base_cfg: Any, model_dir: Path
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
        await complete_config(spec, backend, self.host_policies)
        mv = ModelVersion(spec, cfg.platform or cfg.backend, backend.name)
        mv.instances = await backend.load(spec)
        mv.scheduler = create_scheduler(mv)
        if self.server is not None:
            try:
                await self.server.warmup(mv)
            except Exception:
                await mv.close()
                raise
        return mv

    def _retire(self, entry: ModelEntry, version: int, mv: ModelVersion, forget: bool) -> None:
        """Drain ``mv``'s in-flight requests in the background, then close it."""

        async def retire() -> None:
            if self._cut is None:
                self._cut = asyncio.Event()
            drain = asyncio.ensure_future(mv.drain(self.retire_timeout))
            cut = asyncio.ensure_future(self._cut.wait())
            try:
                await asyncio.wait({drain, cut}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                drain.cancel()
                cut.cancel()
            if mv.inflight:
                log.warning(
                    "model %s version %d: %d requests still in flight after the unload "
                    "timeout; failing them",
                    entry.name,
                    version,
                    mv.inflight,
                )
            await mv.close(0.0 if mv.inflight else None)
            if forget and version not in entry.serving:
                entry.states.pop(version, None)
                entry.fingerprints.pop(version, None)
            log.info("unloaded model %s version %d", entry.name, version)

        task = asyncio.get_running_loop().create_task(retire())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def dependents(self, name: str) -> list[str]:
        """Served ensembles with a step that uses model ``name``."""
        found = []
        for other, entry in self.models.items():
            mv = entry.default_version
            if other == name or mv is None or mv.config.platform != cfgmod.ENSEMBLE_PLATFORM:
                continue
            if any(step.model_name == name for step in mv.config.ensemble_scheduling.step):
                found.append(other)
        return sorted(found)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Stop serving ``name``; in-flight and queued requests finish first (in the
        background: new requests get 404/503 at once).

        Args:
            unload_dependents: also unload the ensembles that use ``name``.

        Raises:
            InferError(INVALID_ARG): the model is not loaded.
        """
        if unload_dependents:
            for dep in self.dependents(name):
                try:
                    await self.unload_model(dep, True)
                except InferError as e:
                    log.warning("unloading %s (depends on %s): %s", dep, name, e)
        async with self._lock(name):
            entry = self.models.get(name)
            if entry is None or not entry.serving:
                raise InferError(f"failed to unload '{name}': model is not loaded")
            old = entry.serving
            entry.serving = {}
            entry.wanted = False
            for v in old:
                entry.states[v] = VersionState(UNLOADING)
            entry.reason = "unloaded"
            for v, mv in old.items():
                self._retire(entry, v, mv, forget=True)

    async def wait_retired(self) -> None:
        """Wait for every background retirement to finish."""
        while self._retiring:
            await asyncio.gather(*list(self._retiring), return_exceptions=True)

    async def close(self, timeout: float | None = None) -> None:
        """Unload everything: wait up to ``timeout`` s for in-flight requests, then close.

        Loads are refused from the start; loads already running are waited for
        (within the same ``timeout``) and serve nothing.
        """
        self.closing = True
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + max(0.0, timeout)

        def left() -> float | None:
            return None if deadline is None else max(0.0, deadline - loop.time())

        locks = list(self._locks.values())
        if locks:

            async def wait_loads() -> None:
                for lock in locks:
                    async with lock:
                        pass

            try:
                await asyncio.wait_for(wait_loads(), left())
            except TimeoutError:
                log.warning("closing while a model is still loading")
        versions = [mv for e in self.models.values() for mv in e.serving.values()]
        if versions:
            tasks: list[asyncio.Future[Any]] = [
                asyncio.ensure_future(mv.drain()) for mv in versions
            ]
            retiring = [asyncio.ensure_future(asyncio.shield(t)) for t in self._retiring]
            _, pending = await asyncio.wait(tasks + retiring, timeout=left())
            for t in pending:
                t.cancel()
        for e in self.models.values():
            e.serving = {}
        # Past the timeout: what is still in flight fails (503), stuck workers are killed.
        if self._cut is None:
            self._cut = asyncio.Event()
        self._cut.set()
        await asyncio.gather(*(mv.close(left()) for mv in versions), return_exceptions=True)
        await self.wait_retired()
