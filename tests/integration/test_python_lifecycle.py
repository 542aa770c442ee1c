"""A python model's life cycle in a real pdserve: 100 load/unload cycles leave the
server's descriptors, threads and memory where they were, and a signal during a
warm-up that blocks in the model ends the server promptly with exit code 0."""

from __future__ import annotations

import http.client
import re
import shutil
import signal
import struct
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.conftest import ROOT, ServerProcess, copy_models, descendants, start_server

MODELS = ROOT / "tests" / "data" / "python_models"
CYCLES = 100
#: RSS the server may gain over the cycles: allocator and interpreter caches that settle
#: (a leak of the worker's arenas or connections would be megabytes per cycle).
RSS_SLACK_BYTES = 8 * 1024 * 1024
#: Descriptors and threads the server may hold beyond the start (a pooled executor
#: thread, the keep-alive connection of the client).
FD_SLACK = 2
THREAD_SLACK = 2


def repository(server: ServerProcess, action: str, model: str) -> None:
    """POST /v2/repository/models/<model>/<action>; asserts 200."""
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    try:
        conn.request("POST", f"/v2/repository/models/{model}/{action}", body=b"{}")
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    assert response.status == 200, (action, response.status, body)


def usage(pid: int) -> tuple[int, int, int]:
    """(open descriptors, threads, RSS bytes) of process ``pid``."""
    fds = len(list(Path(f"/proc/{pid}/fd").iterdir()))
    status = Path(f"/proc/{pid}/status").read_text()
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    rss_kb = int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1))  # type: ignore[union-attr]
    return fds, threads, rss_kb * 1024


def infer_pool(server: ServerProcess) -> np.ndarray:
    """One request to the example ``pool`` model: mean of 2 tokens, unit length."""
    client = httpclient.InferenceServerClient(server.http_url)
    emb = np.zeros((1, 2, 384), np.float32)
    emb[0, 0, 0], emb[0, 1, 1] = 3.0, 3.0
    mask = np.ones((1, 2), np.int64)
    inputs = [
        httpclient.InferInput("token_embeddings", list(emb.shape), "FP32"),
        httpclient.InferInput("attention_mask", list(mask.shape), "INT64"),
    ]
    inputs[0].set_data_from_numpy(emb)
    inputs[1].set_data_from_numpy(mask)
    out = client.infer("pool", inputs).as_numpy("embedding")
    client.close()
    assert out is not None
    return out


def test_load_unload_cycles_leave_descriptors_threads_and_rss_flat(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "repo", "pool")
    server = start_server(
        repo, tmp_path / "pdserve.log", "--model-control-mode=explicit", "--load-model=pool"
    )
    pid = server.proc.pid
    try:
        expected = np.zeros(384, np.float32)
        expected[0] = expected[1] = np.float32(np.sqrt(0.5))
        np.testing.assert_allclose(infer_pool(server)[0], expected, rtol=1e-5)
        # one warm cycle first: what the first unload and reload create once (the
        # fork server's connection, executor threads) is not a leak
        repository(server, "unload", "pool")
        repository(server, "load", "pool")
        before = usage(pid)
        started = time.monotonic()
        for _ in range(CYCLES):
            repository(server, "unload", "pool")
            repository(server, "load", "pool")
        took = time.monotonic() - started
        np.testing.assert_allclose(infer_pool(server)[0], expected, rtol=1e-5)
        time.sleep(0.5)  # the last unloaded worker's end is reaped
        after = usage(pid)
    finally:
        code = server.stop()
    log = server.log()
    assert code == 0, log
    assert after[0] <= before[0] + FD_SLACK, f"descriptors {before[0]} -> {after[0]}"
    assert after[1] <= before[1] + THREAD_SLACK, f"threads {before[1]} -> {after[1]}"
    assert after[2] <= before[2] + RSS_SLACK_BYTES, f"RSS {before[2]} -> {after[2]} bytes"
    assert took < 60, f"{CYCLES} cycles took {took:.1f} s"


# -- a signal during a blocking warm-up ----------------------------------------------


def stalling_with_warmup(tmp_path: Path, block_s: float) -> Path:
    """The ``stalling`` test model, whose warm-up sample makes execute() sleep ``block_s``."""
    repo = tmp_path / "repo"
    shutil.copytree(MODELS / "stalling", repo / "stalling")
    (repo / "stalling" / "warmup").mkdir()
    (repo / "stalling" / "warmup" / "x").write_bytes(struct.pack("<f", block_s))
    with (repo / "stalling" / "config.pbtxt").open("a") as f:
        f.write(
            'model_warmup [ { name: "block" batch_size: 1 inputs { key: "X" value: '
            '{ data_type: TYPE_FP32 dims: [ 1 ] input_data_file: "x" } } } ]\n'
        )
    return repo


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_blocking_warmup_exits_promptly_with_0(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """execute() sleeps 600 s in the warm-up; the signal ends the server (exit 0) in a
    few seconds, far below --exit-timeout-secs + the exit watchdog's margin (35 s)."""
    from pdserve.app.main import EXIT_MARGIN_SECS

    repo = stalling_with_warmup(tmp_path, 600.0)
    server = start_server(
        repo, tmp_path / "pdserve.log", "--exit-timeout-secs=30", wait_ready=False
    )
    try:
        deadline = time.monotonic() + 60
        while len(descendants(server.proc.pid)) < 3:  # resource tracker, fork server, worker
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.05)
        time.sleep(1.0)  # initialize() returned (it sleeps 0 s): execute() sleeps now
        t0 = time.monotonic()
        server.proc.send_signal(sig)
        code = server.proc.wait(30 + EXIT_MARGIN_SECS + 10)
        took = time.monotonic() - t0
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(10)
    log = server.log()
    assert code == 0, log
    assert took < 5.0, f"exit took {took:.1f} s\n{log}"
    assert "shutdown did not finish" not in log, log
    assert "abandoning the loads in progress" in log, log
    assert "pdserve stopped" in log, log
