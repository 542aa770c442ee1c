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


def _warm_file(name: str) -> str:
    return (
        '\nmodel_warmup [ { name: "file" batch_size: 1\n'
        f'  inputs {{ key: "X" value {{ data_type: TYPE_FP32 dims: [ 1 ] input_data_file: "{name}" }} }} }} ]\n'
    )


def test_input_data_file_stays_in_warmup_folder_and_never_blocks(tmp_path: Path) -> None:
    """``input_data_file`` is read only from ``<model>/warmup/`` (as Triton), only
    from a regular file, and off the event loop: an absolute path, ``..``, a
    symlink out, a FIFO or a short file fail the load with a message naming the
    field (no server path), and health keeps answering. Before the fix the FIFO
    froze the whole server and ``/proc/self/environ`` loaded."""
    import os
    import urllib.request

    repo = tmp_path / "repo"
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"\x00" * 64)
    cases = {
        "w_abs": (secret.as_posix(), "must be a path relative to the model's warmup/ folder"),
        "w_proc": ("/proc/self/environ", "must be a path relative to the model's warmup/ folder"),
        "w_up": ("../../secret.bin", "'../../secret.bin' leaves the model's warmup/ folder"),
        "w_link": ("link.bin", "'link.bin' leaves the model's warmup/ folder"),
        "w_fifo": ("fifo", "'fifo' is not a regular file"),
        "w_short": ("short.bin", "'short.bin' holds 2 bytes, shape needs 4"),
        "w_ok": ("ok.bin", ""),
    }
    for model, (name, _) in cases.items():
        shutil.copytree(COUNTER, repo / model)
        cfg = repo / model / "config.pbtxt"
        cfg.write_text(
            cfg.read_text().replace('name: "counter"', f'name: "{model}"') + _warm_file(name)
        )
        (repo / model / "warmup").mkdir()
    (repo / "w_link" / "warmup" / "link.bin").symlink_to(secret)
    os.mkfifo(repo / "w_fifo" / "warmup" / "fifo")
    (repo / "w_short" / "warmup" / "short.bin").write_bytes(b"\x00\x00")
    (repo / "w_ok" / "warmup" / "ok.bin").write_bytes(np.float32([2.5]).tobytes() + b"extra")
    server = start_server(repo, tmp_path / "pdserve.log", "--model-control-mode=explicit")
    try:
        client = httpclient.InferenceServerClient(server.http_url, network_timeout=20)
        for model, (_, want) in cases.items():
            if not want:
                client.load_model(model)
                assert calls(client, model) == 2  # the file's sample ran once
                continue
            try:
                client.load_model(model)
            except Exception as e:  # tritonclient raises InferenceServerException
                msg = str(e)
            else:
                raise AssertionError(f"{model} loaded")
            assert "input 'X'" in msg and "input_data_file" in msg and want in msg, msg
            assert str(tmp_path) not in msg, msg
            with urllib.request.urlopen(f"http://{server.http_url}/v2/health/live", timeout=2) as r:
                assert r.status == 200
        client.close()
    finally:
        assert server.stop() == 0
