"""Build the *transformer* repository of the split image pipeline.

The image pipeline (``image_classifier`` = ``preprocess`` -> ``efficientnet_lite0`` ->
``postprocess``) split across two pdserve processes (service-level PD separation):

* the **predictor** serves the normal example repository (``examples/model_repository``,
  which holds ``efficientnet_lite0``);
* the **transformer** serves the repository this script writes: ``image_classifier``,
  ``preprocess`` and ``postprocess`` copied from the example repository, and an
  ``efficientnet_lite0`` with ``backend: "remote"`` that forwards each batch to the
  predictor over gRPC (default) or HTTP with the binary extension.

Usage::

    python examples/split/build_split.py --predictor 127.0.0.1:8001 [--protocol grpc]
        [--out examples/split/transformer] [--source examples/model_repository]
    # predictor:   pdserve serve --model-repository examples/model_repository --http-port 8000 --grpc-port 8001 ...
    # transformer: pdserve serve --model-repository examples/split/transformer --http-port 9000 --grpc-port 9001 ...

The predictor's gRPC port goes with ``--protocol grpc``, its HTTP port with ``http``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parents[1]
#: Models copied unchanged from the example repository.
COPIED = ("image_classifier", "preprocess", "postprocess")

REMOTE_CONFIG = """\
# efficientnet_lite0 served by another V2 server (the predictor): each batch is sent
# there as one request. Inputs/outputs are checked against the predictor's at load.
name: "efficientnet_lite0"
backend: "remote"
max_batch_size: 32
input [ {{ name: "input", data_type: TYPE_FP32, dims: [ 3, 224, 224 ] }} ]
output [ {{ name: "logits", data_type: TYPE_FP32, dims: [ 1000 ] }} ]
# batches in flight to the predictor at once
instance_group [ {{ count: {in_flight}, kind: KIND_CPU }} ]
parameters {{ key: "url" value: {{ string_value: "{url}" }} }}
parameters {{ key: "protocol" value: {{ string_value: "{protocol}" }} }}
parameters {{ key: "timeout_ms" value: {{ string_value: "{timeout_ms}" }} }}
parameters {{ key: "retries" value: {{ string_value: "2" }} }}
parameters {{ key: "pool_size" value: {{ string_value: "{pool_size}" }} }}
parameters {{ key: "health_interval_ms" value: {{ string_value: "{health_interval_ms}" }} }}
"""


def build(
    out: Path,
    predictor: str,
    protocol: str = "grpc",
    source: Path = EXAMPLES_DIR / "model_repository",
    *,
    in_flight: int = 8,
    pool_size: int = 4,
    timeout_ms: int = 30000,
    health_interval_ms: int = 1000,
) -> Path:
    """Write the transformer repository to ``out`` (replacing what is there).

    Args:
        out: the repository folder to write.
        predictor: the predictor's ``host:port`` (its gRPC port for ``grpc``, its
            HTTP port for ``http``).
        protocol: ``grpc`` or ``http``.
        source: the example repository to copy the pipeline's other models from.
        in_flight: instances of the remote model (batches in flight at once).
        pool_size / timeout_ms / health_interval_ms: the remote model's parameters.

    Returns:
        ``out``.

    Raises:
        FileNotFoundError: ``source`` lacks a model (build the examples first).
    """
    for name in COPIED:
        if not (source / name / "config.pbtxt").is_file():
            raise FileNotFoundError(f"{source / name} is missing: run `python examples/build.py`")
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for name in COPIED:
        shutil.copytree(source / name, out / name)
    remote = out / "efficientnet_lite0"
    (remote / "1").mkdir(parents=True)
    (remote / "config.pbtxt").write_text(
        REMOTE_CONFIG.format(
            url=predictor,
            protocol=protocol,
            in_flight=in_flight,
            pool_size=pool_size,
            timeout_ms=timeout_ms,
            health_interval_ms=health_interval_ms,
        )
    )
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line: see the module doc."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--predictor", required=True, help="the predictor's host:port")
    ap.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "transformer")
    ap.add_argument("--source", type=Path, default=EXAMPLES_DIR / "model_repository")
    ap.add_argument("--in-flight", type=int, default=8)
    ap.add_argument("--pool-size", type=int, default=4)
    args = ap.parse_args(argv)
    out = build(
        args.out,
        args.predictor,
        args.protocol,
        args.source,
        in_flight=args.in_flight,
        pool_size=args.pool_size,
    )
    print(f"transformer repository written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
