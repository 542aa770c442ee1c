"""Model control modes (``none`` / ``poll`` / ``explicit`` / ``on_demand``) and repository
polling.

Triton's three model control modes (``--model-control-mode``):

``none`` (default)
    Every model in the model repository is loaded at start. Changes on disk are
    ignored; repository load / unload requests answer 503 / ``UNAVAILABLE``
    ("explicit model load / unload is not allowed ..."), as Triton does.
``poll``
    Every model is loaded at start, then the repository is scanned every
    ``--repository-poll-secs`` seconds. A model folder that appears is loaded, one
    that disappears is unloaded, and a model whose ``config.pbtxt``, other
    top-level files (labels...) or version folders changed (a version folder added,
    removed, or a file in it changed: name, size or modification time) is reloaded.
    Reloading is the manager's zero-downtime path: new and changed versions load
    and warm up beside the serving ones and traffic switches when they are ready;
    a version that fails leaves what was serving in place and is reported in the
    repository index; a later fix (any change to the model folder) is picked up
    on the next poll. A change is acted on once the folder has stopped changing
    for a moment (:data:`SETTLE_SECS`), so a version folder being copied is not
    loaded half-written; renaming a finished folder into place is still the safe
    way to publish one. Load / unload requests answer ``UNAVAILABLE``.
``explicit``
    Only the models named by ``--load-model`` (repeatable; ``*`` means all) are
    loaded at start; afterwards models load and unload through the repository API
    (``POST /v2/repository/models/{m}/load`` / ``unload``, gRPC
    ``RepositoryModelLoad`` / ``RepositoryModelUnload``). A load of a loaded model
    reloads what changed, with the same zero-downtime swap.
``on_demand`` (pdserve's, not Triton's)
    ``explicit``, plus: an inference request for a model of the repository that is
    not loaded loads it (Ray Serve's model multiplexing does the same). The request
    waits for the load, at most its ``timeout`` parameter or ``--model-load-wait-secs``;
    concurrent requests for that model share one load. With ``--model-memory-budget``
    the least recently used idle models are unloaded to make room
    (:mod:`pdserve.repository.budget`); ``--pin-model`` models load at start and
    never leave. Only inference loads on demand: metadata, configuration and
    readiness of a model that is not loaded answer as in ``explicit`` mode.

Rollback (pin a model to an earlier version that is still in the repository):
in ``explicit`` mode, load the model with a configuration override whose
``version_policy`` is ``specific { versions: [N] }``; ``pdserve rollback MODEL N
--url HOST:PORT`` (:mod:`pdserve.app.rollback`) does exactly that over HTTP, and
``pdserve rollback MODEL --unpin`` reloads config.pbtxt from disk. In ``poll`` mode,
write the same ``version_policy`` into config.pbtxt (or remove the bad version
folder): the next poll swaps back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from pdserve.repository import layout

if TYPE_CHECKING:
    from pdserve.repository.manager import ModelManager

log = logging.getLogger("pdserve.control")

__all__ = [
    "EXPLICIT_MODES",
    "MODES",
    "SETTLE_SECS",
    "RepositoryHost",
    "RepositoryPoller",
    "snapshot",
]

#: The model control modes.
MODES = ("none", "poll", "explicit", "on_demand")
#: The modes that accept repository load / unload requests (and a memory budget).
EXPLICIT_MODES = ("explicit", "on_demand")

#: A changed model folder must look the same this long before poll mode acts on it.
SETTLE_SECS = 0.25

#: What poll mode compares: (model-level fingerprint, ((version, fingerprint), ...)).
Snapshot = tuple[str, tuple[tuple[int, str], ...]]


@runtime_checkable
class RepositoryHost(Protocol):
    """What the repository poller needs from the core (:class:`pdserve.server.InferenceServer`)."""

    @property
    def started(self) -> bool:
        """True once the initial models were loaded: polling starts after that."""
        ...

    @property
    def manager(self) -> ModelManager:
        """The model manager the poller loads and unloads through (no control-mode check)."""
        ...

    def live(self) -> bool:
        """False once the server shuts down: polling stops."""
        ...


def snapshot(mdir: layout.ModelDir) -> Snapshot:
    """Fingerprints of a model folder: its configuration and top-level files (the
    traffic file included), and each version folder's files (see
    :func:`pdserve.repository.layout.fingerprint`)."""
    try:
        st = os.stat(mdir.path / layout.TRAFFIC_FILENAME)
        traffic = f"{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        traffic = "-"
    return (
        layout.fingerprint(mdir) + traffic,
        tuple((v, layout.fingerprint(mdir, v)) for v in mdir.versions),
    )


class RepositoryPoller:
    """Poll mode: reconcile the loaded models with the model repository on disk.

    Args:
        server: the core (:class:`RepositoryHost`): its ``manager``
            loads and unloads; polling starts once it has ``started`` and stops when it
            is no longer ``live``.
        interval: seconds between scans.
        sync: run (in a thread) before each scan, e.g. the re-sync of a repository on
            object storage (:meth:`pdserve.repository.remote_store.RemoteRepository.sync`);
            when it raises, that poll is skipped and what is loaded keeps serving.
    """

    def __init__(
        self,
        server: RepositoryHost,
        interval: float,
        sync: Callable[[], object] | None = None,
    ) -> None:
        self.sync = sync
        self.server = server
        self.manager = server.manager
        self.interval = interval
        self.seen: dict[str, Snapshot] = {}
        self.scans = 0

    def _scan(self) -> dict[str, layout.ModelDir]:
        try:
            return layout.scan_repository(self.manager.repository)
        except OSError as e:
            log.error("cannot scan the model repository: %s", e)
            return {}

    def baseline(self) -> None:
        """Record what is on disk now (call before the initial load)."""
        self.seen = {name: snapshot(mdir) for name, mdir in self._scan().items()}

    async def poll_once(self) -> list[str]:
        """One scan: load new, reload changed and unload removed models.

        Returns:
            the names acted on. Failures are logged and in the repository index;
            they never stop the poll loop or the other models.
        """
        self.scans += 1
        if self.sync is not None:
            try:
                await asyncio.to_thread(self.sync)
            except Exception as e:  # noqa: BLE001 - the sync logs its outages
                log.debug("repository sync failed, poll skipped: %s", e)
                return []
        on_disk = self._scan()
        changed: dict[str, Snapshot] = {}
        for name, mdir in on_disk.items():
            snap = snapshot(mdir)
            if self.seen.get(name) != snap:
                changed[name] = snap
        removed = [n for n in self.seen if n not in on_disk]
        if changed:
            await asyncio.sleep(SETTLE_SECS)
            stable = {}
            for name, snap in changed.items():
                mdir = layout.ModelDir(
                    name, on_disk[name].path, layout.list_versions(on_disk[name].path)
                )
                if snapshot(mdir) == snap:
                    stable[name] = snap
                else:
                    log.debug("model %s is still changing; next poll", name)
            changed = stable
        acted: list[str] = []
        for name in removed:
            del self.seen[name]
            entry = self.manager.models.get(name)
            if entry is not None and entry.serving:
                log.info("model %s was removed from the repository: unloading", name)
                try:
                    await self.manager.unload_model(name)
                except Exception as e:  # noqa: BLE001
                    log.error("unloading %s failed: %s", name, e)
                acted.append(name)
        if not changed:
            return acted
        for name, snap in changed.items():
            self.seen[name] = snap
        plain = [n for n in changed if self.manager.ensemble_config(n) is None]
        ensembles = [n for n in changed if n not in plain]
        for group in (plain, ensembles):
            if group:
                await asyncio.gather(*(self._load(n) for n in group))
        acted.extend(changed)
        # As Triton's dependency graph does, the ensembles that use a changed model
        # (recursively) and serve nothing are loaded again: an ensemble unloaded with
        # a removed step comes back when the step does.
        affected = [
            n
            for n in self._downstream(on_disk, set(changed))
            if n not in changed and not self.manager.is_serving(n)
        ]
        if affected:
            await asyncio.gather(*(self._load(n) for n in affected))
            acted.extend(affected)
        return acted

    def _downstream(self, on_disk: dict[str, layout.ModelDir], names: set[str]) -> list[str]:
        """The ensembles on disk that step into one of ``names``, recursively."""
        steps: dict[str, set[str]] = {}
        for name in on_disk:
            cfg = self.manager.ensemble_config(name)  # None: not one, or broken
            if cfg is not None:
                steps[name] = set(self.manager.step_names(cfg))
        found: list[str] = []
        reached = set(names)
        grew = True
        while grew:
            grew = False
            for name, uses in steps.items():
                if name not in reached and uses & reached:
                    reached.add(name)
                    found.append(name)
                    grew = True
        return found

    async def _load(self, name: str) -> None:
        known = name in self.manager.models
        log.info("model %s %s in the repository: loading", name, "changed" if known else "appeared")
        start = time.monotonic()
        try:
            entry = await self.manager.load_model(name)
        except Exception as e:  # noqa: BLE001 - the manager logged and recorded it
            log.warning("poll: model %s did not (fully) load: %s", name, e)
            return
        log.info(
            "poll: model %s serving versions %s (%.0f ms)",
            name,
            sorted(entry.serving),
            (time.monotonic() - start) * 1000,
        )

    async def run(self) -> None:
        """Poll until the server shuts down (waits for the initial load first)."""
        while not self.server.started:
            if not self.server.live():
                return
            await asyncio.sleep(0.05)
        while self.server.live():
            await asyncio.sleep(self.interval)
            if not self.server.live():
                return
            try:
                await self.poll_once()
            except Exception:  # noqa: BLE001 - polling must never stall
                log.exception("repository poll failed")
