"""The ``remote`` backend: service-level PD separation (``backend: "remote"``).

A remote model's instances run nothing themselves: each batch is sent, as one V2
inference request, to a model on another V2 server (pdserve, Triton, KServe,
MLServer) and the answer is split back per request. It has its own queue, batching and
statistics and can be an ensemble step, so a pipeline can run its CPU steps in one
server (KServe's *transformer*) and its model in another (the *predictor*).
Parameters: :class:`RemoteParams`.

At load the target's configuration is fetched and checked against the local one
(:func:`check_against_remote`), completing a local one without inputs/outputs. A
health probe per loaded version asks the target ``ModelReady``; while the target is
not ready, requests fail at once with UNAVAILABLE. Counters per target:
:mod:`pdserve.backends.remote.stats`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pdserve import config as cfgmod
from pdserve.backends.base import (
    Backend,
    ExecRequest,
    ExecResult,
    ModelInstance,
    ModelSpec,
    merge_batch,
    split_batch,
    wanted_outputs,
)
from pdserve.backends.remote.client import (
    Endpoint,
    ModelMetadata,
    RemoteClient,
    RemoteError,
    make_client,
)
from pdserve.backends.remote.stats import TargetStats, stats_for
from pdserve.core import tracing
from pdserve.core.datatypes import CONFIG_TO_V2, V2_TO_CONFIG
from pdserve.core.errors import InferError, unavailable

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2

log = logging.getLogger("pdserve.remote")

#: The backend name in config.pbtxt.
REMOTE_BACKEND = cfgmod.REMOTE_BACKEND


@dataclass(frozen=True)
class RemoteParams:
    """The remote model's ``parameters``, checked.

    Configuration ``parameters`` (string values):

    ==========================  ==================================================================
    ``url``                     the target, ``host:port`` (required); ``grpc://host:port`` or
                                ``http://host:port`` also set the protocol
    ``protocol``                ``grpc`` (default) or ``http`` (V2 REST with the binary extension)
    ``model_name``              the model on the target (default: this model's name)
    ``model_version``           the version on the target (default: the target's default)
    ``timeout_ms``              deadline of one call to the target (default 30000)
    ``connect_timeout_ms``      longest wait for a connection and for a health probe (default 1000)
    ``retries``                 how often a call is repeated after the target refused it with
                                UNAVAILABLE / 503 or could not be connected to (default 2;
                                0 turns it off). Inference is taken to be idempotent; a call
                                that timed out or broke after it reached the target is never
                                repeated
    ``retry_backoff_ms``        wait before a repeat, doubled each time (default 50)
    ``pool_size``               gRPC channels (each its own TCP connection, calls multiplexed)
                                or HTTP keep-alive connections (default 4)
    ``health_interval_ms``      period of the readiness probe (default 1000)
    ``load_wait_ms``            at load, how long to wait for the target's model to answer
                                ready (default 10000)
    ==========================  ==================================================================
    """

    address: str
    protocol: str
    model_name: str
    model_version: str
    timeout_s: float
    connect_timeout_s: float
    retries: int
    retry_backoff_s: float
    pool_size: int
    health_interval_s: float
    load_wait_s: float

    @property
    def target(self) -> str:
        """``protocol://host:port``: how metrics and messages name the target."""
        return f"{self.protocol}://{self.address}"

    def endpoint(self) -> Endpoint:
        """The client's view of these parameters."""
        return Endpoint(
            self.address,
            self.protocol,
            self.model_name,
            self.model_version,
            self.pool_size,
            self.connect_timeout_s,
        )


def parse_params(cfg: model_config_pb2.ModelConfig, where: str) -> RemoteParams:
    """Read and check a remote model's ``parameters``.

    Raises:
        pdserve.config.ConfigError: ``url`` missing or not ``host:port``, an unknown
            ``protocol``, a number that is not a number or out of range (the field
            is ``parameters.<key>``).
    """

    def get(key: str, default: str = "") -> str:
        return (cfgmod.get_parameter(cfg, key) or default).strip()

    def number(key: str, default: float, minimum: float) -> float:
        raw = get(key)
        if not raw:
            return default
        try:
            value = float(raw)
        except ValueError:
            raise cfgmod.ConfigError(
                where, f"parameters.{key}", f"'{raw}' is not a number"
            ) from None
        if value < minimum:
            raise cfgmod.ConfigError(
                where, f"parameters.{key}", f"must be at least {minimum:g}, got {raw}"
            )
        return value

    url = get("url")
    if not url:
        raise cfgmod.ConfigError(
            where,
            "parameters.url",
            'a remote model needs the target\'s address: parameters { key: "url" '
            'value { string_value: "host:port" } }',
        )
    protocol = get("protocol").lower()
    for scheme in ("grpc", "http"):
        if url.startswith(scheme + "://"):
            url = url[len(scheme) + 3 :].rstrip("/")
            if protocol and protocol != scheme:
                raise cfgmod.ConfigError(
                    where,
                    "parameters.protocol",
                    f"'{protocol}' disagrees with the url's scheme '{scheme}'",
                )
            protocol = scheme
    protocol = protocol or "grpc"
    if protocol not in ("grpc", "http"):
        raise cfgmod.ConfigError(
            where, "parameters.protocol", f"'{protocol}' is not one of grpc, http"
        )
    host, _, port = url.rpartition(":")
    if not host or not port.isdigit() or "/" in url:
        raise cfgmod.ConfigError(where, "parameters.url", f"'{url}' is not host:port")
    version = get("model_version")
    if version and not version.isdigit():
        raise cfgmod.ConfigError(
            where, "parameters.model_version", f"'{version}' is not a version number"
        )
    return RemoteParams(
        address=url,
        protocol=protocol,
        model_name=get("model_name") or cfg.name,
        model_version=version,
        timeout_s=number("timeout_ms", 30000, 1) / 1000,
        connect_timeout_s=number("connect_timeout_ms", 1000, 1) / 1000,
        retries=int(number("retries", 2, 0)),
        retry_backoff_s=number("retry_backoff_ms", 50, 0) / 1000,
        pool_size=int(number("pool_size", 4, 1)),
        health_interval_s=number("health_interval_ms", 1000, 10) / 1000,
        load_wait_s=number("load_wait_ms", 10000, 0) / 1000,
    )


# --------------------------------------------------------------------------- config check


def _dims(io: model_config_pb2.ModelInput | model_config_pb2.ModelOutput) -> list[int]:
    return [int(d) for d in io.dims]


def config_from_metadata(
    meta: ModelMetadata, local: model_config_pb2.ModelConfig
) -> model_config_pb2.ModelConfig:
    """A configuration built from V2 model metadata (targets without Triton's config
    endpoint). Metadata has no ``max_batch_size``: the local one is taken, and when
    it batches the first dim of each shape (the batch dim, ``-1``) is dropped."""
    from tritonclient.grpc import model_config_pb2 as mc

    cfg = mc.ModelConfig(name=str(meta.get("name", "")), max_batch_size=local.max_batch_size)
    skip = 1 if local.max_batch_size > 0 else 0
    for tensors, target in (
        (meta.get("inputs", []), cfg.input),
        (meta.get("outputs", []), cfg.output),
    ):
        for t in tensors:
            io = target.add()
            io.name = t["name"]
            io.data_type = mc.DataType.Value(V2_TO_CONFIG.get(t["datatype"], "TYPE_INVALID"))
            io.dims.extend(int(d) for d in list(t["shape"])[skip:])
    return cfg


def check_against_remote(
    local: model_config_pb2.ModelConfig,
    remote: model_config_pb2.ModelConfig,
    where: str,
    target: str,
) -> None:
    """Complete ``local`` from ``remote`` where it says nothing, then check they agree.

    Completion (in place): no ``input`` -> the target's inputs; no ``output`` -> its
    outputs (without ``label_filename``, a file of the target's model folder); both
    missing and ``max_batch_size`` 0 -> the target's ``max_batch_size``.

    Checks, each error naming the local field:

    - ``max_batch_size``: batching on both sides or neither, and not more than the
      target's (the local scheduler's batch is sent as one request);
    - every local input/output exists on the target, with the same ``data_type`` and
      the same dims (a target dim of ``-1`` accepts any local dim);
    - every input the target requires (not ``optional``) is a local input.

    Raises:
        pdserve.config.ConfigError: the first disagreement.
    """
    fill_inputs = len(local.input) == 0
    fill_outputs = len(local.output) == 0
    if fill_inputs and fill_outputs and local.max_batch_size == 0:
        local.max_batch_size = remote.max_batch_size
    if fill_inputs:
        local.input.extend(remote.input)
    if fill_outputs:
        for o in remote.output:
            added = local.output.add()
            added.CopyFrom(o)
            added.label_filename = ""
    at = f"the target {target}'s model '{remote.name}'" if remote.name else f"the target {target}"
    lmbs, rmbs = local.max_batch_size, remote.max_batch_size
    if (lmbs > 0) != (rmbs > 0) or lmbs > rmbs:
        raise cfgmod.ConfigError(
            where,
            "max_batch_size",
            f"{lmbs} does not fit {at}, whose max_batch_size is {rmbs} (both must batch or "
            "neither, and the local one may not be larger)",
        )
    for kind, mine, theirs in (
        ("input", local.input, remote.input),
        ("output", local.output, remote.output),
    ):
        by_name = {io.name: io for io in theirs}
        for i, io in enumerate(mine):
            other = by_name.get(io.name)
            if other is None:
                raise cfgmod.ConfigError(
                    where,
                    f"{kind}[{i}].name",
                    f"{kind} '{io.name}' is not one of {at}'s {kind}s "
                    f"({cfgmod.quoted_names(by_name)})",
                )
            if io.data_type != other.data_type:
                ldt = CONFIG_TO_V2.get(_type_name(io.data_type), str(io.data_type))
                rdt = CONFIG_TO_V2.get(_type_name(other.data_type), str(other.data_type))
                raise cfgmod.ConfigError(
                    where,
                    f"{kind}[{i}].data_type",
                    f"{kind} '{io.name}' is {ldt} here but {rdt} on {at}",
                )
            ld, rd = _dims(io), _dims(other)
            if len(ld) != len(rd) or any(r != -1 and r != d for d, r in zip(ld, rd, strict=False)):
                raise cfgmod.ConfigError(
                    where,
                    f"{kind}[{i}].dims",
                    f"{kind} '{io.name}' has dims {ld} here but {rd} on {at}",
                )
    local_inputs = {io.name for io in local.input}
    for io in remote.input:
        if not io.optional and io.name not in local_inputs:
            raise cfgmod.ConfigError(
                where, "input", f"{at} requires input '{io.name}', which is not configured here"
            )


def _type_name(value: int) -> str:
    from tritonclient.grpc import model_config_pb2 as mc

    try:
        return str(mc.DataType.Name(value))
    except ValueError:
        return str(value)


# --------------------------------------------------------------------------- target


class RemoteTarget:
    """One model version's connection pool to its target, its health probe and counters.

    Shared by the version's instances; closed when the last one closes.
    """

    def __init__(
        self, params: RemoteParams, model: str, client: RemoteClient | None = None
    ) -> None:
        self.params = params
        self.model = model
        self.client = client or make_client(params.endpoint())
        self.stats: TargetStats = stats_for(params.target, model, params.protocol)
        self.stats.up = True
        #: why the target is down ("" while up).
        self.down_reason = ""
        self._wake = asyncio.Event()
        self._probe: asyncio.Task[None] | None = None
        self._users = 0

    def start(self) -> None:
        """Start the health probe (on the running loop)."""
        if self._probe is None:
            self._probe = asyncio.get_running_loop().create_task(
                self._probe_loop(), name=f"remote-probe-{self.model}"
            )

    @property
    def up(self) -> bool:
        """The last probe or call found the target's model ready."""
        return self.stats.up

    def mark_down(self, reason: str) -> None:
        """Fail requests fast from now until a probe finds the target ready again."""
        if self.stats.up:
            log.warning("remote model '%s': target %s is down: %s", self.model, self.params.target, reason)  # fmt: skip
        self.stats.up = False
        self.down_reason = reason
        self._wake.set()

    async def _probe_loop(self) -> None:
        p = self.params
        probe_timeout = max(p.connect_timeout_s, 0.05)
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), p.health_interval_s)
            except TimeoutError:
                pass
            self._wake.clear()
            ok, reason = await self.client.ready(probe_timeout)
            if ok and not self.stats.up:
                log.warning("remote model '%s': target %s is ready again", self.model, p.target)
                self.stats.up = True
                self.down_reason = ""
            elif not ok and self.stats.up:
                self.mark_down(reason)
                self._wake.clear()
            elif not ok:
                self.down_reason = reason

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        request_id: str,
        traceparent: str = "",
    ) -> dict[str, np.ndarray]:
        """Send one request, repeating it (``retries``) after a refusal or a failed
        connection, never past ``timeout_ms`` in all; ``traceparent`` (the call's
        span) goes with each attempt.

        Raises:
            InferError: UNAVAILABLE at once while the target is down; else the last
                failure, with the code the target's status maps to.
        """
        p = self.params
        st = self.stats
        if not st.up:
            raise unavailable(
                f"remote model '{self.model}': target {p.target} is not ready "
                f"({self.down_reason or 'health probe failed'}); requests fail until it "
                "answers ready again"
            )
        deadline = time.monotonic() + p.timeout_s
        backoff = p.retry_backoff_s
        attempt = 0
        while True:
            left = deadline - time.monotonic()
            start = time.perf_counter()
            st.requests += 1
            try:
                result = await self.client.infer(
                    inputs, outputs, request_id, max(left, 0.001), traceparent
                )
            except RemoteError as e:
                if e.answered:
                    st.observe(time.perf_counter() - start)
                st.error(e.code.name)
                if not e.answered and e.retryable:
                    self.mark_down(e.message)
                if e.retryable and attempt < p.retries and deadline - time.monotonic() > backoff:
                    attempt += 1
                    st.retries += 1
                    await asyncio.sleep(backoff)
                    backoff *= 2
                    continue
                raise InferError(e.message, e.code, e.reason) from None
            except InferError as e:  # an answer pdserve cannot use
                st.observe(time.perf_counter() - start)
                st.error(e.code.name)
                raise
            st.observe(time.perf_counter() - start)
            if not st.up:  # a retry got through: the target is back
                st.up = True
                self.down_reason = ""
            return result

    def acquire(self) -> None:
        """One more instance uses this target."""
        self._users += 1

    async def release(self) -> None:
        """An instance is done; the last one stops the probe and closes the pool."""
        self._users -= 1
        if self._users > 0:
            return
        if self._probe is not None:
            self._probe.cancel()
            try:
                await self._probe
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - closing
                pass
            self._probe = None
        self.stats.up = False  # unloaded: pdserve_remote_up says 0, not a stale 1
        await self.client.close()


