"""Signals sent to the server's whole process group (systemd's default
``KillMode=control-group``, ``timeout``, a terminal's Ctrl-C): python workers must
leave their lifetime to the server, so shutdown stays the orderly one of a
SIGTERM to the server alone — no worker logged as crashed, none restarted, no
traceback, exit status 0."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient

from tests.conftest import copy_models, start_server


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_process_group_stops_the_server_cleanly(
    tmp_path: Path, sig: signal.Signals
) -> None:
    repo = copy_models(tmp_path / "repo", "postprocess", "preprocess", "tokenize", "pool")
    log = tmp_path / "server.log"
    server = start_server(repo, log, new_session=True)
    try:
        client = httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}")
        logits = np.zeros((1, 1000), dtype=np.float32)
        logits[0, 7] = 12.0  # softmax: e^12 / (e^12 + 999) = 0.994
        inp = httpclient.InferInput("logits", [1, 1000], "FP32")
        inp.set_data_from_numpy(logits)
        result = client.infer("postprocess", [inp])  # the worker is up and serving
        assert result.as_numpy("top5_confidences")[0][0] == pytest.approx(0.9939, abs=1e-3)
        client.close()
        os.killpg(server.proc.pid, sig)
        assert server.proc.wait(60) == 0
    finally:
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
    text = log.read_text()
    assert "pdserve stopped" in text, text
    assert "exited with code" not in text, text
    assert "Traceback" not in text, text
