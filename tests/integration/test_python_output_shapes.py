"""A python model whose outputs are shaped other than its configuration says, against a
real pdserve and ``pdserve check``: served with the produced shape (as Triton's python
backend does), warned about once per output and counted in
``pdserve_output_shape_mismatch_total``; an error with ``strict_output_shapes``; a
datatype mismatch is an error either way; ``pdserve check`` flags it from goldens."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from tests.conftest import ROOT, ServerProcess, start_server

CONFIG = """
name: "{name}"
backend: "python"
max_batch_size: 0
input [ {{ name: "X", data_type: TYPE_FP32, dims: [ -1 ] }} ]
output [
  {{ name: "Y", data_type: TYPE_FP32, dims: [ 1 ] }},
  {{ name: "Z", data_type: TYPE_FP32, dims: [ 3 ] }},
  {{ name: "D", data_type: TYPE_FP32, dims: [ -1 ] }}
]
instance_group [ {{ count: 1, kind: KIND_CPU }} ]
{extra}
"""

STRICT = 'parameters { key: "strict_output_shapes" value: { string_value: "true" } }'

MODEL = '''
"""Y = 2 X (shape [N], configured [1]); Z = [[0,1,2],[3,4,5]] + X[0] (shape [2,3],
configured [3]); D = X, as INT32 when X[0] < 0 (configured FP32)."""

import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "X").as_numpy()
            z = np.arange(6, dtype=np.float32).reshape(2, 3) + x[0]
            d = x.astype(np.int32) if x[0] < 0 else x
            outputs = [
                pb_utils.Tensor("Y", 2 * x),
                pb_utils.Tensor("Z", z),
                pb_utils.Tensor("D", d),
            ]
            responses.append(pb_utils.InferenceResponse(outputs))
        return responses
'''


def make_model(repo: Path, name: str, extra: str = "") -> Path:
    """The model above as ``repo/name`` (an example's layout: config.pbtxt, 1/model.py)."""
    (repo / name / "1").mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(CONFIG.format(name=name, extra=extra))
    (repo / name / "1" / "model.py").write_text(MODEL)
    return repo / name


X = np.array([1.0, 2.0, 3.0, 4.0], dtype=np.float32)
MODULES = {"http": httpclient, "grpc": grpcclient}
STATUS = {"http": "500", "grpc": "StatusCode.INTERNAL"}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("output_shapes")
    make_model(root / "repo", "shapes")
    make_model(root / "repo", "shapes_strict", STRICT)
    proc = start_server(root / "repo", root / "pdserve.log")
    yield proc
    proc.stop()


def client(kind: str, server: ServerProcess) -> object:
    url = server.http_url if kind == "http" else server.grpc_url
    return MODULES[kind].InferenceServerClient(url)  # type: ignore[attr-defined]


def infer(
    kind: str, server: ServerProcess, model: str, x: np.ndarray, outputs: list[str] | None = None
) -> object:
    module = MODULES[kind]
    t = module.InferInput("X", list(x.shape), "FP32")  # type: ignore[attr-defined]
    t.set_data_from_numpy(x)
    wanted = None if outputs is None else [module.InferRequestedOutput(n) for n in outputs]  # type: ignore[attr-defined]
    c = client(kind, server)
    try:
        return c.infer(model, [t], outputs=wanted)  # type: ignore[attr-defined]
    finally:
        c.close()  # type: ignore[attr-defined]


def mismatches(server: ServerProcess) -> dict[tuple[str, str], float]:
    """pdserve_output_shape_mismatch_total by (model, output)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics") as r:
        text = r.read().decode()
    found = {}
    pattern = r'^pdserve_output_shape_mismatch_total\{model="([^"]+)",version="1",output="([^"]+)"\} (\S+)$'
    for model, output, value in re.findall(pattern, text, re.M):
        found[(model, output)] = float(value)
    assert "# TYPE pdserve_output_shape_mismatch_total counter" in text
    return found


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_default_serves_the_produced_shape(kind: str, server: ServerProcess) -> None:
    result = infer(kind, server, "shapes", X)
    y, z, d = (result.as_numpy(n) for n in ("Y", "Z", "D"))  # type: ignore[attr-defined]
    assert y.shape == (4,)
    np.testing.assert_array_equal(y, 2 * X)
    assert z.shape == (2, 3)
    np.testing.assert_array_equal(z, np.arange(6, dtype=np.float32).reshape(2, 3) + 1.0)
    np.testing.assert_array_equal(d, X)
    # the metadata still says what the configuration says
    meta = client("http", server).get_model_metadata("shapes")  # type: ignore[attr-defined]
    assert {o["name"]: o["shape"] for o in meta["outputs"]} == {"Y": [1], "Z": [3], "D": [-1]}


def test_counter_counts_and_the_warning_is_logged_once_per_output(server: ServerProcess) -> None:
    before = mismatches(server)
    for _ in range(3):
        infer("http", server, "shapes", X)
    infer("grpc", server, "shapes", X, outputs=["Y"])  # Z not requested: not checked
    after = mismatches(server)
    assert after[("shapes", "Y")] - before.get(("shapes", "Y"), 0) == 4
    assert after[("shapes", "Z")] - before.get(("shapes", "Z"), 0) == 3
    assert ("shapes", "D") not in after
    log = server.log()
    warn_y = "python model 'shapes' version 1 returned output 'Y' with shape [4], but its configuration says [1]"
    warn_z = "python model 'shapes' version 1 returned output 'Z' with shape [2,3], but its configuration says [3]"
    assert log.count(warn_y) == 1, log
    assert log.count(warn_z) == 1, log


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_a_datatype_mismatch_stays_an_error(kind: str, server: ServerProcess) -> None:
    with pytest.raises(InferenceServerException) as info:
        infer(kind, server, "shapes", -X)
    assert info.value.status() == STATUS[kind]
    assert "model 'shapes' returned output 'D' as INT32, but its model configuration says FP32" in (
        info.value.message() or ""
    )
    np.testing.assert_array_equal(infer(kind, server, "shapes", X).as_numpy("D"), X)  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["http", "grpc"])
def test_strict_mode_fails_the_request_and_others_carry_on(
    kind: str, server: ServerProcess
) -> None:
    with pytest.raises(InferenceServerException) as info:
        infer(kind, server, "shapes_strict", X)
    assert info.value.status() == STATUS[kind]
    assert "model 'shapes_strict' returned output 'Y' with shape [4], expected [1]" in (
        info.value.message() or ""
    )
    # a request whose outputs are shaped as configured is answered
    one = np.array([5.0], dtype=np.float32)
    result = infer(kind, server, "shapes_strict", one, outputs=["Y", "D"])
    np.testing.assert_array_equal(result.as_numpy("Y"), 2 * one)  # type: ignore[attr-defined]
    assert ("shapes_strict", "Y") not in mismatches(server)
    assert "python model 'shapes_strict' version 1 returned" not in server.log()  # no warning


def test_check_flags_the_shape_from_goldens(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    for name, extra in (("shapes", ""), ("shapes_strict", STRICT)):
        vdir = make_model(repo, name, extra) / "1"
        np.savez(vdir / "golden.npz", x=X, y=2 * X)
        identity = {
            "model": name,
            "version": 1,
            "golden": {"file": "golden.npz", "inputs": {"X": "x"}, "outputs": {"Y": "y"}},
        }
        (vdir / "MODEL_IDENTITY.json").write_text(json.dumps(identity))
    run = subprocess.run(
        [sys.executable, "-m", "pdserve", "check", str(repo), "--format", "json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    report = json.loads(run.stdout)
    problems = {(p["model"], p["check"], p["severity"]): p["message"] for p in report["problems"]}
    lenient = problems[("shapes", "golden", "warning")]
    assert "output 'Y': the model produced shape [4], its configuration says [1]" in lenient
    assert "serve answers with the produced shape" in lenient
    strict = problems[("shapes_strict", "golden", "error")]
    assert "output 'Y': the model produced shape [4], its configuration says [1]" in strict
    assert run.returncode == 1, run.stdout  # the strict model's finding is an error
    # the values themselves matched the goldens: no other golden problem
    assert [k for k in problems if k[1] == "golden"] == [
        ("shapes", "golden", "warning"),
        ("shapes_strict", "golden", "error"),
    ]