# --------------------------------------------------------------------------- backend


class RemoteInstance(ModelInstance):
    """One slot for a batch in flight to the target (instances share one
    :class:`RemoteTarget`)."""

    kind = "KIND_CPU"

    def __init__(self, name: str, target: RemoteTarget, model: str) -> None:
        self.name = name
        self.target = target
        self.model = model
        target.acquire()

    def ready(self) -> bool:
        """Ready only while the target's model is (see the module doc)."""
        return self.target.up

    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        """Merge the batch into one request, send it, split the answer per request.

        Raises:
            InferError: what :meth:`RemoteTarget.infer` raised, for the whole batch
                (the target answers one request for all of it).
        """
        inputs = merge_batch(batch)
        wanted = wanted_outputs(batch)
        request_id = batch[0].request.id if len(batch) == 1 else ""
        marks = tracing.current_marks()
        if marks is None or not marks.infer_spans:
            outputs = await self.target.infer(inputs, wanted, request_id)
            return split_batch(batch, outputs)
        # a traced request: the call is a span under its compute_infer, and the target's
        # spans are that span's children (its traceparent goes with the call)
        traced = next(marks.infer_spans[id(r)] for r in batch if id(r) in marks.infer_spans)
        ref, infer_id = traced
        span_id = tracing.new_span_id()
        start = time.monotonic_ns()
        try:
            outputs = await self.target.infer(
                inputs, wanted, request_id, ref.trace.traceparent(span_id)
            )
        finally:
            attrs = {"pdserve.remote_target": self.target.params.target}
            ref.trace.add("remote_infer", infer_id, start, time.monotonic_ns(), attrs, span_id)
        return split_batch(batch, outputs)

    async def close(self) -> None:
        """Release the shared target (the last instance closes its connections)."""
        await self.target.release()


