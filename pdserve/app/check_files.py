"""File checks of ``pdserve check`` on one version folder: ``onnx-checker`` (the ONNX
graph is valid) and ``identity`` (``MODEL_IDENTITY.json`` names this model, version and
model file, whose sha256 and size are the recorded ones)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

from pdserve import config as cfgmod
from pdserve.repository import layout

from .check_report import WARNING, CheckResult

#: The file in a version folder that records the model file's identity and goldens.
IDENTITY_FILENAME = "MODEL_IDENTITY.json"
#: The pdserve extra that installs the ``onnx`` package for ``onnx-checker``.
ONNX_EXTRA = "check"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def guess_model_file(version_dir: Path, identity: dict[str, object] | None) -> Path | None:
    """The model file when the configuration is unusable: the identity's, or a default name."""
    recorded = identity.get("model_file") if identity else None
    if isinstance(recorded, str):
        return version_dir / recorded
    for name in cfgmod.DEFAULT_MODEL_FILENAMES.values():
        if (version_dir / name).exists():
            return version_dir / name
    return None


def read_identity(path: Path) -> dict[str, object] | None:
    """MODEL_IDENTITY.json as a dict, None when it is unusable (the identity check says why)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def check_onnx_file(r: CheckResult, path: Path) -> None:
    """``onnx.checker.check_model(full_check=True)`` on a model file."""
    if importlib.util.find_spec("onnx") is None:
        reason = (
            f"the onnx package is not installed: pip install 'pdserve[{ONNX_EXTRA}]' "
            "to run onnx.checker"
        )
        r.skip(reason)
        r.add(reason, path, severity=WARNING)
        return
    import onnx

    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as e:
        r.add(f"onnx.checker: {str(e).strip()}", path)
    except Exception as e:  # not even a protobuf: DecodeError, shape inference errors
        r.add(f"not a valid ONNX model: {type(e).__name__}: {str(e).strip()}", path)


def check_identity(
    r: CheckResult, path: Path, mdir: layout.ModelDir, version: int, model_path: Path | None
) -> None:
    """MODEL_IDENTITY.json: parses, names this model and version and the file served,
    and the file's sha256 and size are the recorded ones."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        r.add(f"not valid JSON: {e}", path)
        return
    if not isinstance(data, dict):
        r.add("must hold a JSON object", path)
        return
    if "model" in data and data["model"] != mdir.name:
        r.add(
            f"records model {data['model']!r}, but it is in the folder of '{mdir.name}'",
            path,
            "model",
        )
    if "version" in data and data["version"] != version:
        r.add(
            f"records version {data['version']!r}, but it is in version folder {version}",
            path,
            "version",
        )
    recorded = data.get("model_file")
    if recorded is not None and not isinstance(recorded, str):
        r.add("must be a file name", path, "model_file")
        return
    vdir = mdir.version_path(version)
    if recorded and not inside(vdir, vdir / recorded):
        r.add(f"'{recorded}' is not a file of the version folder {vdir}", path, "model_file")
        return
    target = vdir / recorded if recorded else model_path
    if target is None:
        r.skip("no model file to verify (no model_file and an unusable configuration)")
        return
    in_folder = model_path is not None and model_path.is_dir() and inside(model_path, target)
    if (
        recorded
        and model_path is not None
        and target.resolve() != model_path.resolve()
        and not in_folder
    ):
        r.add(
            f"describes '{recorded}', but the configuration loads '{model_path.name}'",
            path,
            "model_file",
        )
    if not target.is_file():
        r.add(f"model file {target} does not exist", path, "model_file")
        return
    sha = data.get("sha256")
    if sha is None:
        r.add("records no sha256: the model file cannot be verified", path, "sha256", WARNING)
    elif not isinstance(sha, str):
        r.add("must be a hex string", path, "sha256")
    else:
        actual = _sha256(target)
        if actual != sha.lower():
            r.add(
                f"{target.name} has sha256 {actual}, but {path.name} records {sha}: the model "
                "file is not the one recorded",
                path,
                "sha256",
            )
    size = data.get("size_bytes")
    if isinstance(size, int) and not isinstance(size, bool):
        actual_size = target.stat().st_size
        if actual_size != size:
            r.add(
                f"{target.name} has {actual_size} bytes, {path.name} records {size}",
                path,
                "size_bytes",
            )


def inside(folder: Path, path: Path) -> bool:
    """Whether ``path`` names something in ``folder`` (lexically: a symlink there counts)."""
    rel = os.path.normpath(os.path.relpath(path, folder))
    return not os.path.isabs(rel) and rel != ".." and not rel.startswith(".." + os.sep)
