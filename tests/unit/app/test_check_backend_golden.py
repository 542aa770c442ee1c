"""``pdserve check`` on OpenVINO, TensorFlow and ``torch_aoti`` models: the model
loads, its configuration fits its signature, and its goldens run through one CPU
instance of the backend."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pdserve.app.check import check_repository
from pdserve.app.check_backend_golden import runs_golden
from pdserve.config import load_model_config
from tests.openvino_models import write_double

pytest.importorskip("openvino")


def _model(repo: Path, name: str, golden_out: np.ndarray, config: str = "") -> Path:
    vdir = repo / name / "1"
    write_double(vdir, [-1, 4])
    (repo / name / "config.pbtxt").write_text(
        f'name: "{name}"\nbackend: "openvino"\nmax_batch_size: 4\n' + config
    )
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.savez(vdir / "golden.npz", input_0=x, output_0=golden_out)
    entry = {"file": "golden.npz", "inputs": {"x": "input_0"}, "outputs": {"y": "output_0"}}
    identity = {"model": name, "version": 1, "golden": {**entry, "atol": 1e-6, "rtol": 0}}
    (vdir / "MODEL_IDENTITY.json").write_text(json.dumps(identity))
    return repo / name


def test_goldens_configs_and_files_of_a_framework_model(tmp_path: Path) -> None:
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    _model(tmp_path, "good", x * 2)
    _model(tmp_path, "wrong_golden", x * 3)
    _model(tmp_path, "wrong_dims", x * 2, 'input { name: "x" data_type: TYPE_FP32 dims: [5] }')
    bad = _model(tmp_path, "corrupt", x * 2)
    (bad / "1" / "model.xml").write_text("<net")
    assert runs_golden(load_model_config(tmp_path / "good"))
    report = check_repository(tmp_path)
    by_model = {m.name: m for m in report.models}
    assert by_model["good"].ok, by_model["good"].to_json()
    assert "golden" in [r.check for r in by_model["good"].all_results if r.status == "passed"]
    problems = {
        name: [(p.check, p.message) for p in by_model[name].problems if p.severity == "error"]
        for name in ("wrong_golden", "wrong_dims", "corrupt")
    }
    assert [c for c, _ in problems["wrong_golden"]] == ["golden"]
    assert "output 'y'" in problems["wrong_golden"][0][1]
    assert problems["wrong_dims"][0][0] == "openvino-config"
    assert "dims [-1,5] of 'x'" in problems["wrong_dims"][0][1]
    assert problems["corrupt"][0][0] == "openvino-config"
    assert "OpenVINO cannot read" in problems["corrupt"][0][1]
