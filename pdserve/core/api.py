"""The typed API of the core: what each part of pdserve may call on the server.

:class:`pdserve.server.InferenceServer` implements every protocol here; each consumer
is typed with the narrowest one it needs:

- :class:`InferenceCore`: the HTTP and gRPC frontends and the app.
- :class:`ModelRunner`: ensemble steps, BLS calls and traffic control run a request
  on a resolved model version (a :class:`ModelRef`).
- :class:`ModelHost`: the model manager (a :class:`ModelRunner` plus the warm-up hook).

The protocols speak core types only: a model version is a :class:`ModelRef` (the
runner's own type, which the runner hands out and takes back). Protocols that one
layer alone uses live with that layer (``MetricsSource`` in
:mod:`pdserve.observability.metrics`, ``RepositoryHost`` in :mod:`pdserve.repository.control`).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Coroutine
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, runtime_checkable

from pdserve.core.streaming import StreamResponse
from pdserve.core.types import InferRequest, InferResponse

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2


class ModelRef(Protocol):
    """A loaded model version as the core's callers see it (ensemble steps, BLS)."""

    @property
    def name(self) -> str:
        """The model's name."""
        ...

    @property
    def version_str(self) -> str:
        """The version number as text."""
        ...

    @property
    def decoupled(self) -> bool:
        """``model_transaction_policy { decoupled: true }``: streamed responses only."""
        ...

    @property
    def config(self) -> model_config_pb2.ModelConfig:
        """The version's (auto-completed) model configuration."""
        ...


#: The model version type of one :class:`ModelRunner` (the server's ``ModelVersion``).
ModelT = TypeVar("ModelT", bound=ModelRef)


@runtime_checkable
class InferenceCore(Protocol):
    """What the frontends (V2 HTTP and gRPC) and the app call on the core.

    Every method is protocol-neutral: requests and responses are
    :class:`~pdserve.core.types.InferRequest` / :class:`~pdserve.core.types.InferResponse`
    and plain dicts in the V2 JSON shapes; errors are
    :class:`~pdserve.core.errors.InferError`, mapped to a status by each frontend.
    """

    @property
    def started(self) -> bool:
        """True once the initial models were loaded (``start`` returned)."""
        ...

    def live(self) -> bool:
        """Liveness (``/v2/health/live``): the process serves requests."""
        ...

    def ready(self) -> bool:
        """Readiness (``/v2/health/ready``)."""
        ...

    def metadata(self) -> dict[str, Any]:
        """V2 server metadata: ``{name, version, extensions}``."""
        ...

    def model_metadata(self, name: str, version: str = "") -> dict[str, Any]:
        """V2 model metadata ``{name, versions, platform, inputs, outputs}``.

        Raises:
            InferError(404 / 503): unknown model or version, or none ready.
        """
        ...

    def model_config(self, name: str, version: str = "") -> dict[str, Any]:
        """The model's configuration in Triton's JSON form.

        Raises:
            InferError(404 / 503): unknown model or version, or none ready.
        """
        ...

    def model_ready(self, name: str, version: str = "") -> bool:
        """True when that model version (or, with no version, any) is ready."""
        ...

    async def infer(self, request: InferRequest) -> InferResponse:
        """Run one inference request.

        Raises:
            InferError: 404 unknown model/version, 400 bad inputs, 503 unavailable,
                500 the model failed.
        """
        ...

    def infer_stream(self, request: InferRequest) -> AsyncGenerator[StreamResponse, None]:
        """Run one request and yield its responses as they come: a decoupled model's
        several responses, the last one ``final`` (Triton's decoupled semantics); any
        other model's one response. Errors are items with ``error`` set (never raised).
        Close the iterator (``contextlib.aclosing``) when the client goes away."""
        ...

    def model_statistics(self, name: str = "", version: str = "") -> dict[str, Any]:
        """Triton's statistics extension: ``{"model_stats": [...]}``.

        Raises:
            InferError(404): unknown model or version.
        """
        ...

    def repository_index(self, ready_only: bool = False) -> list[dict[str, Any]]:
        """Repository index rows ``{name, version, state, reason}`` (plus
        ``memory_bytes`` / ``memory_source`` where measured)."""
        ...

    async def load_model(
        self, name: str, config: Any = None, files: dict[str, bytes] | None = None
    ) -> None:
        """Load or reload a model (repository extension); an ensemble's steps that
        are not loaded load first (as steps only: see :meth:`unload_model`).

        Args:
            config: a configuration override: Triton's JSON form (``str`` or ``dict``)
                or a ``ModelConfig``; ``None`` reads config.pbtxt.
            files: ``{"<version>/<file>": bytes}`` written into the model folder first.

        Raises:
            InferError(503): the model control mode is not ``explicit`` or ``on_demand``.
            InferError(400): bad override, or the model is missing or fails to load.
        """
        ...

    async def unload_model(self, name: str, unload_dependents: bool = False) -> None:
        """Unload a model (repository extension), and the loaded ensembles that use it.

        Args:
            unload_dependents: when the model is an ensemble, also unload its steps
                that were loaded only as its steps and that no other loaded ensemble
                uses (Triton's ``unload_dependents``).

        Raises:
            InferError(503): the model control mode is not ``explicit`` or ``on_demand``.
            InferError(400): the model is not loaded.
        """
        ...


@runtime_checkable
class ModelRunner(Protocol[ModelT]):
    """What ensemble steps and BLS calls reach the core through (``ModelSpec.server``).

    A step or BLS request runs through the step model's own scheduler, statistics and
    response cache, exactly as a client's request to that model would.
    """

    def model_version(self, name: str, version: str = "") -> ModelT:
        """The ready model version ``name`` / ``version`` (``""``: the version policy's).

        Raises:
            InferError(404): unknown model, or a version that is not served.
            InferError(503): the model exists but no version is ready.
        """
        ...

    def infer_on(self, mv: ModelT, request: InferRequest) -> Coroutine[Any, Any, InferResponse]:
        """Run ``request`` on an already resolved model version: ``await
        runner.infer_on(mv, request)``.

        A plain method returning the coroutine that runs the request (an ``async def``
        implements it too): the core returns the coroutine of the step that runs it
        rather than awaiting it, which keeps the request's coroutine chain short.

        Raises:
            InferError: 400 bad inputs, 503 unavailable, 500 the model failed (when
                awaited; an unknown or unready version may raise at the call).
        """
        ...

    def infer_stream(self, request: InferRequest) -> AsyncGenerator[StreamResponse, None]:
        """Every response of ``request`` as it comes (a BLS ``exec(decoupled=True)``);
        see :meth:`InferenceCore.infer_stream`."""
        ...


@runtime_checkable
class ModelHost(ModelRunner[ModelT], Protocol[ModelT]):
    """The manager's back-reference: a :class:`ModelRunner` handed to backends in
    ``ModelSpec.server``, and the warm-up hook run on each freshly loaded version."""

    async def warmup(self, mv: ModelT) -> None:
        """Warm ``mv`` up before it serves.

        Raises:
            Exception: the warm-up failed; the version is closed and does not serve.
        """
        ...
