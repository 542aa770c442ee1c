"""The backend interface: what a scheduler hands a model instance, and what comes back.

As in Triton's backend API, a model instance sees a *batch of requests* (a list),
never HTTP or gRPC. Backends that run one merged tensor (ONNX Runtime) concatenate
the requests' inputs along the batch dimension themselves (:func:`merge_batch`)
and split the outputs back (:func:`split_batch`); the Python backend hands the
list to ``TritonPythonModel.execute(requests)`` unchanged.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.types import InferError, InferRequest

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2


@dataclass(slots=True)
class ExecRequest:
    """One request as a model instance sees it.

    Attributes:
        inputs: input name -> array (batch dim first when the model batches).
        output_names: outputs to compute (every model output when none were asked).
        request: the originating request (id, parameters) — read-only.
        batch_size: rows in this request (1 when the model does not batch).
        queue_ns: set by the scheduler: ns from enqueue until an instance took it.
        compute_ns: set by the scheduler: ns its batch spent executing.
    """

    inputs: dict[str, np.ndarray]
    output_names: list[str]
    request: InferRequest
    batch_size: int = 1
    queue_ns: int = 0
    compute_ns: int = 0


#: What an instance returns per request: outputs by name, or the error for that request.
ExecResult = dict[str, np.ndarray] | InferError


@dataclass
class ModelSpec:
    """Everything a backend needs to load one version of one model.

    Attributes:
        name: model name.
        version: numeric version.
        config: the (auto-completed) ``ModelConfig`` protobuf.
        model_dir: ``<repository>/<model>``.
        version_dir: ``<repository>/<model>/<version>``.
        repository: the model repository root.
        server: the :class:`pdserve.server.InferenceServer` (for BLS); may be None.
    """

    name: str
    version: int
    config: model_config_pb2.ModelConfig
    model_dir: Path
    version_dir: Path
    repository: Path
    server: Any = None
    extra: dict[str, Any] = field(default_factory=dict)


class ModelInstance(abc.ABC):
    """One model instance (Triton's "model instance"): runs one batch at a time.

    Schedulers guarantee that :meth:`execute` is never entered twice at once on
    the same instance.
    """

    #: instance name, e.g. ``"tiny_0"`` (Triton names them ``<model>_<n>``).
    name: str = ""
    #: ``"KIND_CPU"`` / ``"KIND_GPU"`` / ``"KIND_MODEL"``.
    kind: str = "KIND_CPU"

    @abc.abstractmethod
    async def execute(self, batch: list[ExecRequest]) -> list[ExecResult]:
        """Run ``batch`` and return one result per request, in order.

        An exception raised here fails every request of the batch with a 500.
        """

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release the instance's resources (sessions, worker processes)."""


class Backend(abc.ABC):
    """A backend: turns a :class:`ModelSpec` into model instances."""

    #: the ``backend`` name in config.pbtxt.
    name: str = ""

    def auto_complete(self, spec: ModelSpec) -> None:  # noqa: B027 - optional hook
        """Fill in and check ``spec.config`` from the model file, in place.

        Raises:
            pdserve.config.ConfigError: the config disagrees with the model file.
        """

    @abc.abstractmethod
    async def load(self, spec: ModelSpec) -> list[ModelInstance]:
        """Create the model's instances (per ``instance_group``).

        Raises:
            Exception: any failure; the model is then reported UNAVAILABLE with the
                exception's message as the reason.
        """


def merge_batch(batch: list[ExecRequest]) -> dict[str, np.ndarray]:
    """Concatenate each input of several requests along dim 0.

    Args:
        batch: requests with the same input names, each array shaped
            ``[rows_i, ...]``; non-batch dims must agree (the dynamic batcher only
            groups requests whose shapes agree).

    Returns:
        input name -> array ``[sum(rows_i), ...]``. A single request is returned
        without copying.
    """
    if len(batch) == 1:
        return batch[0].inputs
    names = batch[0].inputs.keys()
    return {n: np.concatenate([r.inputs[n] for r in batch], axis=0) for n in names}


def split_batch(batch: list[ExecRequest], outputs: dict[str, np.ndarray]) -> list[ExecResult]:
    """Split merged outputs ``[sum(rows_i), ...]`` back per request (views, no copy).

    Each request gets only the outputs it asked for.

    Raises:
        InferError(500): an output's first dim does not equal the total rows.
    """
    if len(batch) == 1:
        req = batch[0]
        return [{n: outputs[n] for n in req.output_names}]
    total = sum(r.batch_size for r in batch)
    results: list[ExecResult] = []
    offset = 0
    for req in batch:
        end = offset + req.batch_size
        out: dict[str, np.ndarray] = {}
        for n in req.output_names:
            arr = outputs[n]
            if arr.ndim == 0 or arr.shape[0] != total:
                raise InferError(
                    f"output '{n}' has shape {list(arr.shape)}: its first dim should be "
                    f"the batch size {total}",
                    500,
                )
            out[n] = arr[offset:end]
        results.append(out)
        offset = end
    return results
