"""The server ``pdserve analyze`` measures: its own ``pdserve serve`` on a copy of
the repository, or a running one; and the repository API that loads each
configuration.

Loads use Triton's model repository extension (``POST
/v2/repository/models/{m}/load`` with ``{"parameters": {"config": "<json>"}}``):
the JSON configuration replaces ``config.pbtxt`` for that load, the files on disk
are not changed. The server must be in explicit model control mode
(``--model-control-mode explicit``), as model_analyzer requires of Triton.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pdserve
from pdserve import config as cfgmod
from pdserve.app.analyze.space import ensemble_steps, is_ensemble
from pdserve.config import ModelConfig


class AnalyzeError(Exception):
    """``pdserve analyze`` cannot go on: the message is for the user as it is."""


def split_url(url: str) -> tuple[str, int]:
    """``host:port`` or ``http://host:port`` -> (host, port); port 80 when absent.

    Raises:
        AnalyzeError: not an address.
    """
    text = url if "://" in url else f"http://{url}"
    parsed = urllib.parse.urlsplit(text)
    if parsed.scheme != "http" or not parsed.hostname:
        raise AnalyzeError(f"'{url}' is not an HTTP address host:port")
    try:
        return parsed.hostname, parsed.port or 80
    except ValueError:
        raise AnalyzeError(f"'{url}': bad port") from None


class RepositoryClient:
    """The few V2 HTTP calls ``analyze`` needs (health, configuration, repository
    load/unload/index), one connection per call, each bounded by ``timeout``."""

    def __init__(self, url: str, timeout: float = 120.0) -> None:
        self.host, self.port = split_url(url)
        self.timeout = timeout

    @property
    def url(self) -> str:
        """``host:port``."""
        return f"{self.host}:{self.port}"

    def request(
        self, method: str, path: str, body: object = None, timeout: float | None = None
    ) -> tuple[int, Any]:
        """(status, decoded JSON body or None).

        Raises:
            AnalyzeError: the server cannot be reached or does not answer in time.
        """
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise AnalyzeError(f"server {self.url}: {method} {path}: {e}") from None
        finally:
            conn.close()
        try:
            doc = json.loads(raw) if raw else None
        except ValueError:
            doc = raw.decode(errors="replace")
        return resp.status, doc

    @staticmethod
    def _error(doc: object) -> str:
        if isinstance(doc, dict) and "error" in doc:
            return str(doc["error"])
        return str(doc)

    def ready(self) -> bool:
        """``GET /v2/health/ready`` answers 200 (False when unreachable)."""
        try:
            return self.request("GET", "/v2/health/ready", timeout=2.0)[0] == 200
        except AnalyzeError:
            return False

    def config(self, model: str) -> dict[str, object]:
        """The served configuration of ``model`` (``GET /v2/models/{m}/config``).

        Raises:
            AnalyzeError: not loaded, or the server fails.
        """
        status, doc = self.request("GET", f"/v2/models/{model}/config")
        if status != 200 or not isinstance(doc, dict):
            raise AnalyzeError(f"cannot read the configuration of '{model}': {self._error(doc)}")
        return doc

    def is_ready(self, model: str) -> bool:
        """``GET /v2/models/{m}/ready`` answers 200."""
        return self.request("GET", f"/v2/models/{model}/ready")[0] == 200

    def load(self, model: str, config: dict[str, object] | None = None) -> None:
        """Load ``model``, with ``config`` replacing its ``config.pbtxt`` when given.

        Raises:
            AnalyzeError: the server refused (its message), e.g. not in explicit
                model control mode, or the configuration does not load.
        """
        body: dict[str, object] = {}
        if config is not None:
            body = {"parameters": {"config": json.dumps(config)}}
        status, doc = self.request("POST", f"/v2/repository/models/{model}/load", body)
        if status != 200:
            raise AnalyzeError(self._error(doc))

    def unload(self, model: str) -> None:
        """Unload ``model`` (nothing when it is not loaded).

        Raises:
            AnalyzeError: the server refused for another reason.
        """
        status, doc = self.request("POST", f"/v2/repository/models/{model}/unload", {})
        if status != 200 and "not loaded" not in self._error(doc):
            raise AnalyzeError(f"cannot unload '{model}': {self._error(doc)}")

    def index(self) -> list[dict[str, object]]:
        """The repository index (``POST /v2/repository/index``)."""
        status, doc = self.request("POST", "/v2/repository/index", {})
        if status != 200 or not isinstance(doc, list):
            raise AnalyzeError(f"cannot read the repository index: {self._error(doc)}")
        return doc

    def wait_settled(self, models: Sequence[str], timeout: float = 60.0) -> None:
        """Wait until no version of ``models`` is loading or unloading (an unload
        drains in the background), at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        busy = {"LOADING", "UNLOADING"}
        while time.monotonic() < deadline:
            rows = self.index()
            if not any(r.get("name") in models and r.get("state") in busy for r in rows):
                return
            time.sleep(0.1)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def parse_cpus(text: str) -> list[int]:
    """``0-3,5`` (taskset's list syntax) -> [0, 1, 2, 3, 5].

    Raises:
        ValueError: not a CPU list, or a CPU this machine does not have.
    """
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                cpus.update(range(lo, hi + 1))
            else:
                cpus.add(int(part))
        except ValueError:
            raise ValueError(f"'{text}' is not a CPU list such as 0-3,5") from None
    have = os.cpu_count() or 1
    bad = [c for c in cpus if c < 0 or c >= have]
    if bad:
        raise ValueError(f"'{text}': this machine has CPUs 0-{have - 1}")
    return sorted(cpus)


