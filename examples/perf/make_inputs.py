"""Write the input files the `pdserve perf` and `pdserve analyze` examples name, from the
example repository's golden data (examples/goldens/, made by examples/build.py):

- sentences.json: the 9 golden sentences of `text_embedding`, one request each
  (perf_analyzer's JSON format, input `text`);
- images.json: the 5 golden photos of `image_classifier`, re-encoded as JPEG with the short
  side at 256 pixels (what `preprocess` resizes to anyway; a small file), one request each
  (input `input_image_bytes`, BYTES as base64 of a 4-byte length and the bytes).

    python examples/perf/make_inputs.py
"""

from __future__ import annotations

import base64
import io
import json
import struct
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
GOLDENS = HERE.parent / "goldens"


def sentences() -> dict[str, object]:
    """perf_analyzer's JSON: one entry per golden sentence."""
    golden = np.load(GOLDENS / "text_embedding.npz")
    return {"data": [{"text": [str(s)]} for s in golden["sentences"]]}


def images() -> dict[str, object]:
    """perf_analyzer's JSON: one entry per golden photo, as a smaller JPEG."""
    golden = np.load(GOLDENS / "image_classifier.npz")
    data = []
    for name in golden["names"]:
        image = Image.open(io.BytesIO(golden[f"image_bytes_{name}"].tobytes())).convert("RGB")
        scale = 256 / min(image.size)
        image = image.resize((round(image.width * scale), round(image.height * scale)))
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=90)
        jpeg = buf.getvalue()
        b64 = base64.b64encode(struct.pack("<I", len(jpeg)) + jpeg).decode()
        data.append({"input_image_bytes": {"b64": b64}})
    return {"data": data}


def main() -> None:
    """Write sentences.json and images.json beside this file."""
    (HERE / "sentences.json").write_text(json.dumps(sentences(), indent=1) + "\n")
    (HERE / "images.json").write_text(json.dumps(images()) + "\n")


if __name__ == "__main__":
    main()
