"""ModelManager: model name + version -> loaded :class:`ModelVersion`.

Loads what the version policy selects from the model repository, one model at a
time or all together; a model that fails to load is reported UNAVAILABLE with its
reason and never stops the others. New versions are loaded *beside* the serving
ones and the switch is one dict assignment, so a request always finds a complete
set of ready versions; retired versions drain their in-flight requests before
they are closed (at most :attr:`ModelManager.retire_timeout` seconds; then what is
still running is failed with 503 and its instances are stopped, python workers
killed).

Memory per model version (``memory_bytes`` in the repository index and statistics,
``pdserve_model_memory_bytes`` in metrics), measured once at load, after warm-up:

``rss_delta``
    in-process backends (onnxruntime): the server's resident memory after the load
    minus before it. Such loads are serialized (one at a time) so that the delta is
    that model's; requests served meanwhile, allocator caching and memory freed by
    other models still blur it (a reload into memory the allocator kept can read
    lower), so the largest delta measured for that version since start is kept.
``worker_rss``
    python models: the summed ``Rss`` of the instances' worker processes (shared
    pages, such as numpy's, are counted in each: an upper bound).
``ensemble``
    0: an ensemble holds no memory of its own (its steps count theirs).

``gpu_memory_bytes`` (statistics ``memory_usage`` type ``GPU``) is the GPU memory NVML
reports for the server's or the workers' processes after the load minus before, where
``pynvml`` and a GPU are present.

The budget (``--model-memory-budget``, :mod:`pdserve.repository.budget`): every load
takes the budget lock (loads are then one at a time), evicts the least recently used
idle unpinned models the load needs room for (its size from its last load; 0 the first
time), loads, measures, and evicts again if the measured size does not fit; if nothing
more can be evicted the new model is unloaded and the load fails. On-demand loads
(:meth:`ModelManager.demand`) share one load per model among the requests waiting.

Ensembles, as Triton's ModelRepositoryManager: loading one first loads its steps that
are not loaded, as steps only (:attr:`ModelEntry.explicit` stays False for them);
unloading a model unloads the served ensembles that use it; ``unload_dependents`` on
an ensemble also unloads its steps loaded only as steps that no other served ensemble
uses (:meth:`ModelManager.unload_model`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import text_format

from pdserve import config as cfgmod
from pdserve.backends.base import ModelSpec
from pdserve.core import procmem
from pdserve.core.api import ModelHost
from pdserve.core.errors import ErrorCode, InferError, internal, not_found, unavailable
from pdserve.repository import layout
from pdserve.repository.budget import BudgetExceeded, MemoryBudget
from pdserve.repository.control import snapshot
from pdserve.repository.model import ModelVersion
from pdserve.repository.prepare import backend_for, complete_config, read_config
from pdserve.repository.rollout import RolloutPolicy
from pdserve.repository.traffic import (
    TRAFFIC_FILENAME,
    TrafficError,
    TrafficSpec,
    read_traffic_file,
)
from pdserve.scheduling import create_scheduler

log = logging.getLogger("pdserve.repository")

#: Seconds a retired (unloaded or replaced) version may take to finish its
#: in-flight requests before they fail with 503 and its instances are stopped.
RETIRE_TIMEOUT_S = 60.0

#: ``memory_source`` values (see the module docstring).
RSS_DELTA = "rss_delta"
WORKER_RSS = "worker_rss"
ENSEMBLE_SOURCE = "ensemble"

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
        traffic / traffic_gen: the traffic file (:mod:`pdserve.repository.traffic`)
            read by the last load that succeeded, and a counter of such loads.
        explicit: loaded because it was asked for by name (a load request,
            ``--load-model``, every model with ``--load-model=*`` or in ``none`` /
            ``poll`` mode, an on-demand request for it), not only as a step of an
            ensemble that was loaded (Triton's ``explicitly_load_``). Unloading an
            ensemble with ``unload_dependents`` unloads its steps that are not explicit.
    """

    name: str
    serving: dict[int, ModelVersion] = field(default_factory=dict)
    states: dict[int, VersionState] = field(default_factory=dict)
    reason: str = ""
    fingerprints: dict[int, str] = field(default_factory=dict)
    wanted: bool = False
    #: the model's traffic file (``traffic.yaml``) as of its last successful load.
    traffic: TrafficSpec | None = None
    #: counts loads that (re)read the traffic file (traffic control adopts each one).
    traffic_gen: int = 0
    #: asked for by name, not only loaded as an ensemble's step (see above).
    explicit: bool = False

    @property
    def default_version(self) -> ModelVersion | None:
        """The highest ready version."""
        return self.serving[max(self.serving)] if self.serving else None


