"""Model repositories on object storage: mirror an fsspec URL into a local cache folder.

``--model-repository s3://bucket/prefix`` (or ``gs://``, ``az://``, ``file://``...) is
served from a local copy in ``--model-repository-cache DIR`` (default under
``$XDG_CACHE_HOME/pdserve/repositories``); the rest of pdserve reads ``DIR/repository``
as an ordinary model repository. :meth:`RemoteRepository.sync` (at start and before every
poll) lists the store once and downloads only files whose size + ETag / ``md5Hash`` /
mtime token changed. A version folder is assembled in ``DIR/staging`` and renamed into
place whole (with ``--version-ready-marker NAME``, only once ``NAME`` is in the store);
model-level files are replaced by rename; every download's size (and MD5 where the store
gives one) is checked. An unreachable or empty store changes nothing in the cache, so
serving continues. Credentials and endpoints come from each store's own configuration
(``AWS_*``, ``AWS_ENDPOINT_URL_S3``, GCS default credentials). Needs the ``remote-repo``
extra (fsspec + s3fs).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("pdserve.repository.remote")

__all__ = [
    "IntegrityError",
    "RemoteRepository",
    "StoreUnavailable",
    "SyncReport",
    "default_cache_dir",
    "is_remote_url",
]

#: botocore settings for S3 stores unless the URL's options say otherwise: a store that
#: went away is noticed in seconds, not minutes.
S3_CONFIG = {"connect_timeout": 3, "read_timeout": 30, "retries": {"max_attempts": 2}}


def is_remote_url(text: str) -> bool:
    """True for ``scheme://...`` repository locations (served through a local cache)."""
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.replace("+", "").replace("-", "").isalnum() and len(scheme) > 1


def default_cache_dir(url: str) -> Path:
    """``$XDG_CACHE_HOME/pdserve/repositories/<16 hex of sha256(url)>`` (``~/.cache``
    when ``XDG_CACHE_HOME`` is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    digest = hashlib.sha256(url.encode()).hexdigest()[:16]
    return Path(base) / "pdserve" / "repositories" / digest


class StoreUnavailable(Exception):
    """The store could not be listed or read (network, credentials, missing bucket)."""


class IntegrityError(Exception):
    """A downloaded file's size or MD5 differs from the store's listing."""


@dataclass
class SyncReport:
    """What one sync did."""

    files: int = 0  #: files in the store
    downloaded: int = 0  #: files fetched
    bytes: int = 0  #: bytes fetched
    published: list[str] = field(default_factory=list)  #: "model/version" or "model" units
    removed: list[str] = field(default_factory=list)
    deferred: list[str] = field(default_factory=list)  #: still uploading / no marker yet
    failed: list[str] = field(default_factory=list)  #: integrity failures
    seconds: float = 0.0


def _size(info: dict[str, object]) -> int:
    """The object's size in bytes as the store lists it (0 when not given)."""
    size = info.get("size") or 0
    return int(size) if isinstance(size, int | float | str) else 0


def _token(info: dict[str, object]) -> str:
    size = _size(info)
    tag = info.get("ETag") or info.get("md5Hash") or info.get("etag") or info.get("crc32c")
    if not tag:
        tag = info.get("mtime") or info.get("LastModified") or info.get("last_modified") or ""
    return f"{size}:{str(tag).strip(chr(34))}"


def _expected_md5(info: dict[str, object]) -> str | None:
    """The object's MD5 (hex) when the store gives one."""
    etag = str(info.get("ETag") or "").strip('"')
    if len(etag) == 32 and "-" not in etag:
        return etag.lower()
    md5b64 = info.get("md5Hash")
    if isinstance(md5b64, str | bytes) and md5b64:
        try:
            return base64.b64decode(md5b64).hex()
        except ValueError:
            return None
    return None


def _md5_of(path: Path) -> str:
    h = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _unit_of(rel: str) -> tuple[str, str | None] | None:
    """(model, version or None) of a file path relative to the repository root; None
    for files at the root (not part of any model, ignored as Triton does)."""
    parts = rel.split("/")
    if len(parts) < 2 or parts[0].startswith("."):
        return None
    if len(parts) >= 3 and parts[1].isdigit():
        return parts[0], parts[1]
    return parts[0], None


