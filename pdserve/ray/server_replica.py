"""One hop: a Serve replica that is a whole pdserve server for the models it holds.

:class:`ServerReplica` loads its models into one :class:`~pdserve.server.InferenceServer`
and answers both of Serve's proxies itself: HTTP through pdserve's V2 ASGI app (Serve's
ASGI ingress) and gRPC through pdserve's ``GRPCInferenceService`` servicer, whose RPC
names are this class's methods (Serve's gRPC proxy calls the replica method named by the
RPC, :mod:`pdserve.ray.grpc_proxy`; ``tritonclient.grpc`` works unchanged, adding the ``application`` metadata only when
the cluster runs several Serve applications). A request crosses Serve's proxy and this
replica, nothing else; an ensemble's steps run in the same process.

Repository load / unload answer ``UNAVAILABLE``: Serve deploys the models (one replica
changing its own set would make replicas differ).
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import grpc
import ray
from google.protobuf.message import DecodeError, Message
from ray import serve
from ray.serve import Application

from pdserve.core.errors import InferError, unavailable
from pdserve.core.procmem import settle_gc
from pdserve.frontends.grpc.service import GrpcService, MalformedMessage
from pdserve.frontends.http.app import create_http_app
from pdserve.ray.grpc_proxy import REQUEST_TYPES, parse_request
from pdserve.ray.plan import SERVER_NAME, plan_server
from pdserve.server import InferenceServer

#: The unary RPCs of ``inference.GRPCInferenceService`` the replica answers.
UNARY_RPCS = (
    "ServerLive",
    "ServerReady",
    "ModelReady",
    "ServerMetadata",
    "ModelMetadata",
    "ModelConfig",
    "ModelInfer",
    "ModelStatistics",
    "RepositoryIndex",
    "RepositoryModelLoad",
    "RepositoryModelUnload",
    "TraceSetting",
    "LogSettings",
    "SystemSharedMemoryStatus",
    "SystemSharedMemoryRegister",
    "SystemSharedMemoryUnregister",
    "CudaSharedMemoryStatus",
    "CudaSharedMemoryRegister",
    "CudaSharedMemoryUnregister",
)


def replica_location() -> dict[str, object]:
    """Where the calling Serve replica runs: ``{"node_id", "node_ip", "pid"}`` (tests,
    tools)."""
    return {
        "node_id": ray.get_runtime_context().get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
    }


class ServeAbort(Exception):
    """An RPC answered with a non-OK status (set on Serve's gRPC context first, so the
    proxy sends that status and message)."""


class ServeContext:
    """The part of ``grpc.aio.ServicerContext`` that pdserve's servicer uses, over
    Serve's ``RayServegRPCContext`` (a copy of the call's context, sent with the
    request to the replica).

    The call's end is not seen here (the proxy holds it): no done callback, never
    ``cancelled``.
    """

    def __init__(self, ctx: Any) -> None:
        self._ctx = ctx

    def invocation_metadata(self) -> Sequence[tuple[str, str]]:
        """The client's metadata (``application``, ``traceparent``, ...)."""
        return list(self._ctx.invocation_metadata()) if self._ctx is not None else []

    def cancelled(self) -> bool:
        """Always False (see the class)."""
        return False

    def add_done_callback(self, callback: object) -> None:
        """Not available (see the class): the cancel token polls :meth:`cancelled`."""
        raise NotImplementedError

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        """Trailing metadata (``retry-after``), sent by the proxy."""
        if self._ctx is not None:
            self._ctx.set_trailing_metadata(list(metadata))

    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        """End the RPC with ``code`` and ``details``.

        Raises:
            ServeAbort: always; Serve's replica keeps the status set on its context.
        """
        if self._ctx is not None:
            self._ctx.set_code(code)
            self._ctx.set_details(details)
        raise ServeAbort(details)


def serve_owns_models() -> InferError:
    """The answer to a repository load / unload on Ray: Serve deploys the models
    (UNAVAILABLE, as Triton answers outside explicit mode)."""
    return unavailable(
        "explicit model load / unload is not allowed: the models of this server are "
        "Ray Serve deployments (redeploy the application to change them)"
    )


