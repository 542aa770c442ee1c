"""Model repository layout: finding models and versions on disk, without loading.

A model repository is Triton's layout::

    <root>/
      <model>/
        config.pbtxt          (optional while auto-complete is on)
        labels.txt ...        (files the configuration refers to)
        <version>/            numeric folder names: 1, 2, 10 ...
          model.onnx | model.pt | model.py ...

This module lists models and versions, applies the version policy and computes
a cheap fingerprint that poll mode compares to spot changes. It reads
directories and file metadata only.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeAlias

from tritonclient.grpc import model_config_pb2

from pdserve.config import (
    CONFIG_FILENAME,
)

ModelConfig: TypeAlias = model_config_pb2.ModelConfig

#: The traffic file of a model folder (:mod:`pdserve.repository.traffic`). It is not
#: part of a version's fingerprint: changing it re-reads the traffic, it reloads no
#: version.
TRAFFIC_FILENAME = "traffic.yaml"

#: The publish marker (``--version-ready-marker``): when set, a version folder is only
#: a version once this file exists in it. None (the default): every numeric folder is.
_ready_marker: str | None = None


def set_ready_marker(name: str | None) -> None:
    """Set the publish marker for this process (``--version-ready-marker``; ``pdserve
    check``'s flag of the same name). None or "" turns it off.

    Publish-by-marker: copy a version folder in under any name, then create the
    marker (``READY``) in it; until then the folder is not listed, so a half-copied
    folder is never loaded. Removing the marker from the serving version un-lists it:
    the next poll (``--model-control-mode=poll``) or load swaps back to the previous
    version the policy selects.

    Raises:
        ValueError: the name is not one plain file name.
    """
    global _ready_marker
    if name and (name in (".", "..") or "/" in name or "\\" in name or "\0" in name):
        raise ValueError(f"the ready marker must be a plain file name, got {name!r}")
    _ready_marker = name or None


def ready_marker() -> str | None:
    """The publish marker in force, or None."""
    return _ready_marker


@dataclass
class ModelDir:
    """One model folder of a repository.

    Attributes:
        name: the folder name, which is the model name.
        path: the folder.
        versions: the numeric version subfolders, ascending. Other entries are
            ignored, as Triton does.
    """

    name: str
    path: Path
    versions: list[int] = field(default_factory=list)

    @property
    def config_path(self) -> Path:
        """``<path>/config.pbtxt`` (it may not exist)."""
        return self.path / CONFIG_FILENAME

    def version_path(self, version: int) -> Path:
        """The folder of one version: ``<path>/<version>``."""
        return version_path(self.path, version)


def version_path(model_dir: ModelDir | Path, version: int) -> Path:
    """The folder of one version of a model: ``<model>/<version>`` (Triton's layout)."""
    base = model_dir.path if isinstance(model_dir, ModelDir) else Path(model_dir)
    return base / str(version)


#: The largest version number: versions are int64 in the protocols (Triton parses
#: version folder names with ``std::stoll`` and skips those out of range).
MAX_VERSION = 2**63 - 1


def _is_version_name(name: str) -> bool:
    """A canonical non-negative decimal that fits int64: ``"1"``, ``"10"``; not
    ``"01"``, ``"v1"``, ``"-1"``, ``"99999999999999999999999"`` (no request could
    name it)."""
    return (
        name.isascii()
        and name.isdigit()
        and len(name) <= len(str(MAX_VERSION))
        and str(int(name)) == name
        and int(name) <= MAX_VERSION
    )


def list_versions(model_path: Path) -> list[int]:
    """The numeric version subfolders of a model folder, ascending.

    Files, hidden entries, non-numeric folders and numbers over int64 are
    ignored (Triton skips a version folder whose name is not an int64). With a
    publish marker set (:func:`set_ready_marker`), so are folders without it.
    """
    versions = []
    marker = _ready_marker
    try:
        entries = list(os.scandir(model_path))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for entry in entries:
        if _is_version_name(entry.name) and entry.is_dir():
            if marker is not None and not os.path.isfile(os.path.join(entry.path, marker)):
                continue
            versions.append(int(entry.name))
    return sorted(versions)


def scan_repository(root: Path) -> dict[str, ModelDir]:
    """List the models of a repository: every non-hidden subfolder of ``root``.

    Args:
        root: the model repository folder.

    Returns:
        model name -> :class:`ModelDir`, in name order.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        NotADirectoryError: ``root`` is not a folder.
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"model repository '{root}' does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"model repository '{root}' is not a directory")
    models: dict[str, ModelDir] = {}
    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        path = root / entry.name
        models[entry.name] = ModelDir(entry.name, path, list_versions(path))
    return models


def select_versions(cfg: ModelConfig, available: list[int]) -> list[int]:
    """The versions a version policy loads, ascending.

    Triton's policies: ``latest { num_versions: N }`` (the N highest; the
    default when no policy is set is ``latest 1``), ``all``, ``specific {
    versions: [...] }`` (those that exist; Triton logs and skips the others).
    An empty result means nothing can be loaded; Triton fails the model then.
    """
    have = sorted(set(available))
    policy = cfg.version_policy
    choice = policy.WhichOneof("policy_choice") if cfg.HasField("version_policy") else None
    if choice is None:
        return have[-1:]
    if choice == "all":
        return have
    if choice == "specific":
        wanted = set(policy.specific.versions)
        return [v for v in have if v in wanted]
    num = policy.latest.num_versions
    return have[-num:] if num > 0 else []


def missing_versions(cfg: ModelConfig, available: list[int]) -> list[int]:
    """The versions a ``specific`` policy names that do not exist (for logging)."""
    if not cfg.HasField("version_policy") or not cfg.version_policy.HasField("specific"):
        return []
    have = set(available)
    return sorted({v for v in cfg.version_policy.specific.versions if v not in have})


def version_dir_files(model_dir: ModelDir | Path, version: int) -> list[str]:
    """The entry names in a version folder, sorted ([] if it does not exist).

    These are what :func:`pdserve.config.normalize_platform` guesses the
    backend from.
    """
    try:
        return sorted(os.listdir(version_path(model_dir, version)))
    except (FileNotFoundError, NotADirectoryError):
        return []


def fingerprint(model_dir: ModelDir, version: int | None = None) -> str:
    """A cheap hash of what a model's loaded state depends on.

    Covers ``config.pbtxt`` (its bytes), the names, sizes and modification
    times of the model folder's other files (labels...), and, for ``version``,
    of every file under that version folder. Poll mode compares fingerprints to
    decide what to reload; contents other than the configuration are not read.
    """
    h = hashlib.blake2b(digest_size=16)
    path = Path(model_dir.path)
    try:
        h.update(b"config\0" + path.joinpath(CONFIG_FILENAME).read_bytes())
    except OSError:
        h.update(b"config\0<none>")
    try:
        top = sorted(os.scandir(path), key=lambda e: e.name)
    except OSError:
        top = []
    for entry in top:
        if entry.name in (CONFIG_FILENAME, TRAFFIC_FILENAME) or entry.name.startswith("."):
            continue
        try:
            if entry.is_file():
                st = entry.stat()
                h.update(f"file\0{entry.name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
        except OSError:
            continue
    if version is not None:
        vpath = path / str(version)
        h.update(f"version\0{version}\n".encode())
        for dirpath, dirnames, filenames in os.walk(vpath):
            dirnames.sort()
            rel = os.path.relpath(dirpath, vpath)
            for name in sorted(filenames):
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except OSError:
                    continue
                h.update(f"{rel}/{name}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


#: What poll mode compares: (model-level fingerprint, ((version, fingerprint), ...)).
Snapshot = tuple[str, tuple[tuple[int, str], ...]]


def snapshot(mdir: ModelDir) -> Snapshot:
    """Fingerprints of a model folder: its configuration and top-level files (the
    traffic file included), and each version folder's files (see
    :func:`pdserve.repository.fingerprint`)."""
    try:
        st = os.stat(mdir.path / TRAFFIC_FILENAME)
        traffic = f"{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        traffic = "-"
    return (
        fingerprint(mdir) + traffic,
        tuple((v, fingerprint(mdir, v)) for v in mdir.versions),
    )