class RemoteRepository:
    """A model repository at an fsspec URL, mirrored into ``cache_dir/repository``.

    Args:
        url: ``s3://bucket/prefix``, ``gs://...``, ``file:///path``...
        cache_dir: the local cache root (created); the served repository is
            :attr:`local_path`.
        ready_marker: ``--version-ready-marker``: a version is published only once this
            file is in the store.
        storage_options: keyword arguments for the fsspec filesystem.

    Raises:
        ImportError: fsspec (or the store's package, e.g. s3fs) is not installed.
        ValueError: the URL has no fsspec implementation.
    """

    def __init__(
        self,
        url: str,
        cache_dir: Path,
        ready_marker: str | None = None,
        storage_options: dict[str, object] | None = None,
    ) -> None:
        import fsspec.core  # lazy: the remote-repo extra

        self.url = url.rstrip("/")
        self.cache_dir = Path(cache_dir)
        self.local_path = self.cache_dir / "repository"
        self.ready_marker = ready_marker
        options = dict(storage_options or {})
        protocol = self.url.split("://", 1)[0]
        if protocol in ("s3", "s3a"):
            options.setdefault("config_kwargs", S3_CONFIG)
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        self.root = self.root.rstrip("/")
        self._state_path = self.cache_dir / "state.json"
        self._staging = self.cache_dir / "staging"
        self.state: dict[str, str] = self._load_state()
        self.outage: str | None = None  #: the error of the current outage, None when reachable
        self.outages = 0
        self.syncs = 0
        self._lock = threading.Lock()

    # -- state ----------------------------------------------------------------------

    def _load_state(self) -> dict[str, str]:
        try:
            data = json.loads(self._state_path.read_text())
        except (OSError, ValueError):
            return {}
        files = data.get("files") if isinstance(data, dict) else None
        if data.get("url") != self.url or not isinstance(files, dict):
            return {}
        return {str(k): str(v) for k, v in files.items()}

    def _save_state(self) -> None:
        tmp = self._state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"url": self.url, "files": self.state}, sort_keys=True))
        os.replace(tmp, self._state_path)

    @property
    def has_cache(self) -> bool:
        """True when an earlier sync left a repository in the cache."""
        return self.local_path.is_dir() and bool(self.state)

    # -- store access -----------------------------------------------------------------

    def _list(self, prefix: str = "") -> dict[str, dict[str, object]]:
        """rel path -> info of every file under ``root/prefix``."""
        base = f"{self.root}/{prefix}".rstrip("/") if prefix else self.root
        try:
            self.fs.invalidate_cache()
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            if prefix:
                return {}
            raise StoreUnavailable(f"{self.url} does not exist") from None
        except Exception as e:  # noqa: BLE001 - every store raises its own errors
            raise StoreUnavailable(f"{type(e).__name__}: {e}") from e
        out: dict[str, dict[str, object]] = {}
        strip = len(self.root) + 1
        for path, info in found.items():
            if info.get("type", "file") != "file" or path.endswith("/"):
                continue
            out[path[strip:] if path.startswith(self.root + "/") else path] = info
        return out

    def _download(self, rel: str, info: dict[str, object], dest: Path) -> int:
        """Fetch one file to ``dest`` (through a temporary name) and check it.

        Raises:
            StoreUnavailable: the store failed mid-download.
            IntegrityError: size or MD5 mismatch twice in a row.
        """
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}.part")
        size = _size(info)
        md5 = _expected_md5(info)
        problem = ""
        for _ in range(2):
            try:
                self.fs.get_file(f"{self.root}/{rel}", str(tmp))
            except FileNotFoundError:
                raise IntegrityError(f"{rel} vanished from the store") from None
            except Exception as e:  # noqa: BLE001
                tmp.unlink(missing_ok=True)
                raise StoreUnavailable(f"{type(e).__name__}: {e}") from e
            got = tmp.stat().st_size
            if got != size:
                problem = f"{rel}: {got} bytes, the store lists {size}"
            elif md5 is not None and _md5_of(tmp) != md5:
                problem = f"{rel}: MD5 differs from the store's ({md5})"
            else:
                os.replace(tmp, dest)
                return got
            tmp.unlink(missing_ok=True)
        raise IntegrityError(problem)

    # -- sync ---------------------------------------------------------------------------

    def sync(self) -> SyncReport:
        """Bring the cache up to date with the store (blocking; run it in a thread).

        Raises:
            StoreUnavailable: the store could not be listed or read; the cache is left
                as it was (a version being assembled is dropped) and the outage logged
                once.
        """
        with self._lock:
            start = time.monotonic()
            try:
                report = self._sync()
            except StoreUnavailable as e:
                shutil.rmtree(self._staging, ignore_errors=True)
                if self.outage is None:
                    self.outages += 1
                    log.warning(
                        "model repository %s is unreachable (%s): serving from the local "
                        "cache %s until it is back",
                        self.url,
                        e,
                        self.local_path,
                    )
                self.outage = str(e)
                raise
            if self.outage is not None:
                log.info("model repository %s is reachable again: cache re-synced", self.url)
                self.outage = None
            self.syncs += 1
            report.seconds = time.monotonic() - start
            return report

    def _sync(self) -> SyncReport:
        listing = self._list()
        if not listing:
            # A missing bucket/prefix, a typo or a store emptied by mistake must not
            # unload every model: an empty listing counts as an outage.
            raise StoreUnavailable(f"no files under {self.url}")
        report = SyncReport(files=len(listing))
        self.local_path.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self._staging, ignore_errors=True)
        units: dict[tuple[str, str | None], dict[str, dict[str, object]]] = {}
        for rel, info in listing.items():
            unit = _unit_of(rel)
            if unit is not None:
                units.setdefault(unit, {})[rel] = info
        known: dict[tuple[str, str | None], set[str]] = {}
        for rel in self.state:
            unit = _unit_of(rel)
            if unit is not None:
                known.setdefault(unit, set()).add(rel)
        # Versions first, then model-level files (config.pbtxt after the versions it names).
        order = sorted(units, key=lambda u: (u[1] is None, u[0], int(u[1] or 0)))
        for unit in order:
            files = units[unit]
            changed = [r for r in files if self.state.get(r) != _token(files[r])]
            gone = known.get(unit, set()) - set(files)
            target = self._unit_path(unit)
            if unit[1] is not None and not target.is_dir():
                changed = list(files)
            if not changed and not gone:
                continue
            name = unit[0] if unit[1] is None else f"{unit[0]}/{unit[1]}"
            try:
                if unit[1] is None:
                    self._publish_files(files, changed, gone, report)
                else:
                    self._publish_version(unit, files, changed, report)
            except IntegrityError as e:
                report.failed.append(name)
                log.error("model repository %s: %s; %s left as it was", self.url, e, name)
            except _Deferred as e:
                report.deferred.append(name)
                log.info("model repository %s: %s not published yet: %s", self.url, name, e)
            else:
                report.published.append(name)
        # Versions and models gone from the store.
        for unit in known:
            if unit in units:
                continue
            name, version = unit
            path = self._unit_path(unit)
            if version is None:
                if not any(u[0] == name for u in units):
                    shutil.rmtree(self.local_path / name, ignore_errors=True)
                    report.removed.append(name)
            else:
                shutil.rmtree(path, ignore_errors=True)
                report.removed.append(f"{name}/{version}")
            for rel in known[unit]:
                self.state.pop(rel, None)
        self._save_state()
        shutil.rmtree(self._staging, ignore_errors=True)
        if report.downloaded or report.removed:
            log.info(
                "model repository %s: %d file(s) fetched (%d bytes), published %s, removed %s",
                self.url,
                report.downloaded,
                report.bytes,
                ", ".join(report.published) or "nothing",
                ", ".join(report.removed) or "nothing",
            )
        return report

    def _unit_path(self, unit: tuple[str, str | None]) -> Path:
        return self.local_path / unit[0] / (unit[1] or "")

    def _publish_files(
        self,
        files: dict[str, dict[str, object]],
        changed: list[str],
        gone: set[str],
        report: SyncReport,
    ) -> None:
        """Model-level files: download all changed ones, then rename them in."""
        staged: list[tuple[Path, str]] = []
        for rel in sorted(changed):
            tmp = self._staging / "files" / rel
            report.bytes += self._download(rel, files[rel], tmp)
            report.downloaded += 1
            staged.append((tmp, rel))
        for tmp, rel in staged:
            dest = self.local_path / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, dest)
            self.state[rel] = _token(files[rel])
        for rel in gone:
            (self.local_path / rel).unlink(missing_ok=True)
            self.state.pop(rel, None)

    def _publish_version(
        self,
        unit: tuple[str, str | None],
        files: dict[str, dict[str, object]],
        changed: list[str],
        report: SyncReport,
    ) -> None:
        """Assemble a version folder in staging, check the store did not change under
        it, and rename it into the cache."""
        model, version = unit
        assert version is not None
        prefix = f"{model}/{version}/"
        if self.ready_marker and f"{prefix}{self.ready_marker}" not in files:
            raise _Deferred(f"no {self.ready_marker} in it")
        stage = self._staging / "versions" / model / version
        target = self._unit_path(unit)
        changed_set = set(changed)
        for rel, info in sorted(files.items()):
            dest = stage / rel[len(prefix) :]
            if rel not in changed_set:
                dest.parent.mkdir(parents=True, exist_ok=True)
                src = target / rel[len(prefix) :]
                try:
                    os.link(src, dest)
                    continue
                except OSError:
                    with contextlib.suppress(OSError):
                        shutil.copy2(src, dest)
                        continue
                # The cached copy is gone (edited by hand?): fetch it again.
            report.bytes += self._download(rel, info, dest)
            report.downloaded += 1
        again = self._list(prefix.rstrip("/"))
        if {r: _token(i) for r, i in again.items()} != {r: _token(i) for r, i in files.items()}:
            raise _Deferred("it changed while it was downloaded (upload in progress?)")
        target.parent.mkdir(parents=True, exist_ok=True)
        trash = self._staging / "trash" / model / version
        if target.exists():
            trash.parent.mkdir(parents=True, exist_ok=True)
            os.rename(target, trash)
        os.rename(stage, target)
        shutil.rmtree(trash, ignore_errors=True)
        for rel in [r for r in self.state if r.startswith(prefix)]:
            del self.state[rel]
        for rel, info in files.items():
            self.state[rel] = _token(info)


class _Deferred(Exception):
    """A version is not ready to publish (upload in progress or no ready marker)."""
