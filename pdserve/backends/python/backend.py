"""The python backend (``backend: "python"``): Triton python models in worker processes.

A model folder holds ``<version>/model.py`` defining ``TritonPythonModel`` as for
Triton's python backend. pdserve runs one worker process per model instance
(:mod:`~pdserve.backends.python.launch`), so the stages of a pipeline use every core
instead of sharing one GIL; tensors cross through memfd arenas (:mod:`pdserve.shm`).
A ``KIND_GPU`` instance's worker sees only its own GPU (``CUDA_VISIBLE_DEVICES``), and
an instance whose host policy has cores is pinned to them.

Errors: a response's ``pb_utils.TritonError`` fails that request with its code; an
exception out of ``execute`` fails every request of the call; a worker that dies fails
the requests it held with ``INTERNAL`` and is restarted (back-off up to
:data:`MAX_RESTART_DELAY_S`); a requested output the model did not return is
``INTERNAL`` naming the output (datatypes, shapes: OutputCheck and ``output_shapes``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import Backend, ExecRequest, ExecResult, ModelInstance, ModelSpec
from pdserve.backends.devices import check_gpu_ids, cuda_visible_devices_for
from pdserve.backends.host_policy import instance_cores
from pdserve.backends.python.connection import StreamEntry, WorkerConnection
from pdserve.backends.python.messages import (
    Error,
    WorkerInit,
)
from pdserve.core.errors import ErrorCode, InferError, internal, unavailable

log = logging.getLogger("pdserve.python")

#: Seconds a worker may take to import model.py and run ``initialize``.
START_TIMEOUT_S = 600.0
#: Longest wait between two attempts to restart a worker that keeps failing.
MAX_RESTART_DELAY_S = 10.0
#: Seconds ``finalize`` may take in an instance that had started when its model's
#: load was abandoned (the server shuts down while the model loads).
CANCEL_GRACE_S = 2.0


def _model_file(spec: ModelSpec) -> Path:
    return cfgmod.find_model_file(spec.config, spec.version_dir)


def _init_message(
    spec: ModelSpec,
    mode: str,
    instance: str,
    kind: str,
    device: int,
    cores: frozenset[int] | None = None,
) -> WorkerInit:
    return WorkerInit(
        mode=mode,
        model_file=str(_model_file(spec)),
        version_dir=str(spec.version_dir),
        model_dir=str(spec.model_dir),
        model_name=spec.name,
        model_version=spec.version,
        model_config=json.dumps(cfgmod.config_to_json(spec.config)),
        instance_name=instance,
        instance_kind=kind,
        device_id=device,
        cpu_cores=sorted(cores) if cores else None,
        server_pid=os.getpid(),
        cuda_visible_devices=cuda_visible_devices_for(device) if kind == "GPU" else None,
    )


class PythonBackend(Backend):
    """Runs ``model.py`` models (``backend: "python"``) in worker processes.

    Args:
        import_always: auto-complete imports every model in a worker, also one
            without ``auto_complete_config`` (``pdserve check`` proves that each
            imports); the server imports only those that define it, at auto-complete.
        autocomplete_timeout_s: seconds the auto-complete worker may take to import
            the model and answer before it is killed.
    """

    name = cfgmod.PYTHON_BACKEND
    in_process = False

    def __init__(
        self, *, import_always: bool = False, autocomplete_timeout_s: float = START_TIMEOUT_S
    ) -> None:
        self.import_always = import_always
        self.autocomplete_timeout_s = autocomplete_timeout_s

    async def auto_complete(self, spec: ModelSpec) -> None:
        """Run the model's static ``auto_complete_config`` in a worker, if it has one.

        A coroutine (the model code runs in a worker process): the model manager
        awaits what ``Backend.auto_complete`` returns when it is awaitable.

        The worker gets the configuration as Triton's JSON, imports ``model.py``,
        calls ``TritonPythonModel.auto_complete_config(pb_utils.ModelConfig)`` and
        returns the (possibly changed) configuration, which replaces ``spec.config``.

        Raises:
            FileNotFoundError: no ``model.py`` in the version folder.
            pdserve.config.ConfigError: importing the model raised (field
                ``import``, path: the model file), ``auto_complete_config`` raised or
                returned a configuration that does not parse, or the worker died or
                did not answer within :attr:`autocomplete_timeout_s` (field
                ``auto_complete_config``, path: config.pbtxt).
        """
        model_file = _model_file(spec)
        source = model_file.read_text(encoding="utf-8", errors="replace")
        if not self.import_always and "auto_complete_config" not in source:
            return
        where = str(spec.model_dir / cfgmod.CONFIG_FILENAME)
        init = _init_message(spec, "autocomplete", f"{spec.name}_autocomplete", "CPU", 0)
        conn = await WorkerConnection.start(f"{spec.name}_autocomplete", init, spec.server)
        timeout = self.autocomplete_timeout_s
        try:
            answer = await asyncio.wait_for(conn.autocomplete, timeout)
        except RuntimeError as e:
            await conn.stop(5.0)
            raise cfgmod.ConfigError(where, "auto_complete_config", str(e)) from None
        except TimeoutError:
            await conn.kill()  # a hung import does not read "stop"
            raise cfgmod.ConfigError(
                where,
                "auto_complete_config",
                f"the worker importing {model_file} did not answer within {timeout:g} s "
                "(an import or auto_complete_config that hangs?); it was killed",
            ) from None
        except BaseException:  # cancelled (shutdown while loading): no waiting
            await conn.kill()
            raise
        await conn.stop(5.0)
        if answer.error is not None and answer.stage == "import":
            raise cfgmod.ConfigError(model_file, "import", f"importing it raised {answer.error}")
        if answer.error is not None or answer.config is None:
            raise cfgmod.ConfigError(
                where,
                "auto_complete_config",
                f"auto_complete_config of {model_file} raised {answer.error}",
            )
        spec.config.CopyFrom(cfgmod.config_from_json(answer.config, where))

    async def load(self, spec: ModelSpec) -> list[ModelInstance]:
        """Start one worker per instance (``instance_group``), wait for ``initialize``.

        Raises:
            RuntimeError: a worker failed to import the model or ``initialize``
                raised (the message names the instance and the exception), or a
                ``KIND_GPU`` group names a GPU this process cannot see
                (:func:`pdserve.backends.devices.check_gpu_ids`; Triton refuses such a
                group too).
        """
        from tritonclient.grpc import model_config_pb2 as mc

        plans: list[tuple[str, str, int, frozenset[int] | None]] = []
        groups = list(spec.config.instance_group) or [None]
        for gi, group in enumerate(groups):
            count = group.count if group is not None and group.count > 0 else 1
            gname = group.name if group is not None and group.name else f"{spec.name}_{gi}"
            kind = "CPU"
            devices = [0]
            if group is not None:
                kind_name = mc.ModelInstanceGroup.Kind.Name(group.kind)
                if kind_name == "KIND_GPU":
                    kind, devices = "GPU", (list(group.gpus) or [0])
                    check_gpu_ids(gname, devices)
                elif kind_name == "KIND_MODEL":
                    kind = "MODEL"
            n = 0
            for device in devices:
                cores = instance_cores(spec.host_policies, group, device)
                for _ in range(count):
                    plans.append((f"{gname}_{n}", kind, device, cores))
                    n += 1
        instances = [PythonInstance(spec, *plan) for plan in plans]
        try:
            results = await asyncio.gather(*(i.start() for i in instances), return_exceptions=True)
        except asyncio.CancelledError:  # shutdown while loading: starting workers are
            # killed by their own cancelled start; stop the ones already initialized
            await asyncio.gather(
                *(i.abort(CANCEL_GRACE_S) for i in instances), return_exceptions=True
            )
            raise
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await asyncio.gather(*(i.close() for i in instances), return_exceptions=True)
            raise failures[0]
        return list(instances)


class PythonInstance(ModelInstance):
    """One model instance = one worker process (restarted when it dies).

    Args:
        cores: the host policy's CPU ids; each worker (the first and every
            restarted one) is pinned to them. None: not pinned.
    """

    def __init__(
        self,
        spec: ModelSpec,
        name: str,
        kind: str,
        device: int,
        cores: frozenset[int] | None = None,
    ) -> None:
        self.spec = spec
        self.name = name
        self.kind = f"KIND_{kind}"
        #: CPU ids the worker process is pinned to (host policy), or None.
        self.cores = cores
        self._init = _init_message(spec, "serve", name, kind, device, cores)
        self.conn: WorkerConnection | None = None
        self._restarting: asyncio.Task[WorkerConnection] | None = None
        self._closing = False
        self._watch: asyncio.Task[None] | None = None
        self.restarts = 0
        self._retry_delay = 0.05
        self._retry_at = 0.0
        #: the watchdog's back-off: no restart before this ``time.monotonic()``.
        self._hold_until = 0.0
        self._out_types = {o.name: cfgmod.datatype_of(o) for o in spec.config.output}
        for st in spec.config.sequence_batching.state:  # implicit state: the batcher keeps it
            self._out_types[st.output_name] = cfgmod.datatype_of(st)

        self._decoupled = bool(spec.config.model_transaction_policy.decoupled)

    async def start(self) -> None:
        """Start the worker and wait for ``initialize`` to finish.

        Raises:
            RuntimeError: import or ``initialize`` failed, or the worker died.
        """
        self.conn = await self._start_once()

    def worker_pids(self) -> list[int]:
        """The worker process's pid while one runs (empty between a death and its
        restart)."""
        return [self.conn.pid] if self.conn is not None else []

    async def _start_once(self) -> WorkerConnection:
        conn = await WorkerConnection.start(self.name, self._init, self.spec.server, self.cores)
        try:
            await asyncio.wait_for(asyncio.shield(conn.ready), START_TIMEOUT_S)
        except asyncio.CancelledError:  # shutdown while loading: initialize may block
            await conn.kill()
            raise
        except BaseException as e:
            await conn.stop(2.0)
            if isinstance(e, TimeoutError):
                raise RuntimeError(
                    f"python model instance '{self.name}' did not initialize within "
                    f"{START_TIMEOUT_S:.0f} s"
                ) from None
            if isinstance(e, RuntimeError):
                raise RuntimeError(
                    f"failed to initialize python model instance '{self.name}': {e}"
                ) from None
            raise
        self._watch = asyncio.get_running_loop().create_task(self._watch_death(conn))
        return conn

    async def _watch_death(self, conn: WorkerConnection) -> None:
        await conn.died
        if self._closing or conn.stopping or self.conn is not conn:
            return
        self.conn = None
        self._begin_restart()

    def _begin_restart(self) -> asyncio.Task[WorkerConnection]:
        task = asyncio.get_running_loop().create_task(self._restart_once())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # reported by waiters
        self._restarting = task
        return task

    async def _restart_once(self) -> WorkerConnection:
        """One attempt to replace a dead worker.

        Raises:
            Exception: the new worker failed to start (the next request tries again,
                no sooner than the back-off delay).
        """
        hold = self._hold_until - time.monotonic()
        if hold > 0:
            await asyncio.sleep(hold)
        try:
            conn = await self._start_once()
        except Exception as e:
            self._retry_at = time.monotonic() + self._retry_delay
            log.error(
                "restarting %s failed: %s (next attempt in >= %.1f s)",
                self.name,
                e,
                self._retry_delay,
            )
            self._retry_delay = min(self._retry_delay * 2, MAX_RESTART_DELAY_S)
            raise
        if self._closing:
            await conn.stop()
            raise unavailable(f"model instance '{self.name}' is unloading")
        self._retry_delay = 0.05
        self.restarts += 1
        self.conn = conn
        log.info("restarted %s (worker pid %d)", self.name, conn.pid)
        return conn

    def ready(self) -> bool:
        """A worker is running (False between its death or teardown and its restart)."""
        conn = self.conn
        return conn is not None and not conn.died.done()

    def progress(self) -> int:
        """Decoupled responses the current worker sent (the watchdog's progress)."""
        conn = self.conn
        return conn.responses_seen if conn is not None else 0

    async def check_ready(self, timeout_s: float) -> tuple[bool, str] | None:
        """The model's ``is_ready()`` (see :meth:`ModelInstance.check_ready`); a worker
        busy with a batch is not asked (None: the watchdog judges a batch that hangs)."""
        conn = self.conn
        if conn is None or conn.died.done():
            return False, "its worker process is not running"
        if not conn.has_is_ready or conn.batch is not None:
            return None
        return await conn.check_ready(timeout_s)

    def has_ready_hook(self) -> bool:
        """The model defines ``is_ready()``."""
        conn = self.conn
        return conn is not None and conn.has_is_ready

    async def recover(self, delay_s: float, reason: str) -> bool:
        """Kill the worker (SIGKILL: a stopped or deadlocked one too), reap it, and
        start a new one no sooner than ``delay_s`` s from now.

        Returns:
            True once the new worker has initialized; False while unloading.

        Raises:
            InferError(UNAVAILABLE): the new worker failed to start (the next request
                tries again, with the restart back-off).
        """
        if self._closing:
            return False
        self._hold_until = time.monotonic() + delay_s
        conn = self.conn
        if conn is not None:
            log.error("killing worker pid %d of %s: %s", conn.pid, self.name, reason)
            conn.kill_wedged()
            await asyncio.shield(conn.died)
            await asyncio.sleep(0)  # _watch_death begins the restart
        await self._connection()
        return not self._closing

    async def _connection(self) -> WorkerConnection:
        """The live worker, waiting for a restart in progress (or starting one).

        Raises:
            InferError(UNAVAILABLE): unloading, or the worker could not be restarted.
        """
        conn = self.conn
        if conn is not None and not conn.died.done():
            return conn
        if self._closing:
            raise unavailable(f"model instance '{self.name}' is unloading")
        self.conn = None
        task = self._restarting
        failed = task is not None and task.done() and (task.cancelled() or task.exception())
        if task is None or (failed and time.monotonic() >= self._retry_at):
            task = self._begin_restart()
        try:
            return await asyncio.shield(task)
        except InferError as e:
            raise e.fresh() from None
        except Exception as e:
            raise unavailable(
                f"python model instance '{self.name}' is unavailable: its worker process "
                f"died and could not be restarted: {e}"
            ) from None
        finally:
            task = None  # no task -> error -> frame cycle

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        """Run ``batch`` in the worker: one ``execute(requests)`` call, one result each."""
        if self._decoupled:
            return await self._execute_decoupled(batch)
        conn = await self._connection()
        result = await conn.run_batch(batch)
        if result.error is not None or result.responses is None:
            error = result.error or Error("the worker sent no responses", ErrorCode.INTERNAL.value)
            error_code = ErrorCode.from_triton(error.code)
            return [InferError(error.message, error_code, reason="BACKEND") for _ in batch]
        out: list[ExecResult] = []
        for request, response in zip(batch, result.responses, strict=True):
            if isinstance(response, Error):
                out.append(
                    InferError(
                        response.message, ErrorCode.from_triton(response.code), reason="BACKEND"
                    )
                )
                continue
            outputs = conn.read_outputs(response)
            out.append(self._check_outputs(request, outputs))
        return out

    async def _execute_decoupled(self, batch: list[ExecRequest]) -> list[ExecResult]:
        """A decoupled model's batch: the responses go into each request's
        ``request.stream`` as the worker sends them; returns once ``execute`` returned
        (the instance is free again), with an empty result per request.

        Raises:
            InferError(INTERNAL): a request without a stream (the core refuses those).
        """
        streams: list[StreamEntry] = []
        for r in batch:
            stream = r.request.stream
            if stream is None:
                raise internal("a request to a decoupled model needs a response stream")
            streams.append((stream, self._check_names))
        conn = await self._connection()
        result = await conn.run_batch(batch, streams)
        if result.error is not None:  # not sent by a live worker; kept for safety
            error = InferError(
                result.error.message, ErrorCode.from_triton(result.error.code), reason="BACKEND"
            )
            for stream, _ in streams:
                stream.fail(error.fresh())
        for r in batch:
            r.output_names = []  # the responses were checked one by one, in the stream
        return [{} for _ in batch]

    def _check_names(self, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray] | InferError:
        """Outputs of one streamed response must be declared (the core checks that the
        requested ones are there, their datatypes and shapes)."""
        for name in outputs:
            if name not in self._out_types:
                return internal(
                    f"python model '{self.spec.name}' returned output '{name}', which its "
                    f"model configuration does not declare"
                )
        return outputs

    def _check_outputs(
        self, request: ExecRequest, outputs: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray] | InferError:
        model = self.spec.name
        for name in request.output_names:
            if name not in outputs:
                return internal(
                    f"python model '{model}' did not return requested output '{name}' "
                    f"(it returned {sorted(outputs) or 'none'})"
                )
        for name in outputs:
            if name not in self._out_types:
                return internal(
                    f"python model '{model}' returned output '{name}', which its model "
                    f"configuration does not declare"
                )
        # datatypes, rows and dims: the scheduler's output check (pdserve.scheduling.base.OutputCheck)
        return {name: outputs[name] for name in request.output_names}

    async def abort(self, grace: float) -> None:
        """Stop the worker now: ``finalize`` if it answers within ``grace`` s, else SIGKILL.

        A batch still running in it fails with ``UNAVAILABLE`` (the worker is not restarted).
        """
        self._closing = True
        if self._restarting is not None:
            self._restarting.cancel()
        conn, self.conn = self.conn, None
        if conn is not None:
            await conn.stop(grace)

    async def close(self) -> None:
        """Stop the worker (``finalize`` runs) and release its shared memory."""
        self._closing = True
        if self._restarting is not None:
            self._restarting.cancel()
            with contextlib.suppress(BaseException):
                await self._restarting
        conn, self.conn = self.conn, None
        if conn is not None:
            await conn.stop()
        if self._watch is not None:
            self._watch.cancel()
