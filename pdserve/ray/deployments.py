"""A model repository as a Ray Serve application (``pip install 'pdserve[ray]'``).

One Serve deployment per model (:class:`ModelReplica`: an
:class:`~pdserve.server.InferenceServer` with only that model loaded, model control
``explicit``), plus the ingress (:class:`V2Ingress`): pdserve's own V2 HTTP ASGI app
over :class:`RayCore`, whose ``infer`` and metadata calls go to the model's
``DeploymentHandle``. An ensemble's deployment runs its pipeline with pdserve's own
ensemble scheduler, each step a call through the step model's handle
(:class:`StepServer`), so each step scales on its own nodes and replicas.

Errors cross replicas as :class:`Failure` values, raised again at the ingress with
pdserve's own status; a replica that dies under a request is ``UNAVAILABLE``. Entry
points: :func:`build_app` (``serve run`` / ``serve deploy``), :func:`application`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar, cast

from ray import serve
from ray.exceptions import RayError, RayTaskError
from ray.serve import Application
from ray.serve.exceptions import RayServeException
from ray.serve.handle import DeploymentHandle

from pdserve import __version__
from pdserve import config as cfgmod
from pdserve.core.api import InferenceCore
from pdserve.core.errors import ErrorCode, InferError, internal, not_found, unavailable
from pdserve.core.types import InferRequest, InferResponse
from pdserve.frontends.http.app import create_http_app
from pdserve.ray.plan import INGRESS_NAME, plan_application
from pdserve.ray.server_replica import (
    RootPathApp,
    ServeOwnsModels,
    replica_location,
    server_application,
)
from pdserve.repository.model import ModelVersion
from pdserve.server import InferenceServer

log = logging.getLogger("pdserve.ray")

#: Extensions the ingress advertises: a Ray application's models are deployed by
#: Serve, so the model repository's load / unload are not among them.
EXTENSIONS = [
    "classification",
    "schedule_policy",
    "model_configuration",
    "binary_tensor_data",
    "parameters",
    "statistics",
]


@dataclass(slots=True)
class Failure:
    """An :class:`InferError` as it crosses a deployment boundary (a plain value:
    Ray would re-raise the exception wrapped in its own type)."""

    message: str
    code: int  #: the ErrorCode's value

    @classmethod
    def of(cls, error: InferError) -> Failure:
        return cls(error.message, error.code.value)

    def error(self) -> InferError:
        return InferError(self.message, ErrorCode(self.code))


T = TypeVar("T")


def _unwrap(value: object) -> object:
    """A replica's answer, with a :class:`Failure` raised as its InferError."""
    if isinstance(value, Failure):
        raise value.error()
    return value


async def _call(handle: DeploymentHandle, method: str, *args: object, what: str) -> object:
    """Call ``method`` on a replica of ``handle``'s deployment.

    Raises:
        InferError: the replica's own error (its code unchanged); ``INTERNAL`` when the
            replica's code raised something else; ``UNAVAILABLE`` when the replica died
            or could not be reached, or Serve refused the request (back-pressure): the
            request may be retried.
    """
    try:
        result = await getattr(handle, method).remote(*args)
    except RayTaskError as e:  # an exception in the replica's code (not an InferError)
        raise internal(f"{what}: {e.cause!r}" if e.cause is not None else f"{what}: {e}") from None
    except (RayError, RayServeException) as e:
        raise unavailable(
            f"{what}: the replica serving it failed ({type(e).__name__}); retry"
        ) from None
    return _unwrap(result)


async def _call_for(
    kind: type[T], handle: DeploymentHandle, method: str, *args: object, what: str
) -> T:
    """:func:`_call`, whose answer must be a ``kind``.

    Raises:
        InferError: as :func:`_call`; ``INTERNAL`` when the answer is not a ``kind``.
    """
    result = await _call(handle, method, *args, what=what)
    if not isinstance(result, kind):
        raise internal(f"{what}: the replica answered a {type(result).__name__}")
    return result


