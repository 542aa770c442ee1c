"""Warm-up at load (pdserve.repository.warmup) on a real server: a python model
that counts its execute() calls sees none at load without ``model_warmup``, and
exactly the configured samples with it (issue 10)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import tritonclient.http as httpclient

from tests.conftest import ROOT, start_server

COUNTER = ROOT / "tests" / "data" / "python_models" / "counter"

WARMUP = """
model_warmup [ { name: "twice" batch_size: 1 count: 2
  inputs { key: "X" value { data_type: TYPE_FP32 dims: [ 1 ] zero_data: true } } } ]
"""


def calls(client: httpclient.InferenceServerClient, model: str) -> int:
    x = httpclient.InferInput("X", [1], "FP32")
    x.set_data_from_numpy(np.zeros(1, np.float32))
    return int(client.infer(model, [x]).as_numpy("CALLS")[0])


def test_execute_runs_only_for_requests_and_configured_warmup(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    shutil.copytree(COUNTER, repo / "counter")
    shutil.copytree(COUNTER, repo / "counter_warm")
    cfg = repo / "counter_warm" / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace('name: "counter"', 'name: "counter_warm"') + WARMUP)
    server = start_server(repo, tmp_path / "pdserve.log")
    try:
        client = httpclient.InferenceServerClient(server.http_url)
        assert calls(client, "counter") == 1  # no phantom execute() at load
        assert calls(client, "counter") == 2
        assert calls(client, "counter_warm") == 3  # the sample ran count=2 times
        client.close()
    finally:
        assert server.stop() == 0
    log = server.log()
    assert "warmed up counter_warm version 1: 1 sample on 1 instance" in log, log
    assert "warmed up counter " not in log, log
