"""CPU per span of the OTLP encoding on the export thread (issue 17): one
``ExportTraceServiceRequest`` of 74 traces of the ``tiny`` model's 7-span tree (518 spans,
about one ``bsp_max_export_batch_size`` batch), serialized; ``time.process_time`` of 20
encodings, 7 times; min and median per span.

    python benchmarks/bench_otlp_encode.py [--module path/to/otlp.py]

``--module``: another version of ``pdserve/observability/otlp.py`` to compare, e.g. the
hand-written wire format this replaced: ``git show 11df167:pdserve/observability/otlp.py``.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from common import cli_parser

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pdserve.core.tracing import Trace  # noqa: E402


def tiny_trace(i: int) -> Trace:
    """The spans of one traced request to ``tiny`` (as the server records them)."""
    t = Trace()
    root = f"{i + 1:016x}"
    model_attrs = {
        "triton.model_name": "tiny",
        "triton.model_version": 1,
        "triton.request_id": "",
        "pdserve.batch_size": 1,
    }
    model = t.add("tiny", root, 2_000, 8_000, model_attrs)
    batch = {
        "pdserve.batch_size": 4,
        "pdserve.batch_requests": 4,
        "pdserve.model_instance": "tiny_0",
    }
    t.add("queue", model, 2_100, 3_000)
    compute = t.add("compute", model, 3_000, 7_000, batch)
    t.add("compute_input", compute, 3_000, 4_000)
    t.add("compute_infer", compute, 4_000, 6_000)
    t.add("compute_output", compute, 6_000, 7_000)
    root_attrs = {"triton.model_name": "tiny", "triton.model_version": 1}
    t.add("InferRequest", "", 1_000, 9_000, root_attrs, span_id=root)
    return t


def main() -> None:
    parser = cli_parser(__doc__, __file__)
    parser.add_argument("--module", type=Path, help="an otlp.py to load instead of pdserve's")
    args = parser.parse_args()
    if args.module:
        spec = importlib.util.spec_from_file_location("otlp_under_test", args.module)
        assert spec is not None and spec.loader is not None
        otlp: Any = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(otlp)
    else:
        from pdserve.observability import otlp
    conv = otlp.SpanConverter({"service.name": "pdserve"})
    traces = [tiny_trace(i) for i in range(74)]
    n_spans = sum(len(t.spans) for t in traces)

    def encode() -> bytes:
        if hasattr(conv, "add_spans"):  # opentelemetry-proto messages
            message, _ = conv.request([(t, 10**18) for t in traces])
            data: bytes = message.SerializeToString()
            return data
        spans: list[bytes] = []  # the hand-written encoding (before)
        for t in traces:
            spans.extend(conv.convert(t, 10**18))
        old: bytes = conv.request(spans)
        return old

    size = len(encode())
    per_span = []
    for _ in range(7):
        start = time.process_time()
        for _ in range(20):
            encode()
        per_span.append((time.process_time() - start) / 20 / n_spans * 1e6)
    print(
        f"{args.module or 'pdserve.observability.otlp'}: {n_spans} spans, {size} bytes per "
        f"request; CPU per span min {min(per_span):.2f} us, median "
        f"{statistics.median(per_span):.2f} us"
    )


if __name__ == "__main__":
    main()