def _portable(request: InferRequest) -> InferRequest:
    """``request`` without what cannot leave this process (the disconnect probe)."""
    if request.cancelled is None:
        return request
    return replace(
        request, cancelled=None, traceparent=None, trace=None, shm_inputs=None, stream=None
    )


class _RemoteStep:
    """A step model of an ensemble that another deployment serves: what the ensemble
    scheduler reads of a :class:`ModelVersion` (``name``, ``config``)."""

    def __init__(self, name: str, config: cfgmod.ModelConfig) -> None:
        self.name = name
        self.config = config


class StepServer(InferenceServer):
    """An InferenceServer whose ensemble steps run on other deployments.

    :meth:`model_version` answers for a step model with its configuration (fetched from
    the step's deployment by :meth:`fetch_steps`, so the ensemble is validated against
    the auto-completed configuration the step really serves) and :meth:`infer_on`
    sends a step's request through that deployment's handle. Everything else is
    :class:`InferenceServer`'s.

    Args:
        repository: the model repository root.
        steps: step model name -> the handle of its deployment.
    """

    def __init__(self, repository: Path | str, steps: Mapping[str, DeploymentHandle]) -> None:
        super().__init__(repository, load_models=[], model_control_mode="explicit")
        self.steps = dict(steps)
        self._remote: dict[str, _RemoteStep] = {}

    async def fetch_steps(self) -> None:
        """Read each step model's configuration from its deployment.

        Raises:
            InferError: a step deployment answered an error (UNAVAILABLE: not reached).
        """

        async def one(name: str, handle: DeploymentHandle) -> None:
            doc = await _call_for(
                dict, handle, "model_config", name, "", what=f"step model '{name}'"
            )
            self._remote[name] = _RemoteStep(name, cfgmod.config_from_json(doc))

        await asyncio.gather(*(one(n, h) for n, h in self.steps.items()))

    def model_version(self, name: str, version: str = "") -> ModelVersion:
        """The step stand-in for a step model, else the local model version."""
        remote = self._remote.get(name)
        if remote is not None:
            return cast(ModelVersion, remote)
        return super().model_version(name, version)

    async def infer_on(self, mv: ModelVersion, request: InferRequest) -> InferResponse:
        """A step's request goes to the step's deployment; others run here."""
        if isinstance(mv, _RemoteStep):
            handle = self.steps[mv.name]
            return await _call_for(
                InferResponse, handle, "infer", _portable(request), what=f"model '{mv.name}'"
            )
        return await super().infer_on(mv, request)


class ModelReplica:
    """A Serve replica hosting one model of the repository.

    Args:
        repository: the model repository root (a path every node can read).
        model: the model this deployment serves.
        steps: for an ensemble, step model name -> the handle of its deployment.

    Raises:
        InferError: the model failed to load (the replica does not start; Serve
            reports the deployment unhealthy).
    """

    async def __init__(  # type: ignore[misc]  # Serve awaits an async constructor
        self, repository: str, model: str, steps: Mapping[str, DeploymentHandle] | None = None
    ) -> None:
        self.model = model
        self.server = StepServer(repository, steps or {})
        await self.server.fetch_steps()
        await self.server.start()
        await self.server.load_model(model)

    async def infer(self, request: InferRequest) -> InferResponse | Failure:
        """Run one request on this replica's model (errors returned as :class:`Failure`)."""
        try:
            return await self.server.infer(request)
        except InferError as e:
            return Failure.of(e)

    def model_metadata(self, name: str, version: str) -> dict[str, object] | Failure:
        """V2 model metadata (see :meth:`InferenceServer.model_metadata`)."""
        try:
            return self.server.model_metadata(name, version)
        except InferError as e:
            return Failure.of(e)

    def model_config(self, name: str, version: str) -> dict[str, object] | Failure:
        """The model's configuration in Triton's JSON form."""
        try:
            return self.server.model_config(name, version)
        except InferError as e:
            return Failure.of(e)

    def model_ready(self, name: str, version: str) -> bool:
        """True when that version (any, with ``""``) is ready here."""
        return self.server.model_ready(name, version)

    def model_statistics(self, name: str, version: str) -> dict[str, object] | Failure:
        """This replica's statistics of its model (Triton's statistics extension)."""
        try:
            return self.server.model_statistics(name, version)
        except InferError as e:
            return Failure.of(e)

    def repository_index(self, ready_only: bool) -> list[dict[str, object]]:
        """This replica's repository index rows (its one model)."""
        return [r for r in self.server.repository_index(ready_only) if r["name"] == self.model]

    def where(self) -> dict[str, object]:
        """Where this replica runs (:func:`replica_location`)."""
        return replica_location()

    def check_health(self) -> None:
        """Serve's health check: the model still has a ready version.

        Raises:
            RuntimeError: it has none (Serve restarts the replica).
        """
        if not self.server.model_ready(self.model):
            raise RuntimeError(f"model '{self.model}' has no ready version")

    async def __del__(self) -> None:
        """Serve's graceful shutdown: finish in-flight requests, unload the model."""
        server = getattr(self, "server", None)  # absent when the constructor failed early
        if server is not None:
            await server.stop(timeout=10.0)


