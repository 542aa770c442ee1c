"""The commands in deploy/kubernetes run as written (issue 14 item 3).

Each test takes a command from the rendered manifests (``kubectl kustomize``), changes
only what differs outside a pod (the repository folder, ports, ``--host``, and the
``pdserve`` executable: this interpreter's ``-m pdserve``), starts it, and talks to it
as the kubelet, Prometheus and the autoscalers would: the probes' paths, the metric
names the HPA / KEDA queries use, SIGTERM and the exit code.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT, copy_models, free_port

yaml = pytest.importorskip("yaml")

K8S = ROOT / "deploy" / "kubernetes"


def _render(path: str) -> list[dict[str, Any]]:
    r = subprocess.run(
        ["kubectl", "kustomize", str(K8S / path)], capture_output=True, text=True, timeout=60
    )
    if r.returncode != 0:
        pytest.skip(f"kubectl kustomize unavailable: {r.stderr[:200]}")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


def _localise(args: list[str], repo: Path) -> tuple[list[str], dict[str, int]]:
    """``args`` with the pod-only values replaced; the new ports by flag."""
    ports = {"--http-port": free_port(), "--grpc-port": free_port(), "--metrics-port": free_port()}
    out = []
    for a in args:
        flag = a.split("=", 1)[0]
        if flag == "--model-repository":
            a = f"{flag}={repo}"
        elif flag == "--host":
            a = f"{flag}=127.0.0.1"
        elif flag in ports:
            a = f"{flag}={ports[flag]}"
        out.append(a)
    return out, {k.strip("-").split("-")[0]: v for k, v in ports.items()}


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait_ready(proc: subprocess.Popen[bytes], http: int, log: Path, path: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text(errors="replace")
        try:
            if _get(f"http://127.0.0.1:{http}{path}")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    pytest.fail("not ready:\n" + log.read_text(errors="replace"))


def _start(cmd: list[str], log: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        cmd,
        stdout=open(log, "wb"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
        cwd=ROOT,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),
    )


def test_deployment_container_runs_and_drains(tmp_path: Path) -> None:
    """The prod Deployment's arguments (after the image's ENTRYPOINT ``pdserve``):
    probes answer on their paths, the metrics the autoscalers query are exported,
    SIGTERM turns readiness off and the process exits 0."""
    docs = _render("overlays/prod-keda")
    (c,) = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"
    ]
    repo = copy_models(tmp_path / "models", "tiny")
    args, ports = _localise(c["args"], repo)
    log = tmp_path / "pdserve.log"
    proc = _start([sys.executable, "-m", "pdserve", *args], log)
    try:
        ready = c["readinessProbe"]["httpGet"]["path"]
        _wait_ready(proc, ports["http"], log, ready)
        for probe in ("startupProbe", "livenessProbe"):
            assert _get(f"http://127.0.0.1:{ports['http']}{c[probe]['httpGet']['path']}")[0] == 200
        # One request, so that every per-model series exists.
        body = json.dumps(
            {
                "inputs": [
                    {"name": "INPUT0", "datatype": "FP32", "shape": [1, 64], "data": [0.5] * 64}
                ]
            }
        ).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{ports['http']}/v2/models/tiny/infer", data=body
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert len(json.loads(r.read())["outputs"][0]["data"]) == 64
        status, text = _get(f"http://127.0.0.1:{ports['metrics']}/metrics")
        assert status == 200
        exported = set(re.findall(r"^([a-z_:]+)(?:\{| )", text.decode(), re.M))
        so = next(d for d in docs if d["kind"] == "ScaledObject")
        queried = {
            n
            for t in so["spec"]["triggers"]
            for n in re.findall(r"\b(nv_[a-z_]+)", t["metadata"]["query"])
        }
        assert queried and queried <= exported, queried - exported
        assert "nv_inference_pending_request_count" in exported
        # SIGTERM (what the kubelet sends after preStop): not ready at once, exit 0.
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        unready = False
        while not unready and time.monotonic() < deadline:
            try:
                unready = _get(f"http://127.0.0.1:{ports['http']}{ready}")[0] != 200
            except OSError:  # already closed
                unready = True
            time.sleep(0.02)
        assert unready
        assert proc.wait(60) == 0, log.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_kserve_transformer_command_ignores_kserve_arguments(tmp_path: Path) -> None:
    """The transformer's ``sh -c 'exec pdserve serve ...' NAME`` with the arguments
    KServe appends to a custom transformer: pdserve runs (as the very process that was
    started: ``exec``), ignores them, and exits 0 on SIGTERM. The init container's
    wait script returns once the predictor's model is ready."""
    docs = _render("kserve")
    isvc = next(d for d in docs if d["metadata"]["name"] == "image-classifier")
    tr = isvc["spec"]["transformer"]
    (c,) = tr["containers"]
    words = shlex.split(c["command"][2])
    assert words[:2] == ["exec", "pdserve"]
    repo = copy_models(tmp_path / "models", "efficientnet_lite0")
    args, ports = _localise(words[2:], repo)
    script = shlex.join(["exec", sys.executable, "-m", "pdserve", *args])
    kserve_args = ["--model_name", "image-classifier", "--predictor_host", "x.ns"]
    kserve_args += ["--http_port", "8080"]
    log = tmp_path / "transformer.log"
    proc = _start([*c["command"][:2], script, c["command"][3], *kserve_args], log)
    try:
        _wait_ready(proc, ports["http"], log, c["readinessProbe"]["httpGet"]["path"])
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"pdserve" in cmdline and b"serve" in cmdline  # sh replaced itself
        assert b"--model_name" not in cmdline
        # The init container's script, pointed at this server, returns at once.
        (wait,) = tr["initContainers"]
        code = wait["command"][2].replace(
            f"http://{isvc['metadata']['name']}-predictor/", f"http://127.0.0.1:{ports['http']}/"
        )
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30)
        assert r.returncode == 0, r.stdout + r.stderr
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