def models_needed(repo: Path, model: str) -> tuple[list[str], list[str]]:
    """(every model ``model`` needs, loaded in that order; the steps to tune) from
    the configuration files: a plain model is ``([model], [model])``; an ensemble
    gives its steps' models (nested ensembles followed), then itself, and its
    non-ensemble steps.

    Raises:
        AnalyzeError: a model is not in ``repo``, its configuration does not parse,
            or ensembles step into each other in a cycle.
    """

    def config_of(name: str) -> ModelConfig:
        folder = repo / name
        if not folder.is_dir():
            raise AnalyzeError(f"no model '{name}' in {repo}")
        try:
            return cfgmod.load_model_config(folder)
        except cfgmod.ConfigError as e:
            raise AnalyzeError(str(e)) from None

    return walk_models(model, config_of)


def walk_models(model: str, config_of: Callable[[str], ModelConfig]) -> tuple[list[str], list[str]]:
    """(every model ``model`` needs, each after the steps it uses; the models that
    are not ensembles), following ensemble steps depth first; ``config_of(name)``
    gives a model's configuration.

    Raises:
        AnalyzeError: ensembles step into each other in a cycle (or ``config_of``
            failed).
    """
    order: list[str] = []
    leaves: list[str] = []

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in chain:
            raise AnalyzeError(f"ensemble cycle: {' -> '.join((*chain, name))}")
        if name in order:
            return
        cfg = config_of(name)
        if is_ensemble(cfg):
            for step in ensemble_steps(cfg):
                visit(step, (*chain, name))
        elif name not in leaves:
            leaves.append(name)
        order.append(name)

    visit(model, ())
    return order, leaves


def copy_repository(src: Path, models: Sequence[str], dst: Path) -> Path:
    """Copy the folders of ``models`` from repository ``src`` into a new
    repository ``dst`` (symbolic links kept as links)."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in models:
        shutil.copytree(src / name, dst / name, symlinks=True)
    return dst


class OwnServer:
    """A ``pdserve serve`` child process in explicit model control mode with no
    model loaded, on free loopback ports; gRPC only when asked, no metrics.

    ``cpus``: the server (and the worker processes it starts) runs on these CPUs
    only, as under ``taskset -c``.
    """

    def __init__(
        self,
        repository: Path,
        log_path: Path,
        *,
        cpus: Sequence[int] | None = None,
        grpc: bool = False,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.repository = repository
        self.log_path = log_path
        self.cpus = list(cpus) if cpus else None
        self.grpc = grpc
        self.extra_args = list(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self.http_port = 0
        self.grpc_port = 0

    @property
    def pid(self) -> int:
        """The server's process id (0 when not started)."""
        return self.proc.pid if self.proc is not None else 0

    @property
    def http_url(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        """``127.0.0.1:PORT``."""
        return f"127.0.0.1:{self.grpc_port}"

    def command(self) -> list[str]:
        """The ``pdserve serve`` command line."""
        cmd = [
            sys.executable,
            "-m",
            "pdserve",
            "serve",
            "--model-repository",
            str(self.repository),
            "--host",
            "127.0.0.1",
            "--http-port",
            str(self.http_port),
            "--model-control-mode",
            "explicit",
            "--no-allow-metrics",
        ]
        if self.grpc:
            cmd += ["--grpc-port", str(self.grpc_port)]
        else:
            cmd.append("--no-allow-grpc")
        return cmd + self.extra_args

    def start(self, timeout: float = 120.0) -> None:
        """Start it and wait until ``/v2/health/ready`` answers.

        Raises:
            AnalyzeError: it exited or was not ready in time (the end of its log
                is in the message).
        """
        for attempt in range(2):  # a port taken between choosing and binding: once more
            self.http_port = free_port()
            self.grpc_port = free_port() if self.grpc else 0
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            root = str(Path(pdserve.__file__).resolve().parents[1])
            env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
            with open(self.log_path, "ab") as log:
                log.write(f"\n===== {' '.join(self.command())}\n".encode())
                log.flush()
                self.proc = subprocess.Popen(
                    self.command(),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    preexec_fn=self._pin if self.cpus else None,
                )
            client = RepositoryClient(self.http_url)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    break
                if client.ready():
                    return
                time.sleep(0.05)
            code = self.proc.poll()
            self.stop()
            if code is None or attempt == 1 or "address already in use" not in self.log_tail():
                what = f"exited with code {code}" if code is not None else "was not ready"
                raise AnalyzeError(
                    f"pdserve serve {what} (log {self.log_path}):\n{self.log_tail()}"
                )

    def _pin(self) -> None:
        """In the child, before ``exec``: run on :attr:`cpus` only (``taskset -c``)."""
        if self.cpus:
            os.sched_setaffinity(0, self.cpus)

    def log_tail(self, lines: int = 15) -> str:
        """The end of the server's log."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; waits for the exit."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