class RayCore(ServeOwnsModels):
    """The :class:`~pdserve.core.api.InferenceCore` of the ingress: each call goes to
    the deployment of the model it names.

    Args:
        handles: model name -> the handle of its deployment.
    """

    def __init__(self, handles: Mapping[str, DeploymentHandle]) -> None:
        self.handles = dict(handles)

    @property
    def started(self) -> bool:
        """Always True: Serve routes to the ingress once every deployment is up."""
        return True

    def live(self) -> bool:
        """Liveness: this ingress replica serves requests."""
        return True

    def ready(self) -> bool:
        """Readiness: Serve starts routing only once the application is running."""
        return True

    def metadata(self) -> dict[str, object]:
        """V2 server metadata (no repository extension: Serve deploys the models)."""
        return {"name": "pdserve", "version": __version__, "extensions": EXTENSIONS}

    def _handle(self, name: str) -> DeploymentHandle:
        handle = self.handles.get(name)
        if handle is None:
            raise not_found(f"Request for unknown model: '{name}' is not found")
        return handle

    async def model_metadata(self, name: str, version: str = "") -> dict[str, object]:
        """V2 model metadata from the model's deployment."""
        return await _call_for(
            dict, self._handle(name), "model_metadata", name, version, what=f"model '{name}'"
        )

    async def model_config(self, name: str, version: str = "") -> dict[str, object]:
        """The model's configuration from its deployment."""
        return await _call_for(
            dict, self._handle(name), "model_config", name, version, what=f"model '{name}'"
        )

    async def model_ready(self, name: str, version: str = "") -> bool:
        """True when the model's deployment has it ready (False: unknown or unreachable)."""
        handle = self.handles.get(name)
        if handle is None:
            return False
        try:
            return bool(await _call(handle, "model_ready", name, version, what=name))
        except InferError:
            return False

    async def infer(self, request: InferRequest) -> InferResponse:
        """Send the request to a replica of its model's deployment.

        Raises:
            InferError: the replica's error unchanged; ``NOT_FOUND`` an unknown model;
                ``UNAVAILABLE`` the replica died under the request (retry).
        """
        handle = self._handle(request.model_name)
        return await _call_for(
            InferResponse, handle, "infer", _portable(request), what=f"model '{request.model_name}'"
        )

    async def model_statistics(self, name: str = "", version: str = "") -> dict[str, object]:
        """Statistics from one replica of each model named (all models with ``""``).

        Each replica counts its own requests: with several replicas the figures are
        one replica's (Serve's own metrics cover the deployment).
        """
        if name:
            if name not in self.handles:
                raise InferError(f"requested model '{name}' is not available")
            names = [name]
        else:
            names = sorted(self.handles)
        docs = await asyncio.gather(
            *(
                _call_for(
                    dict, self.handles[n], "model_statistics", n, version, what=f"model '{n}'"
                )
                for n in names
            )
        )
        return {"model_stats": [row for doc in docs for row in doc["model_stats"]]}

    async def repository_index(self, ready_only: bool = False) -> list[dict[str, object]]:
        """One row per model, from its deployment."""
        rows = await asyncio.gather(
            *(
                _call_for(list, h, "repository_index", ready_only, what=f"model '{n}'")
                for n, h in sorted(self.handles.items())
            )
        )
        return [row for part in rows for row in part]