class RemoteBackend(Backend):
    """Loads ``backend: "remote"`` models: no model file, a target V2 server."""

    name = REMOTE_BACKEND

    def usable_gpus(self) -> list[int]:
        """None: instances run no model here (``KIND_AUTO`` becomes ``KIND_CPU``)."""
        return []

    async def auto_complete(self, spec: ModelSpec) -> None:
        """Wait (``load_wait_ms``) for the target's model to answer ready, fetch its
        configuration (or metadata) and complete/check the local one
        (:func:`check_against_remote`).

        Raises:
            pdserve.config.ConfigError: bad parameters, the target never answered
                ready (field ``parameters.url``), or a disagreement (naming the field).
        """
        where = f"{spec.name}/{cfgmod.CONFIG_FILENAME}"
        params = parse_params(spec.config, where)
        client = make_client(params.endpoint())
        try:
            deadline = time.monotonic() + params.load_wait_s
            while True:
                ok, reason = await client.ready(max(params.connect_timeout_s, 0.05))
                if ok:
                    break
                if time.monotonic() >= deadline:
                    raise cfgmod.ConfigError(
                        where,
                        "parameters.url",
                        f"target {params.target} did not answer model "
                        f"'{params.model_name}' ready within {params.load_wait_s:g} s: {reason}",
                    )
                await asyncio.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
            try:
                remote = await client.config(params.timeout_s)
                if remote is None:
                    meta = await client.metadata(params.timeout_s)
                    remote = config_from_metadata(meta, spec.config)
            except RemoteError as e:
                raise cfgmod.ConfigError(where, "parameters.url", e.message) from None
            check_against_remote(spec.config, remote, where, params.target)
        finally:
            await client.close()

    async def load(self, spec: ModelSpec) -> list[ModelInstance]:
        """One :class:`RemoteInstance` per instance of ``instance_group`` (default 1),
        sharing one target (connection pool and health probe).

        Raises:
            pdserve.config.ConfigError: bad parameters.
        """
        params = parse_params(spec.config, f"{spec.name}/{cfgmod.CONFIG_FILENAME}")
        count = sum(max(1, g.count) for g in spec.config.instance_group) or 1
        target = RemoteTarget(params, spec.name)
        instances: list[ModelInstance] = [
            RemoteInstance(f"{spec.name}_{i}", target, spec.name) for i in range(count)
        ]
        target.start()
        log.info(
            "remote model '%s' -> %s model '%s' (%d in flight, pool %d)",
            spec.name,
            params.target,
            params.model_name,
            count,
            params.pool_size,
        )
        return instances


class OfflineRemoteBackend(RemoteBackend):
    """The remote backend as ``pdserve check`` uses it: the parameters and the
    configuration as written are checked, the target is not called (it is at load)."""

    async def auto_complete(self, spec: ModelSpec) -> None:
        """Check the parameters, and that ``input`` and ``output`` are configured (they
        could only be completed from the target).

        Raises:
            pdserve.config.ConfigError: bad parameters, or no input / output.
        """
        where = f"{spec.name}/{cfgmod.CONFIG_FILENAME}"
        parse_params(spec.config, where)
        for kind, ios in (("input", spec.config.input), ("output", spec.config.output)):
            if len(ios) == 0:
                raise cfgmod.ConfigError(
                    where,
                    kind,
                    f"no {kind} configured: serve completes it from the target, which "
                    "pdserve check does not call; configure it to check the repository",
                )
