"""What a load request may name, and where its ``config`` + ``file:`` contents are served from.

:func:`check_model_name` and :func:`check_file_paths` refuse names and paths that are not
plain folder / file names of the repository before anything touches the disk.
:func:`stage` writes a load request's configuration and files into a temporary model
folder (Triton's override location); :func:`public_message` keeps absolute paths of the
repository and of staged folders out of what clients see.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Collection
from pathlib import Path

from google.protobuf import text_format

from pdserve import config as cfgmod
from pdserve.core.errors import InferError, internal

log = logging.getLogger("pdserve.repository")

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


def shown(text: str, limit: int = 80) -> str:
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
            f"invalid model name {shown(name)}: it is {size} bytes long, and a model name "
            f"is one folder name of the repository (at most {MAX_NAME_BYTES} bytes)"
        )
    if name in (".", "..") or name.startswith(".") or any(c in name for c in ("/", "\\", "\0")):
        raise InferError(
            f"invalid model name {shown(name)}: it must be one folder name of the "
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
        what = f"load parameter {shown('file:' + rel)}"
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


class Staged:
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


def _write_staged(staged: Staged, config: cfgmod.ModelConfig, files: dict[str, bytes]) -> None:
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


async def stage(name: str, config: cfgmod.ModelConfig, files: dict[str, bytes]) -> Staged:
    """Write ``config`` and ``files`` into a new temporary model folder (off the event
    loop: model files are large).

    Raises:
        InferError(INTERNAL): the files cannot be written (disk full...).
    """

    def write() -> Staged:
        staged = Staged(Path(tempfile.mkdtemp(prefix=STAGING_PREFIX)), name)
        try:
            _write_staged(staged, config, files)
        except BaseException:
            staged.remove()
            raise
        return staged

    try:
        return await asyncio.to_thread(write)
    except OSError as e:
        log.error("model %s: cannot stage the 'file:' contents: %s", name, e)
        raise internal(
            f"failed to load '{name}': cannot write the 'file:' contents to a temporary "
            f"folder: {e.strerror or type(e).__name__}"
        ) from None


def public_message(message: str, repository: Path, override_dir: Path | None = None) -> str:
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
    repos = {str(repository.absolute())}
    try:
        repos.add(str(repository.resolve()))
    except OSError:
        pass
    for repo in sorted(repos, key=len, reverse=True):
        message = message.replace(repo + os.sep, "")
        message = message.replace(repo, "<model repository>")
    return message