class _V2IngressBase:
    """The ingress replica: pdserve's V2 HTTP ASGI app over :class:`RayCore`.

    Args:
        handles: model name -> the handle of its deployment.
        http: keyword arguments of :func:`create_http_app` (body limits, timeout).
    """

    def __init__(
        self, handles: Mapping[str, DeploymentHandle], http: Mapping[str, Any] | None = None
    ) -> None:
        self.core = RayCore(handles)
        self.http = dict(http or {})

    def __serve_build_asgi_app__(self) -> RootPathApp:
        # HttpApp awaits the core's methods that are async (RayCore's metadata calls)
        return RootPathApp(create_http_app(cast(InferenceCore, self.core), **self.http))


#: The ingress deployment class (Serve wraps the ASGI app).
V2Ingress = serve.ingress()(_V2IngressBase)


def application(
    model_repository: Path | str,
    models: list[str] | None = None,
    options: Mapping[str, Mapping[str, object]] | None = None,
    ingress: Mapping[str, object] | None = None,
    http: Mapping[str, Any] | None = None,
) -> Application:
    """The Serve application (``serve.run(application(...))``) of a model repository.

    Args:
        model_repository: the repository root; every node must read the same path.
        models: the models to serve (``None``: all); ensembles bring their steps.
        options: model name -> deployment options (see :mod:`pdserve.ray.plan`).
        ingress: options of the ingress deployment (``num_replicas``, ...).
        http: :func:`create_http_app` keyword arguments.

    Returns:
        a ``ray.serve.Application`` whose ingress is the V2 HTTP API.

    Raises:
        ValueError: see :func:`pdserve.ray.plan.plan_application`.
    """
    repo = str(Path(model_repository).resolve())
    bound: dict[str, Application] = {}
    model_cls: Any = serve.deployment(ModelReplica)  # Serve's overloads confuse mypy
    for plan in plan_application(repo, models, options):
        steps = {s: bound[s] for s in plan.steps}
        bound[plan.model] = model_cls.options(name=plan.model, **plan.options).bind(
            repo, plan.model, steps or None
        )
    ingress_opts = {"num_replicas": 1, "ray_actor_options": {"num_cpus": 0.5}, **(ingress or {})}
    ingress_cls: Any = serve.deployment(V2Ingress)
    return ingress_cls.options(name=INGRESS_NAME, **ingress_opts).bind(bound, dict(http or {}))


def build_app(args: dict[str, Any]) -> Application:
    """Serve application builder (``import_path: pdserve.ray:build_app``).

    ``args`` (from ``serve run ... key=value`` or a config file's ``args``):
    ``model_repository`` (required), ``models`` (list or comma-separated string),
    ``shape`` (``server``, the default: one deployment, each replica a whole server,
    :func:`~pdserve.ray.server_replica.server_application`; ``split``: one deployment
    per model behind an ingress, :func:`application`), ``http``; for ``server``:
    ``deployment`` (its Serve options); for ``split``: ``options`` (model ->
    deployment options), ``ingress``.

    Raises:
        ValueError: no ``model_repository``, an unknown ``shape``, or see
            :func:`application` / :func:`~pdserve.ray.server_replica.server_application`.
    """
    if "model_repository" not in args:
        raise ValueError(
            "build_app (import_path pdserve.ray:build_app) needs model_repository=<folder>"
        )
    models = args.get("models")
    if isinstance(models, str):
        models = [m for m in models.split(",") if m]
    shape = args.get("shape", "server")
    if shape == "server":
        return server_application(
            args["model_repository"], models, args.get("deployment"), args.get("http")
        )
    if shape != "split":
        raise ValueError(f"shape must be 'server' or 'split', not {shape!r}")
    return application(
        args["model_repository"],
        models,
        args.get("options"),
        args.get("ingress"),
        args.get("http"),
    )
