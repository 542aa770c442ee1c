"""pdserve.backends.onnxruntime.backend: where a session runs under ``execution_thread``
``auto`` (inline on the event loop, or on the instance's thread)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.backends.base import (
    INLINE_STICKY_LIMIT_S,
    INLINE_STICKY_RUNS,
    INLINE_WARMUP_RUNS,
    ExecRequest,
    ModelSpec,
)
from pdserve.backends.onnxruntime.backend import OnnxRuntimeInstance
from pdserve.core.types import InferRequest


def _work(seconds: float) -> None:
    """``seconds`` of a session's work, as ORT's pool threads do it: the instance's thread
    waits (no CPU time of its own); inline, the process computes (this thread, here)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        time.sleep(seconds)
        return
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class _Session:
    """A stand-in ORT session: Y = X, each run working ``delays`` seconds in turn
    (then ``after``; :func:`_work`), and remembering on which thread it ran."""

    def __init__(self, delays: list[float], after: float = 0.0) -> None:
        self.delays = list(delays)
        self.after = after
        self.threads: list[str] = []
        #: the instance's mode when each run started (set ``inst`` to record it)
        self.modes: list[str | None] = []
        self.inst: OnnxRuntimeInstance | None = None

    def get_inputs(self) -> list[Any]:
        return [SimpleNamespace(name="X", type="tensor(float)")]

    def get_outputs(self) -> list[Any]:
        return [SimpleNamespace(name="Y", type="tensor(float)")]

    def run(self, names: list[str], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        import threading

        self.threads.append(threading.current_thread().name)
        self.modes.append(self.inst.runs.mode if self.inst is not None else None)
        delay = self.delays.pop(0) if self.delays else self.after
        if delay:
            _work(delay)
        return [feeds["X"]]


def _instance(tmp_path: Path, session: _Session) -> OnnxRuntimeInstance:
    cfg = text_format.Parse(
        'name: "m" max_batch_size: 4 '
        'input [ { name: "X" data_type: TYPE_FP32 dims: [ 2 ] } ] '
        'output [ { name: "Y" data_type: TYPE_FP32 dims: [ 2 ] } ]',
        model_config_pb2.ModelConfig(),
    )
    spec = ModelSpec("m", 1, cfg, tmp_path, tmp_path / "1", tmp_path)
    return OnnxRuntimeInstance("m_0", "KIND_CPU", session, spec)


def _run(inst: OnnxRuntimeInstance, n: int) -> None:
    async def go() -> None:
        for i in range(n):
            x = np.full((1, 2), i, np.float32)
            req = ExecRequest({"X": x}, ["Y"], InferRequest("m"), 1)
            (out,) = await inst.execute([req])
            assert isinstance(out, dict) and out["Y"].tolist() == [[i, i]]

    asyncio.run(go())


def test_one_long_inline_run_does_not_move_the_instance_for_good(tmp_path: Path) -> None:
    """A single inline run over the limit (e.g. the process was preempted) sends the
    instance to its thread only while its average is high; it comes back inline."""
    long = INLINE_STICKY_LIMIT_S * 2
    # 1st run on the thread (no average yet), then inline; one long inline run
    session = _Session([0.0, 0.0, 0.0, long])
    inst = _instance(tmp_path, session)
    try:
        _run(inst, 80)
        assert inst.runs.mode == "auto"
        assert session.threads[1] == "MainThread" and session.threads[3] == "MainThread"
        assert session.threads[4].startswith("m_0")  # the average moved it for a while
        assert session.threads[-1] == "MainThread"  # and back inline
    finally:
        asyncio.run(inst.close())


def test_mostly_long_inline_runs_move_the_instance_for_good(tmp_path: Path) -> None:
    long = INLINE_STICKY_LIMIT_S * 2
    session = _Session([0.0, 0.0], after=long)  # a model that turned slow
    inst = _instance(tmp_path, session)
    session.inst = inst
    try:
        _run(inst, 60)
        assert inst.runs.mode == "thread"
        # the first INLINE_WARMUP_RUNS runs never count toward the rule
        assert session.threads[INLINE_WARMUP_RUNS:].count("MainThread") == INLINE_STICKY_RUNS
        # from the switch on, every run is on the instance's thread (where the switch
        # falls depends on the machine's load: a preempted fast run moves the average)
        moved = session.modes.index("thread") if "thread" in session.modes else 60
        assert all(t.startswith("m_0") for t in session.threads[moved:]), session.threads
        assert "thread" not in session.modes[:moved]
    finally:
        asyncio.run(inst.close())
