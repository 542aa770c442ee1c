"""Triton's ``reshape`` and the check of every model output against its configuration.

:func:`reshape_dims` maps a shape between ``dims`` (what a client sends / receives)
and ``reshape.shape`` (what the model takes / produces), once for every backend:
inputs are reshaped when a request is checked (``ModelVersion.prepare``), outputs by
:class:`OutputCheck`, which the schedulers run on every result (ensemble steps and an
ensemble's own outputs included): a wrong output is ``INTERNAL``, never a 200.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve import config as cfgmod
from pdserve.core.datatypes import V2_TO_NUMPY, WILDCARD_DIM, numpy_to_v2, shape_str
from pdserve.core.errors import InferError, internal

if TYPE_CHECKING:
    from pdserve.backends.base import ExecRequest, ExecResult


def reshape_dims(
    shape: Sequence[int], from_dims: Sequence[int], to_dims: Sequence[int]
) -> tuple[int, ...]:
    """Triton's reshape of one tensor's shape (batch dimension excluded).

    Args:
        shape: the tensor's actual shape, matching ``from_dims``.
        from_dims: the configured shape it has (``-1``: variable).
        to_dims: the configured shape it gets.

    Returns:
        ``to_dims`` with each ``-1`` replaced, in order, by the size ``shape`` has at
        the ``-1`` positions of ``from_dims``. ``reshape_dims([3, 5], [-1, 5], [5, -1])``
        -> ``(5, 3)``.

    Raises:
        ValueError: ``to_dims`` has more ``-1`` than ``from_dims`` (the configuration
            check refuses such a pair), or ``shape`` and ``from_dims`` differ in rank.
    """
    if len(shape) != len(from_dims):
        raise ValueError(
            f"shape {shape_str(shape)} does not have the rank of {shape_str(from_dims)}"
        )
    values = [int(s) for s, d in zip(shape, from_dims, strict=True) if d == WILDCARD_DIM]
    if sum(1 for d in to_dims if d == WILDCARD_DIM) > len(values):
        raise ValueError(
            f"reshape from {shape_str(from_dims)} to {shape_str(to_dims)}: more variable "
            "dimensions in the target"
        )
    it = iter(values)
    return tuple(next(it) if d == WILDCARD_DIM else int(d) for d in to_dims)


def shape_matches(shape: Sequence[int], dims: Sequence[int]) -> bool:
    """True when ``shape`` has the rank of ``dims`` and equals it wherever ``dims`` is not -1."""
    return len(shape) == len(dims) and all(
        d == WILDCARD_DIM or d == s for s, d in zip(shape, dims, strict=True)
    )


class _Output:
    """One configured output, prepared for the per-request check."""

    __slots__ = ("name", "datatype", "dtype", "dims", "variable", "model_dims", "model_variable")

    def __init__(self, io: Any) -> None:
        self.name: str = io.name
        self.datatype = cfgmod.datatype_of(io)
        #: the numpy dtype (None for BYTES: object, bytes_ or str_ arrays are accepted)
        self.dtype: np.dtype | None = (
            None if self.datatype == "BYTES" else V2_TO_NUMPY.get(self.datatype)
        )
        #: served dims (batch dim excluded), as a tuple to compare with ``shape[1:]``
        self.dims: tuple[int, ...] = tuple(int(d) for d in io.dims)
        self.variable = WILDCARD_DIM in self.dims
        #: ``reshape.shape`` when configured: what the model is declared to produce
        self.model_dims: tuple[int, ...] | None = (
            tuple(int(d) for d in io.reshape.shape) if io.HasField("reshape") else None
        )
        self.model_variable = self.model_dims is not None and WILDCARD_DIM in self.model_dims

    def dtype_ok(self, dtype: np.dtype) -> bool:
        if self.dtype is None:
            return dtype.kind in "OSU"
        if dtype == self.dtype:
            return True
        try:  # same type, other byte order
            return numpy_to_v2(dtype) == self.datatype
        except InferError:
            return False


class OutputCheck:
    """Checks (and reshapes) the outputs of one model's requests.

    **Reshape** (``model_config.proto`` ``ModelTensorReshape``): ``dims`` is the shape a
    client sends / receives, ``reshape.shape`` the shape the model itself takes /
    produces; the batch dimension (``max_batch_size > 0``) stays first and is not part of
    either. Variable-size (``-1``) dimensions keep their values, in order: Triton core
    takes the sizes at the ``-1`` positions of the shape it converts from and puts them,
    in the same order, at the ``-1`` positions of the shape it converts to
    (``InferenceRequest::Normalize`` for inputs, ``InferenceResponse::Output::Reshape``
    for outputs). :func:`reshape_dims` does this once for every backend: inputs are
    reshaped when a request is checked (``ModelVersion.prepare``), outputs by
    :class:`OutputCheck`.

    **Output check** (:class:`OutputCheck`, run by the schedulers on every result of
    every backend, ensemble steps included — the steps run on their models' schedulers —
    and on an ensemble's own outputs): each requested output must be present, have the
    configured datatype, and have the shape ``[rows] + dims`` (``rows``: the request's
    batch size, when the model batches; ``-1`` dims accept any size). An output whose
    model configuration has a ``reshape`` may come back shaped as ``reshape.shape`` (what
    the model is declared to produce; it is then reshaped to ``dims``) or already as
    ``dims``. Anything else fails that request with ``INTERNAL`` (HTTP 500, gRPC
    INTERNAL) naming the model, the output, the expected and the actual shape or
    datatype; the other requests of the batch and the server carry on.

    Triton is looser here, and pdserve deliberately stricter (a wrong output is never a
    200 — DESIGN.md): Triton's python backend sends whatever shape and datatype the
    model returned (the response then contradicts the model metadata), and its
    ONNX Runtime backend fails a request only when the batch output has *fewer* rows
    than the batch (``UNSUPPORTED``, "failed to split the output tensor"), silently
    cutting off extra rows. Triton converts no datatype, so neither does pdserve.

    Cost: a few tuple and dtype comparisons per output of each request; no work per
    element (a reshape is a numpy view).

    Args:
        config: the model's (auto-completed) ``ModelConfig``.
    """

    __slots__ = ("model", "batching", "_outputs")

    def __init__(self, config: Any) -> None:
        self.model: str = config.name
        self.batching: bool = config.max_batch_size > 0
        self._outputs: dict[str, _Output] = {o.name: _Output(o) for o in config.output}

    def results(self, batch: list[ExecRequest], results: list[ExecResult]) -> list[ExecResult]:
        """:meth:`check` every successful result of ``batch`` (one result per request).

        Returns:
            ``results`` with each output dict checked / reshaped, or replaced by its
            ``INTERNAL`` error; errors already there are kept.
        """
        check = self.check
        for i, (request, result) in enumerate(zip(batch, results, strict=True)):
            if type(result) is dict:
                results[i] = check(request, result)
        return results

    def check(
        self, request: ExecRequest, outputs: dict[str, np.ndarray]
    ) -> dict[str, np.ndarray] | InferError:
        """Check the outputs of one request against the configuration.

        Args:
            request: the request (its ``output_names`` and ``batch_size``).
            outputs: output name -> array, as the backend returned them.

        Returns:
            ``outputs`` (a new dict when an output was reshaped from
            ``reshape.shape`` to ``dims``), or an ``INTERNAL`` :class:`InferError`
            naming the model, the output, and the expected and actual shape /
            datatype (or the missing output).
        """
        specs = self._outputs
        reshaped: dict[str, np.ndarray] | None = None
        for name in request.output_names:
            arr = outputs.get(name)
            if arr is None:
                return internal(
                    f"model '{self.model}' did not return requested output '{name}' "
                    f"(it returned {sorted(outputs) or 'none'})"
                )
            spec = specs.get(name)
            if spec is None:  # not in the configuration: prepare() refuses to ask for it
                continue
            dtype = arr.dtype
            if dtype is not spec.dtype and not spec.dtype_ok(dtype):
                try:
                    got = numpy_to_v2(dtype)
                except InferError:
                    got = f"numpy {dtype}"
                return internal(
                    f"model '{self.model}' returned output '{name}' as {got}, but its "
                    f"model configuration says {spec.datatype}"
                )
            shape = arr.shape
            if self.batching:
                rows = request.batch_size
                if not shape or shape[0] != rows:
                    return self._shape_error(spec, shape, rows)
                rest = shape[1:]
            else:
                rows = -1
                rest = shape
            if rest == spec.dims or (spec.variable and shape_matches(rest, spec.dims)):
                continue
            model_dims = spec.model_dims
            if model_dims is not None and (
                rest == model_dims or (spec.model_variable and shape_matches(rest, model_dims))
            ):
                try:
                    served = reshape_dims(rest, model_dims, spec.dims)
                    arr = arr.reshape((rows, *served) if self.batching else served)
                except ValueError:  # pragma: no cover - the configuration check prevents it
                    return self._shape_error(spec, shape, rows)
                if reshaped is None:
                    reshaped = dict(outputs)
                reshaped[name] = arr
                continue
            return self._shape_error(spec, shape, rows)
        return outputs if reshaped is None else reshaped

    def _shape_error(self, spec: _Output, shape: tuple[int, ...], rows: int) -> InferError:
        lead = [rows] if self.batching else []
        expected = shape_str(lead + list(spec.dims))
        if spec.model_dims is not None:
            expected += f" (or its reshape.shape {shape_str(lead + list(spec.model_dims))})"
        message = (
            f"model '{self.model}' returned output '{spec.name}' with shape "
            f"{shape_str(shape)}, expected {expected}"
        )
        if self.batching:
            got_rows = shape[0] if shape else "no"
            if got_rows != rows:
                message += f": {got_rows} rows for a request of {rows} rows"
        return internal(message)