class ServeOwnsModels:
    """Repository load and unload for a core on Ray: refused, because Serve deploys the
    models (the one-hop replica's server and the split shape's ingress core)."""

    async def load_model(
        self, name: str, config: object = None, files: dict[str, bytes] | None = None
    ) -> None:
        """Refused, as Triton answers outside explicit mode.

        Raises:
            InferError(UNAVAILABLE): always.
        """
        raise serve_owns_models()

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Refused, as :meth:`load_model`."""
        await self.load_model(name)


class ReplicaServer(ServeOwnsModels, InferenceServer):
    """An InferenceServer whose repository API refuses load and unload (Serve deploys
    the models; :meth:`load_served` loads the replica's own at start)."""

    async def load_served(self, models: Sequence[str]) -> None:
        """Load ``models`` (dependencies before dependents), as at start.

        Raises:
            InferError: a model failed to load (the replica does not start).
        """
        for name in models:
            await InferenceServer.load_model(self, name)


class RootPathApp:
    """An ASGI app under Serve's ``route_prefix``: Serve keeps the prefix in ``path``
    and sets ``root_path`` to it; pdserve's routes are absolute (``/v2/...``), so the
    prefix is taken off ``path`` before ``app`` sees it."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        root = scope.get("root_path")
        if root and scope.get("path", "").startswith(root):
            scope = {**scope, "path": scope["path"][len(root) :] or "/", "root_path": ""}
        await self.app(scope, receive, send)


def _unary(rpc: str) -> Any:
    async def call(self: _ServerReplicaBase, request: bytes, grpc_context: Any = None) -> Any:
        context = ServeContext(grpc_context)
        try:
            message = parse_request(rpc, request)
        except DecodeError as e:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request is not a valid {REQUEST_TYPES[rpc].__name__}: {e}",
            )
        return await getattr(self.grpc, rpc)(message, context)

    call.__name__ = call.__qualname__ = rpc
    call.__doc__ = f"``inference.GRPCInferenceService/{rpc}`` (Serve's gRPC proxy)."
    return call


class _ServerReplicaBase:
    """A replica serving ``models`` of ``repository`` over HTTP and gRPC (see the module).

    Args:
        repository: the model repository root (a path every node can read).
        models: the models to load, dependencies before dependents.
        http: keyword arguments of :func:`create_http_app` (body limits, timeout).

    Raises:
        InferError: a model failed to load (Serve reports the deployment unhealthy).
    """

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self, repository: str, models: Sequence[str], http: Mapping[str, Any] | None = None
    ) -> None:
        self.models = list(models)
        self.http = dict(http or {})
        self.server = ReplicaServer(repository, load_models=[], model_control_mode="explicit")
        await self.server.start()
        await self.server.load_served(self.models)
        self.grpc = GrpcService(self.server)
        settle_gc()  # as `pdserve serve` does once loaded: fewer, shorter collections

    def __serve_build_asgi_app__(self) -> RootPathApp:
        return RootPathApp(create_http_app(self.server, **self.http))

    async def ModelStreamInfer(  # noqa: N802 - gRPC method name
        self, request_stream: AsyncIterator[bytes], grpc_context: Any = None
    ) -> AsyncIterator[Message]:
        """``ModelStreamInfer`` (bidirectional; Serve's gRPC proxy relays the stream).
        A message that does not parse is answered with an ``error_message`` response,
        as pdserve's own gRPC server does."""

        async def parsed() -> AsyncIterator[Message | MalformedMessage]:
            async for data in request_stream:
                try:
                    yield parse_request("ModelStreamInfer", data)
                except DecodeError as e:
                    yield MalformedMessage(f"the request is not a valid ModelInferRequest: {e}")

        async for response in self.grpc.ModelStreamInfer(
            parsed(),
            ServeContext(grpc_context),
        ):
            yield response

    def where(self) -> dict[str, object]:
        """Where this replica runs (:func:`replica_location`)."""
        return replica_location()

    def check_health(self) -> None:
        """Serve's health check: every model still has a ready version.

        Raises:
            RuntimeError: one has none (Serve restarts the replica).
        """
        down = [m for m in self.models if not self.server.model_ready(m)]
        if down:
            raise RuntimeError(f"models without a ready version: {down}")

    async def __del__(self) -> None:
        """Serve's graceful shutdown: finish in-flight requests, unload the models."""
        server = getattr(self, "server", None)
        if server is not None:
            await server.stop(timeout=10.0)


for _rpc in UNARY_RPCS:
    setattr(_ServerReplicaBase, _rpc, _unary(_rpc))
del _rpc

#: The one-hop deployment class (Serve's ASGI ingress around the V2 HTTP app).
ServerReplica = serve.ingress()(_ServerReplicaBase)


def server_application(
    model_repository: Path | str,
    models: list[str] | None = None,
    options: Mapping[str, object] | None = None,
    http: Mapping[str, Any] | None = None,
    name: str = SERVER_NAME,
) -> Application:
    """The one-hop Serve application of a model repository: one deployment whose every
    replica serves all of ``models`` over HTTP and gRPC.

    Args:
        model_repository: the repository root; every node must read the same path.
        models: the models to serve (``None``: all); ensembles bring their steps.
        options: Serve options of the deployment (``num_replicas`` or
            ``autoscaling_config``, ``max_ongoing_requests``, ``ray_actor_options``
            merged over the planned reservation; see :func:`~pdserve.ray.plan.plan_server`).
        http: :func:`create_http_app` keyword arguments.
        name: the deployment's name.

    Raises:
        ValueError: see :func:`~pdserve.ray.plan.plan_server`.
    """
    repo = str(Path(model_repository).resolve())
    plan = plan_server(repo, models, options)
    opts = {"max_ongoing_requests": 64, **plan.options}
    cls: Any = serve.deployment(ServerReplica)  # Serve's overloads confuse mypy
    return cls.options(name=name, **opts).bind(repo, plan.models, dict(http or {}))