#: The longest model name, in UTF-8 bytes: one folder name (NAME_MAX on Linux and
#: macOS file systems), since a model name is a folder of the repository.
MAX_NAME_BYTES = 255
#: The longest ``file:`` path of a load request, in UTF-8 bytes (well inside PATH_MAX
#: once the staging folder is in front of it).
MAX_FILE_PATH_BYTES = 1024
#: How error messages and the repository index name a configuration given in a load
#: request (``config`` parameter) rather than read from ``config.pbtxt``.
OVERRIDE_WHERE = cfgmod.OVERRIDE_PATH
#: How error messages name the temporary folder a ``config`` + ``file:`` load is
#: served from (its real path is the server's business, not the client's).
STAGED_WHERE = "<override>"
#: Name prefix of the temporary folders ``file:`` loads are staged in (in the
#: system's temporary folder: ``$TMPDIR`` or ``/tmp``).
STAGING_PREFIX = "pdserve-override-"


def _shown(text: str, limit: int = 80) -> str:
    """``repr(text)``, cut to about ``limit`` characters (names echoed in errors)."""
    return repr(text) if len(text) <= limit else repr(text[:limit]) + f"... ({len(text)} chars)"


def check_model_name(name: str) -> None:
    """Refuse a model name that is not one plain folder name of the repository.

    A model name becomes a path (``<repository>/<name>``) when the repository API
    loads it, so ``..``, ``.``, separators, NUL, absolute paths and names longer
    than a folder name may be (:data:`MAX_NAME_BYTES`) are refused before anything
    touches the disk. Triton refuses empty, blank, ``..``-holding and ``/``-holding
    names (``ValidateModelName``); pdserve also refuses hidden names (the
    repository scan skips them), ``\\`` and NUL.

    Raises:
        InferError(INVALID_ARG): the name is empty or blank, ``.``/``..``, hidden,
            holds ``/``, ``\\`` or NUL, or is too long; the message says which.
    """
    if not name or not name.strip():
        raise InferError("invalid model name: a model name must not be empty or blank")
    size = len(name.encode("utf-8", "surrogatepass"))
    if size > MAX_NAME_BYTES:
        raise InferError(
            f"invalid model name {_shown(name)}: it is {size} bytes long, and a model name "
            f"is one folder name of the repository (at most {MAX_NAME_BYTES} bytes)"
        )
    if name in (".", "..") or name.startswith(".") or any(c in name for c in ("/", "\\", "\0")):
        raise InferError(
            f"invalid model name {_shown(name)}: it must be one folder name of the "
            "repository (no '/', '\\', NUL, and not '.', '..' or hidden)"
        )


