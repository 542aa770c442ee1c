"""The served side of the model manager: which versions serve, lookups and the
repository index, unloading, eviction for the memory budget, and retirement.

A retired (unloaded or replaced) version drains its in-flight requests in the background
before it is closed (at most :attr:`ServedModels.retire_timeout` seconds; then what still
runs fails with 503 and its instances are stopped, python workers killed). Unloading a
model first unloads the served ensembles that use it, as Triton does.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pdserve.core import procmem
from pdserve.core.errors import ErrorCode, InferError, not_found, unavailable
from pdserve.repository import dependencies, layout
from pdserve.repository.budget import BudgetExceeded, MemoryBudget
from pdserve.repository.entry import UNAVAILABLE, UNLOADING, ModelEntry, VersionState
from pdserve.repository.model import ModelVersion
from pdserve.repository.staging import Staged, check_model_name

log = logging.getLogger("pdserve.repository")

#: Seconds a retired (unloaded or replaced) version may take to finish its
#: in-flight requests before they fail with 503 and its instances are stopped.
RETIRE_TIMEOUT_S = 60.0


class ServedModels:
    """The models of one repository that serve, and taking them out of service.

    :class:`~pdserve.repository.manager.ModelManager` adds loading to it.

    Args:
        repository: the model repository root.
    """

    def __init__(self, repository: Path) -> None:
        self.repository = Path(repository)
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
        self._staged: dict[int, Staged] = {}
        #: the model memory budget: LRU use, pinned models, sizes, counters.
        self.budget = MemoryBudget()
        #: loads in progress (the loading side's inner tasks); :meth:`close` cancels them.
        self._loads: set[asyncio.Task[ModelEntry]] = set()

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

    def index(self) -> list[dict[str, object]]:
        """Repository index rows ``{name, version, state, reason}`` (Triton's shape),
        plus ``memory_bytes`` and ``memory_source`` for a served version whose
        memory was measured, and ``pinned: true`` for a pinned model.

        Models present in the repository but never loaded are listed with no
        version and no state, as Triton does in explicit mode.
        """
        rows: list[dict[str, object]] = []
        try:
            on_disk = layout.scan_repository(self.repository)
        except Exception:  # repository vanished: index what we know
            on_disk = {}
        for name in sorted(set(on_disk) | set(self.models)):
            entry = self.models.get(name)
            if entry is None or not entry.states:
                row: dict[str, object] = {"name": name}
                if entry is not None and entry.reason:
                    row.update(state=UNAVAILABLE, reason=entry.reason)
                rows.append(row)
                continue
            for v, st in sorted(entry.states.items()):
                row2: dict[str, object] = {
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

    def _lock(self, name: str) -> asyncio.Lock:
        lock = self._locks.get(name)
        if lock is None:
            lock = self._locks[name] = asyncio.Lock()
        return lock

    def is_serving(self, name: str) -> bool:
        """Model ``name`` serves at least one version."""
        entry = self.models.get(name)
        return entry is not None and bool(entry.serving)

    async def _release(self, mv: ModelVersion) -> None:
        """``mv`` is closed: remove the staged folder it was loaded from once unused."""
        staged = self._staged.pop(id(mv), None)
        if staged is not None:
            staged.users -= 1
            if staged.users <= 0:
                await asyncio.to_thread(staged.remove)

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
                victims = self.budget.plan(
                    name, need, loaded, busy, dependencies.ensemble_users(self.models)
                )
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
        """Served ensembles with a step that uses model ``name``, sorted."""
        return dependencies.dependents(self.models, name)

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
            steps = list(
                dict.fromkeys(s for mv in old.values() for s in dependencies.served_steps(mv))
            )
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
            tasks: list[asyncio.Future[object]] = [
                asyncio.ensure_future(mv.drain()) for mv in versions
            ]
            tasks += [asyncio.ensure_future(asyncio.shield(t)) for t in self._retiring]
            _, pending = await asyncio.wait(tasks, timeout=left())
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