def check_file_paths(files: Collection[str]) -> None:
    """Refuse ``file:`` paths of a load request that are not plain relative file paths.

    Each path (the part after ``file:``, e.g. ``1/model.onnx``) must name a file
    inside the model folder: relative, ``/``-separated, no empty, ``.`` or ``..``
    component, no NUL or ``\\``, at most :data:`MAX_FILE_PATH_BYTES` bytes and
    :data:`MAX_NAME_BYTES` per component, not ``config.pbtxt`` (the configuration is
    the ``config`` parameter), and no path may be a folder another path writes into
    (Triton: "directory has been created as a file").

    Raises:
        InferError(INVALID_ARG): the first bad path, named with what is wrong.
    """
    folders: set[str] = set()
    for rel in files:
        what = f"load parameter {_shown('file:' + rel)}"
        if not rel:
            raise InferError(
                "load parameter 'file:' names no file: give 'file:<version>/<file name>'"
            )
        if "\0" in rel or "\\" in rel:
            raise InferError(f"{what}: a file path must not contain NUL or '\\'")
        if rel.startswith("/"):
            raise InferError(
                f"{what}: a file path must be relative to the model folder, "
                "e.g. 'file:1/model.onnx', not absolute"
            )
        if len(rel.encode("utf-8", "surrogatepass")) > MAX_FILE_PATH_BYTES:
            raise InferError(f"{what}: a file path may be at most {MAX_FILE_PATH_BYTES} bytes")
        parts = rel.split("/")
        if any(p in (".", "..") for p in parts):
            raise InferError(
                f"{what}: a file path must not hold '.' or '..' components "
                "(it must stay inside the model folder)"
            )
        if any(not p for p in parts):
            raise InferError(
                f"{what}: names a folder or has an empty path component; "
                "give 'file:<version>/<file name>'"
            )
        if any(len(p.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES for p in parts):
            raise InferError(f"{what}: a path component may be at most {MAX_NAME_BYTES} bytes")
        if rel == cfgmod.CONFIG_FILENAME:
            raise InferError(
                f"{what}: the model configuration is the 'config' parameter; "
                f"'file:{cfgmod.CONFIG_FILENAME}' is not accepted"
            )
        folders.update("/".join(parts[:i]) for i in range(1, len(parts)))
    clash = sorted(folders.intersection(files))
    if clash:
        raise InferError(
            f"load parameter 'file:{clash[0]}' names a folder that other 'file:' "
            "parameters write into"
        )


class _Staged:
    """A temporary model folder written from one load request's ``config`` and
    ``file:`` contents (Triton's override location): ``<root>/<model name>``.

    The versions loaded from it use it until they are closed; the last one to go
    (or a load that served nothing from it) removes ``root``.
    """

    def __init__(self, root: Path, name: str) -> None:
        self.root = root
        self.model_dir = root / name
        self.users = 0

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _write_staged(staged: _Staged, config: Any, files: dict[str, bytes]) -> None:
    """Write ``config.pbtxt`` and each file into a fresh staged model folder."""
    model_dir = staged.model_dir
    model_dir.mkdir()
    (model_dir / cfgmod.CONFIG_FILENAME).write_text(
        text_format.MessageToString(config), encoding="utf-8"
    )
    for rel, data in files.items():
        target = model_dir.joinpath(*rel.split("/"))
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "xb") as f:
            f.write(data)


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
        #: id(ModelVersion) -> the staged folder it was loaded from (``file:`` loads).
        self._staged: dict[int, _Staged] = {}
        #: the model memory budget: LRU use, pinned models, sizes, counters.
        self.budget = MemoryBudget()
        #: held by every load while there is a budget (loads one at a time).
        self._budget_lock = asyncio.Lock()
        #: held around each in-process version load, so its Rss delta is its own.
        self._measure_lock = asyncio.Lock()
        #: model name -> its folder's fingerprints when its size was last measured.
        self._known_folder: dict[str, Any] = {}
        #: (name, version) -> the largest Rss delta measured for it (bytes).
        self._rss_delta: dict[tuple[str, int], int] = {}
        #: model name -> the on-demand load in progress, shared by every request
        #: waiting for that model.
        self._demand: dict[str, asyncio.Task[ModelEntry]] = {}
        #: loads in progress (:meth:`load_model`'s inner tasks); :meth:`close` cancels them.
        self._loads: set[asyncio.Task[ModelEntry]] = set()

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
            raise InferError(f"model version '{version[:40]}' is not a number")
        # Versions are int64 (19 digits); longer strings are no version (and int() of
        # thousands of digits is slow, then refused).
        mv = entry.serving.get(int(version)) if len(version.lstrip("0")) <= 19 else None
        if mv is None:
            raise not_found(f"Request for unknown model: '{name}' version {version} is not found")
        return mv

    def ready_versions(self, name: str) -> list[str]:
        """Served versions of ``name``, ascending, as strings."""
        entry = self.models.get(name)
        return [str(v) for v in sorted(entry.serving)] if entry else []

    def index(self) -> list[dict[str, Any]]:
        """Repository index rows ``{name, version, state, reason}`` (Triton's shape),
        plus ``memory_bytes`` and ``memory_source`` for a served version whose
        memory was measured, and ``pinned: true`` for a pinned model.

        Models present in the repository but never loaded are listed with no
        version and no state, as Triton does in explicit mode.
        """
        rows: list[dict[str, Any]] = []
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
                row2: dict[str, Any] = {
                    "name": name,
                    "version": str(v),
                    "state": st.state,
                    "reason": st.reason,
                }
                mv = entry.serving.get(v)
                if mv is not None and mv.stats.memory_bytes is not None:
                    row2["memory_bytes"] = mv.stats.memory_bytes
                    row2["memory_source"] = mv.stats.memory_source
                    if mv.stats.gpu_memory_bytes:
                        row2["gpu_memory_bytes"] = mv.stats.gpu_memory_bytes
                if name in self.budget.pinned:
                    row2["pinned"] = True
                rows.append(row2)
        return rows

    def model_bytes(self, name: str) -> int:
        """Bytes the served versions of ``name`` cost (0: not loaded or unmeasured)."""
        entry = self.models.get(name)
        if entry is None:
            return 0
        return sum(mv.stats.memory_bytes or 0 for mv in entry.serving.values())

    def used_bytes(self) -> int:
        """Bytes every served model version costs together (what the budget bounds)."""
        return sum(self.model_bytes(n) for n in self.models)

    # -- loading --------------------------------------------------------------

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

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
        config_override: Any = None,
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
        config_override: Any,
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
                f"model {_shown(config_override.name)}, but the request loads '{name}'"
            )
        if self.closing:
            raise unavailable(f"failed to load '{name}': the server is shutting down")
        ensemble_cfg = self.ensemble_config(name, config_override)
        if ensemble_cfg is not None:

            async def load_step(step: str) -> Any:
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
        self, name: str, config_override: Any, files: dict[str, bytes] | None
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

    def ensemble_config(self, name: str, config_override: Any = None) -> Any:
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

    @staticmethod
    def step_names(cfg: Any) -> list[str]:
        """The models an ensemble configuration steps into, once each, in step order."""
        return list(dict.fromkeys(s.model_name for s in cfg.ensemble_scheduling.step))

    def is_serving(self, name: str) -> bool:
        """Model ``name`` serves at least one version."""
        entry = self.models.get(name)
        return entry is not None and bool(entry.serving)

    async def _load_steps(
        self, name: str, cfg: Any, load_step: Callable[[str], Awaitable[Any]]
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
        self, name: str, config_override: Any, files: dict[str, bytes] | None
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

    def _folder_snapshot(self, name: str) -> Any:
        """Fingerprints of the model folder (config and files, as poll mode compares
        them), or None when it cannot be read: a remembered size is used only while
        the folder is unchanged."""
        path = self.repository / name
        try:
            return snapshot(layout.ModelDir(name, path, layout.list_versions(path)))
        except Exception:  # noqa: BLE001 - the load reports a missing or broken folder
            return None

    async def _load_named(
        self, name: str, config_override: Any, files: dict[str, bytes] | None
    ) -> ModelEntry:
        """:meth:`load_model` once its arguments are checked (the model's lock held)."""
        async with self._lock(name):
            if self.closing:
                raise unavailable(f"failed to load '{name}': the server is shutting down")
            staged = None
            try:
                if files:
                    staged = await self._stage(name, config_override, files)
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

    async def _stage(self, name: str, config: Any, files: dict[str, bytes]) -> _Staged:
        """Write ``config`` and ``files`` into a new temporary model folder.

        Raises:
            InferError(INTERNAL): the files cannot be written (disk full...).
        """

        def write() -> _Staged:
            staged = _Staged(Path(tempfile.mkdtemp(prefix=STAGING_PREFIX)), name)
            try:
                _write_staged(staged, config, files)
            except BaseException:
                staged.remove()
                raise
            return staged

        try:
            # Off the event loop: model files are large.
            return await asyncio.to_thread(write)
        except OSError as e:
            log.error("model %s: cannot stage the 'file:' contents: %s", name, e)
            raise internal(
                f"failed to load '{name}': cannot write the 'file:' contents to a temporary "
                f"folder: {e.strerror or type(e).__name__}"
            ) from None

    def _public(self, message: str, override_dir: Path | None = None) -> str:
        """``message`` as a client may see it: no absolute path of the repository or
        of a staged folder.

        Paths inside the repository become relative to it (``tiny/config.pbtxt``);
        a staged folder becomes ``<override>``; with ``override_dir`` (a load with a
        configuration override), that model's ``config.pbtxt`` is ``<config override>``.
        """
        if override_dir is not None:
            for d in {str(override_dir), str(override_dir.absolute())}:
                message = message.replace(os.path.join(d, cfgmod.CONFIG_FILENAME), OVERRIDE_WHERE)
        staging = re.escape(os.path.join(tempfile.gettempdir(), STAGING_PREFIX))
        message = re.sub(staging + r"[^/\s'\"]*", STAGED_WHERE, message)
        repos = {str(self.repository.absolute())}
        try:
            repos.add(str(self.repository.resolve()))
        except OSError:
            pass
        for repo in sorted(repos, key=len, reverse=True):
            message = message.replace(repo + os.sep, "")
            message = message.replace(repo, "<model repository>")
        return message

    async def _load_locked(
        self, name: str, config_override: Any, staged: _Staged | None
    ) -> ModelEntry:
        entry = self.models.get(name)
        if entry is None:
            entry = ModelEntry(name)
        model_dir = staged.model_dir if staged is not None else self.repository / name
        override_dir = model_dir if config_override is not None else None
        where = OVERRIDE_WHERE if config_override is not None else f"{name}/config.pbtxt"
        try:
            if staged is None and not model_dir.is_dir():
                raise InferError(f"failed to load '{name}': no such model in the repository")
            mdir = layout.ModelDir(name, model_dir, layout.list_versions(model_dir))
            base_cfg = read_config(mdir, config_override, where)
            self._check_no_cycle(name, base_cfg)
            versions = layout.select_versions(base_cfg, mdir.versions)
            if not versions:
                raise InferError(
                    f"failed to load '{name}': no version folder selected by the version "
                    f"policy (found {mdir.versions})"
                )
            traffic = read_traffic_file(model_dir)
            if traffic is not None and traffic.rollout is not None:
                RolloutPolicy.parse(traffic.rollout, f"{TRAFFIC_FILENAME}: rollout")
        except (cfgmod.ConfigError, InferError, TrafficError) as e:
            said = str(e) if isinstance(e, InferError) else f"failed to load '{name}': {e}"
            reason = self._public(said, override_dir)
            entry.reason = reason
            entry.wanted = True
            for v in entry.serving:  # still serving: say why the reload did not happen
                entry.states[v] = VersionState(READY, f"reload failed: {reason}")
            if (self.repository / name).is_dir() or name in self.models:  # no row for a typo
                self.models.setdefault(name, entry)
            log.error("model %s failed to load: %s", name, e)
            code = e.code if isinstance(e, InferError) else ErrorCode.INVALID_ARG
            raise InferError(reason, code) from None

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
                mv = await self._load_version(name, v, base_cfg, model_dir, where)
            except Exception as e:  # every failure becomes the version's reason
                reason = self._public(str(e) or type(e).__name__, override_dir)
                entry.states[v] = VersionState(UNAVAILABLE, reason)
                errors.append(f"version {v}: {reason}")
                log.error("model %s version %d failed to load: %s", name, v, e)
                if current is not None:  # keep serving what worked
                    new_serving[v] = current
                    entry.states[v] = VersionState(READY, f"reload failed: {reason}")
                return
            if staged is not None:  # the staged folder lives as long as mv
                staged.users += 1
                self._staged[id(mv)] = staged
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
            for mv in fresh:
                await self._release(mv)
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
        try:  # a concurrent load may have closed a cycle since the check above
            self._check_no_cycle(name, base_cfg)
        except InferError as e:
            fresh = [mv for v, mv in new_serving.items() if old.get(v) is not mv]
            await asyncio.gather(*(mv.close() for mv in fresh), return_exceptions=True)
            for mv in fresh:
                await self._release(mv)
            for v, mv in new_serving.items():
                if old.get(v) is not mv:  # not switched to: reload it next time
                    entry.fingerprints[v] = ""
                    if v not in old:
                        entry.states[v] = VersionState(UNAVAILABLE, str(e))
            self._record_failure(name, str(e))
            log.error("model %s failed to load: %s", name, e)
            raise
        entry.serving = dict(sorted(new_serving.items()))  # the atomic switch
        entry.traffic = traffic
        entry.traffic_gen += 1
        entry.reason = "; ".join(errors)
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
        if errors:
            kept = f"; serving versions {sorted(entry.serving)}" if entry.serving else ""
            raise InferError(f"failed to load '{name}': {'; '.join(errors)}{kept}")
        return entry

    def _check_no_cycle(self, name: str, cfg: Any) -> None:
        """Ensemble ``name`` about to serve configuration ``cfg`` must not reach itself
        through the steps of the ensembles that serve now (a reload whose new steps,
        from a ``config`` override or an edited config.pbtxt, lead back to it: each
        request would then recurse until its client leaves), as Triton refuses it.

        Raises:
            InferError(INVALID_ARG): "circular dependency between ensembles: A -> B -> A".
        """
        if cfg.platform != cfgmod.ENSEMBLE_PLATFORM:
            return
        seen: set[str] = set()

        def walk(model: str, path: tuple[str, ...]) -> tuple[str, ...]:
            if model == name:
                return (*path, model)
            if model in seen:
                return ()
            seen.add(model)
            entry = self.models.get(model)
            for mv in entry.serving.values() if entry is not None else ():
                for step in self._served_steps(mv):
                    found = walk(step, (*path, model))
                    if found:
                        return found
            return ()

        for step in self.step_names(cfg):
            cycle = walk(step, (name,))
            if cycle:
                raise InferError(
                    f"failed to load '{name}': circular dependency between ensembles: "
                    + " -> ".join(cycle)
                )

    async def _release(self, mv: ModelVersion) -> None:
        """``mv`` is closed: remove the staged folder it was loaded from once unused."""
        staged = self._staged.pop(id(mv), None)
        if staged is not None:
            staged.users -= 1
            if staged.users <= 0:
                await asyncio.to_thread(staged.remove)

    async def _load_version(
        self, name: str, version: int, base_cfg: Any, model_dir: Path, where: str
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
        lock = self._measure_lock if in_process else contextlib.nullcontext()
        async with lock:
            rss_before = procmem.own_rss() if in_process else None
            gpu_before = await asyncio.to_thread(procmem.gpu_memory_by_pid)
            mv.instances = await backend.load(spec)
            mv.scheduler = create_scheduler(mv)
            if self.server is not None:
                try:
                    await self.server.warmup(mv)
                except Exception:
                    await mv.close()
                    raise
            self._measure(mv, in_process, ensemble, rss_before, gpu_before)
        return mv

    def _measure(
        self,
        mv: ModelVersion,
        in_process: bool,
        ensemble: bool,
        rss_before: int | None,
        gpu_before: dict[int, int] | None,
    ) -> None:
        """Set ``mv.stats.memory_bytes`` / ``memory_source`` / ``gpu_memory_bytes``
        (see the module docstring); leaves them None when nothing can be read."""
        stats = mv.stats
        pids = [os.getpid()] if in_process else []
        if ensemble:
            stats.memory_bytes, stats.memory_source = 0, ENSEMBLE_SOURCE
            return
        if in_process:
            after = procmem.own_rss()
            if rss_before is not None and after is not None:
                key = (mv.name, mv.version)
                delta = max(0, after - rss_before, self._rss_delta.get(key, 0))
                self._rss_delta[key] = delta
                stats.memory_bytes, stats.memory_source = delta, RSS_DELTA
        else:
            pids = [p for inst in mv.instances for p in inst.worker_pids()]
            readings = [procmem.process_memory(p) for p in pids]
            if pids and all(r is not None for r in readings):
                stats.memory_bytes = sum(r[0] for r in readings if r is not None)
                stats.memory_source = WORKER_RSS
        if gpu_before is not None and pids:
            gpu_after = procmem.gpu_memory_by_pid() or {}
            stats.gpu_memory_bytes = max(
                0, sum(gpu_after.get(p, 0) - gpu_before.get(p, 0) for p in pids)
            )

    # -- the memory budget and on-demand loads ---------------------------------

    def _ensemble_users(self) -> dict[str, list[str]]:
        """Model name -> the served ensembles with a step that uses it."""
        users: dict[str, list[str]] = {}
        for other, entry in self.models.items():
            mv = entry.default_version
            if mv is None or mv.config.platform != cfgmod.ENSEMBLE_PLATFORM:
                continue
            for step in mv.config.ensemble_scheduling.step:
                users.setdefault(step.model_name, []).append(other)
        return users

    async def _make_room(self, name: str, need: int) -> None:
        """Evict least recently used idle models until ``need`` bytes for ``name`` fit
        in the budget (:meth:`MemoryBudget.plan`).

        Raises:
            InferError(INVALID_ARG): ``name`` alone needs more than the budget.
            InferError(UNAVAILABLE): the models that may not leave now (pinned, or
                serving or holding requests) leave too little room.
        """
        for _ in range(len(self.models) + 1):
            loaded = {n: self.model_bytes(n) for n, e in self.models.items() if e.serving}
            busy = {
                n for n, e in self.models.items() if any(mv.inflight for mv in e.serving.values())
            }
            try:
                victims = self.budget.plan(name, need, loaded, busy, self._ensemble_users())
            except BudgetExceeded as e:
                code = ErrorCode.INVALID_ARG if e.alone else ErrorCode.UNAVAILABLE
                raise InferError(f"failed to load '{name}': {e}", code) from None
            if not victims:
                return
            for victim in victims:
                if not await self._evict(victim):
                    break  # it got busy meanwhile: plan again

    async def _evict(self, name: str, reason: str = "", force: bool = False) -> bool:
        """Unload every version of ``name`` now (no drain: it is idle), for the budget.

        Args:
            reason: the index reason afterwards (default: evicted for the budget).
            force: unload even if held or pinned (a load that did not fit); not
                counted as an eviction.

        Returns:
            False when ``name`` got busy or held before its lock was taken (nothing
            was unloaded); True otherwise.
        """
        async with self._lock(name):
            entry = self.models.get(name)
            if entry is None or not entry.serving:
                return True
            if not force and (
                not self.budget.evictable(name, ())
                or any(mv.inflight for mv in entry.serving.values())
            ):
                return False
            old = entry.serving
            entry.serving = {}
            entry.wanted = False
            entry.explicit = False
            entry.reason = reason or "evicted to stay within the model memory budget"
            for v in old:
                entry.states[v] = VersionState(UNLOADING)
            if not force:
                self.budget.counter(name).evictions += 1
                log.info(
                    "model %s: evicted (least recently used) to stay within the model "
                    "memory budget",
                    name,
                )
            for v, mv in old.items():
                try:
                    await mv.close()
                finally:
                    await self._release(mv)
                    entry.states.pop(v, None)
                    entry.fingerprints.pop(v, None)
            await asyncio.to_thread(procmem.release_free_memory)
            return True

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
            try:
                await mv.close(0.0 if mv.inflight else None)
            finally:
                await self._release(mv)
            if forget and version not in entry.serving:
                entry.states.pop(version, None)
                entry.fingerprints.pop(version, None)
            log.info("unloaded model %s version %d", entry.name, version)

        task = asyncio.get_running_loop().create_task(retire())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def dependents(self, name: str) -> list[str]:
        """Served ensembles with a step that uses model ``name`` (any served version's
        configuration), sorted."""
        found = []
        for other, entry in self.models.items():
            if other == name:
                continue
            if any(name in self._served_steps(mv) for mv in entry.serving.values()):
                found.append(other)
        return sorted(found)

    def _served_steps(self, mv: ModelVersion) -> list[str]:
        """The models ``mv`` steps into (none unless it is an ensemble)."""
        if mv.config.platform != cfgmod.ENSEMBLE_PLATFORM:
            return []
        return self.step_names(mv.config)

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Stop serving ``name``; in-flight and queued requests finish first (in the
        background: new requests get 404/503 at once).

        As in Triton, the served ensembles that use ``name`` (recursively: ensembles
        of those) cannot serve without it and are unloaded first, with the reason
        "ensemble 'E' contains models that are not available: name" in the index.

        Args:
            unload_dependents: when ``name`` is an ensemble, also unload its steps
                that were loaded only as steps (not :attr:`ModelEntry.explicit`) and
                that no other served ensemble uses, recursively (steps that are
                ensembles bring theirs). Triton's ``unload_dependents``. Without it
                the steps stay loaded. On another model it changes nothing.

        Raises:
            InferError(INVALID_ARG): a malformed name (:func:`check_model_name`), or
                the model is not loaded.
        """
        check_model_name(name)
        await self._unload(name, unload_dependents, "unloaded", frozenset())

    async def _unload(
        self, name: str, unload_dependents: bool, reason: str, seen: frozenset[str]
    ) -> None:
        """:meth:`unload_model` with the index ``reason`` afterwards; ``seen``: the
        models this unload came through (ensembles that step into each other)."""
        if not self.is_serving(name):
            raise InferError(f"failed to unload '{name}': model is not loaded")
        seen = seen | {name}
        for dep in self.dependents(name):
            if dep in seen:
                continue
            why = f"unloaded: ensemble '{dep}' contains models that are not available: {name}"
            await self._unload_too(dep, False, why, seen)
        async with self._lock(name):
            entry = self.models.get(name)
            if entry is None or not entry.serving:
                raise InferError(f"failed to unload '{name}': model is not loaded")
            old = entry.serving
            steps = list(dict.fromkeys(s for mv in old.values() for s in self._served_steps(mv)))
            entry.serving = {}
            entry.wanted = False
            entry.explicit = False
            for v in old:
                entry.states[v] = VersionState(UNLOADING, "" if reason == "unloaded" else reason)
            entry.reason = reason
            for v, mv in old.items():
                self._retire(entry, v, mv, forget=True)
        if not unload_dependents:
            return
        for step in steps:
            step_entry = self.models.get(step)
            if (
                step in seen
                or step_entry is None
                or not step_entry.serving
                or step_entry.explicit
                or self.dependents(step)
            ):
                continue
            why = f"unloaded: a step of ensemble '{name}', unloaded with it (unload_dependents)"
            await self._unload_too(step, True, why, seen)

    async def _unload_too(
        self, name: str, unload_dependents: bool, why: str, seen: frozenset[str]
    ) -> None:
        """:meth:`_unload` of a model another unload takes with it (``why``: its index
        reason); one already unloaded meanwhile is left as it is."""
        log.info("model %s: %s", name, why)
        try:
            await self._unload(name, unload_dependents, why, seen)
        except InferError as e:  # unloaded meanwhile
            log.debug("model %s: %s", name, e)

    async def wait_retired(self) -> None:
        """Wait for every background retirement to finish."""
        while self._retiring:
            await asyncio.gather(*list(self._retiring), return_exceptions=True)

    async def close(self, timeout: float | None = None) -> None:
        """Unload everything: wait up to ``timeout`` s for in-flight requests, then close.

        Loads are refused from the start; loads already running (initial, API or
        poller) are abandoned at once: cancelled, so that python workers still in
        ``initialize`` are killed and initialized ones get the backend's cancel grace
        for ``finalize``; their callers get ``UNAVAILABLE``. Their locks are then
        waited for (within the same ``timeout``).
        """
        self.closing = True
        loop = asyncio.get_running_loop()
        if self._loads:
            log.info("closing: abandoning %d model load(s) in progress", len(self._loads))
            for task in list(self._loads):
                task.cancel()
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
        for mv in versions:
            await self._release(mv)
        await self.wait_retired()
        for staged in list(self._staged.values()):  # every version is closed by now
            await asyncio.to_thread(staged.remove)
        self._staged.clear()
