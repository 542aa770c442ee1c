"""Batching requests of different lengths: the ``padding`` policy of a model.

Triton's dynamic batcher only batches requests whose shapes are identical. This
policy, set per model in config.pbtxt ``parameters`` (key ``padding``), pads one
variable dimension of chosen inputs so that requests of different lengths run as one
batch, and cuts the outputs that carry that dimension back to each request's own
length. :func:`policy_of` parses it (syntax: :class:`PaddingPolicy`),
:func:`validate_padding` checks it at load, and the dynamic batcher applies it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from pdserve import config as cfgmod
from pdserve.core.datatypes import V2_TO_NUMPY
from pdserve.core.errors import InferError, internal

if TYPE_CHECKING:
    from pdserve.backends.base import ExecRequest, ExecResult

#: the model configuration parameter that holds the policy
PARAMETER = "padding"
#: the clauses of the parameter's value
CLAUSES = ("inputs", "outputs", "pad_to", "bucket_pad")
#: the field configuration errors name
FIELD = f"parameters.{PARAMETER}"

_IO = TypeVar("_IO", cfgmod.ModelInput, cfgmod.ModelOutput)


class PaddingSyntaxError(ValueError):
    """The ``padding`` parameter does not parse (the message says where)."""


@dataclass(frozen=True, slots=True)
class PaddedInput:
    """One input the policy pads.

    Attributes:
        name: the input.
        dim: index of the padded dimension in the configured ``dims`` (batch dim excluded).
        value: the pad value as written in the configuration (checked against the
            datatype by :func:`validate_padding`).
    """

    name: str
    dim: int
    value: str


@dataclass(frozen=True, slots=True)
class CutOutput:
    """One output cut back to each request's length along ``dim`` (of its ``dims``)."""

    name: str
    dim: int


@dataclass(frozen=True, slots=True)
class PaddingPolicy:
    """A parsed ``padding`` parameter.

    Triton's dynamic batcher only batches requests whose shapes are identical (or inputs
    marked ``allow_ragged_batch``, for a model written for ragged input). A transformer
    fed token ids of each request's own length therefore gets batches of one. This
    policy, set per model in config.pbtxt ``parameters``, pads one variable dimension of
    chosen inputs so that requests of different lengths run as one batch, and cuts the
    outputs that carry that dimension back to each request's own length::

        parameters {
          key: "padding"
          value: { string_value: "inputs=input_ids:0:0,attention_mask:0:0,token_type_ids:0:0; outputs=token_embeddings:0; pad_to=16,32,64,128,256" }
        }

    Clauses, separated by ``;`` (spaces are ignored):

    - ``inputs=NAME:DIM:VALUE,...`` (required): each input to pad, the index ``DIM`` of
      its variable dimension in the configured ``dims`` (the batch dimension is not
      counted; ``dims: [ -1 ]`` -> ``0``), and the value padded positions get, which must
      be exactly representable in the input's datatype (``0`` for token ids and for an
      attention mask, so that padded positions are masked out).
    - ``outputs=NAME:DIM,...`` (optional): outputs that carry the padded dimension at
      index ``DIM`` of their ``dims``; they are cut back to each request's own length.
      Outputs without it (a pooled sentence embedding) are not listed.
    - ``pad_to=max`` pads each batch to its longest request; ``pad_to=16,32,64`` (strictly
      increasing) pads to the smallest bucket that holds the request, and the dynamic
      batcher only puts requests of one bucket in a batch, so a long request does not
      make short ones pay for its padding.
    - ``bucket_pad=full|longest`` (optional, buckets only): ``full`` (default) pads a
      bucket's batch to the bucket's length (few distinct shapes, what static-shape
      engines want); ``longest`` pads it to its longest request (fewer padded positions:
      cheaper where the cost grows with every position, as ONNX Runtime on CPU).

    The padded dimensions of one request must have the same length (the *request's
    length*); a request where they differ is refused (``INVALID_ARG``, 400). A request
    longer than the largest bucket is **served unpadded**: it is batched only with
    requests of exactly its length, as without the policy. The model's ``dims`` accept
    any length there, so a policy that only exists to speed up batching does not turn
    away a request the model serves; truncating long inputs is the model's (or its
    tokenizer's) business.

    The configuration is checked at load (:func:`validate_padding`, every problem
    reported, as the rest of the configuration check): an input or output that does not
    exist, a dimension that is not variable (``-1``), an input that is
    ``allow_ragged_batch`` or has a ``reshape``, a BYTES input, a pad value the input's
    datatype cannot hold, buckets that are not positive and increasing, a model without
    ``dynamic_batching`` or with ``max_batch_size: 0``.

    There is no Triton equivalent (Triton needs identical shapes or a ragged-input model);
    the names follow ``model_config.proto``'s conventions (``dims`` without the batch
    dimension).

    Attributes:
        inputs: the padded inputs.
        outputs: the outputs cut back.
        buckets: the bucket lengths, increasing; empty: pad to the batch's longest.
        bucket_longest: ``bucket_pad=longest``: a bucket's batch is padded to its
            longest request, not to the bucket's length.
        batching: True when the model batches (``max_batch_size > 0``): arrays then
            have the batch dimension first and ``dim`` is one further along.
        pad_values: input name -> the pad value as a numpy scalar of its dtype (set by
            :meth:`bind`).
    """

    inputs: tuple[PaddedInput, ...]
    outputs: tuple[CutOutput, ...]
    buckets: tuple[int, ...]
    bucket_longest: bool = False
    batching: bool = True
    pad_values: Mapping[str, Any] | None = None

    @classmethod
    def parse(cls, text: str) -> PaddingPolicy:
        """Parse the parameter's ``string_value``.

        Raises:
            PaddingSyntaxError: unknown or repeated clause, missing ``inputs`` or
                ``pad_to``, an item that is not ``NAME:DIM:VALUE`` / ``NAME:DIM``, a
                dimension or bucket that is not an integer, a name listed twice.
        """
        clauses: dict[str, str] = {}
        for raw in text.split(";"):
            clause = raw.strip()
            if not clause:
                continue
            key, sep, value = clause.partition("=")
            key = key.strip()
            if not sep:
                raise PaddingSyntaxError(
                    f"clause '{clause}' is not KEY=VALUE (keys: {', '.join(CLAUSES)})"
                )
            if key not in CLAUSES:
                raise PaddingSyntaxError(f"unknown clause '{key}' (expected {', '.join(CLAUSES)})")
            if key in clauses:
                raise PaddingSyntaxError(f"clause '{key}' is given twice")
            clauses[key] = value.strip()
        if "inputs" not in clauses:
            raise PaddingSyntaxError("missing 'inputs=NAME:DIM:VALUE,...'")
        if "pad_to" not in clauses:
            raise PaddingSyntaxError("missing 'pad_to=max' or 'pad_to=LENGTH,LENGTH,...'")
        inputs = tuple(
            PaddedInput(name, dim, value)
            for name, dim, value in _items(clauses["inputs"], "inputs", with_value=True)
        )
        outputs = tuple(
            CutOutput(name, dim)
            for name, dim, _ in _items(clauses.get("outputs", ""), "outputs", with_value=False)
        )
        pad_to = clauses["pad_to"].replace(" ", "")
        if pad_to == "max":
            buckets: tuple[int, ...] = ()
        else:
            try:
                buckets = tuple(int(b) for b in pad_to.split(","))
            except ValueError:
                raise PaddingSyntaxError(
                    f"pad_to '{pad_to}' is neither 'max' nor a list of integer lengths"
                ) from None
        bucket_pad = clauses.get("bucket_pad", "full").replace(" ", "")
        if bucket_pad not in ("full", "longest"):
            raise PaddingSyntaxError(f"bucket_pad '{bucket_pad}' is neither 'full' nor 'longest'")
        if "bucket_pad" in clauses and not buckets:
            raise PaddingSyntaxError("bucket_pad needs bucket lengths in pad_to, not 'max'")
        return cls(inputs, outputs, buckets, bucket_longest=bucket_pad == "longest")

    def bind(self, config: Any) -> PaddingPolicy:
        """This policy with its pad values converted to the inputs' dtypes.

        Args:
            config: the model's ``ModelConfig`` (already checked by :func:`validate_padding`).

        Raises:
            ValueError: a pad value the input's datatype cannot hold.
        """
        types = {i.name: cfgmod.datatype_of(i) for i in config.input}
        values = {p.name: pad_scalar(p.value, types[p.name]) for p in self.inputs}
        return PaddingPolicy(
            self.inputs,
            self.outputs,
            self.buckets,
            self.bucket_longest,
            config.max_batch_size > 0,
            values,
        )

    # -- per request --------------------------------------------------------------

    def length(self, inputs: Mapping[str, np.ndarray]) -> int:
        """The request's length: the size of its padded dimension (-1: no padded input).

        Raises:
            InferError(INVALID_ARG): the padded inputs of the request have different
                lengths (naming both inputs and lengths).
        """
        length = -1
        first = ""
        lead = 1 if self.batching else 0
        for p in self.inputs:
            arr = inputs.get(p.name)
            if arr is None:  # an optional input the request left out
                continue
            n = int(arr.shape[p.dim + lead])
            if length < 0:
                length, first = n, p.name
            elif n != length:
                raise InferError(
                    f"inputs '{first}' and '{p.name}' are padded together (parameter "
                    f"'{PARAMETER}') and must have the same length; got {length} and {n}"
                )
        return length

    def target(self, length: int) -> int:
        """The bucket a request of ``length`` is padded to.

        Returns:
            the smallest bucket >= ``length``; ``length`` itself when it is longer than
            every bucket (served unpadded), or when the policy pads to the batch's
            longest (``pad_to=max``) or the request has no padded input (``-1``).
        """
        if length >= 0:
            for b in self.buckets:
                if b >= length:
                    return b
        return length

    def batch_target(self, lengths: Sequence[int]) -> int:
        """The length a batch of requests of ``lengths`` (one group) is padded to: its
        bucket, or its longest request (``pad_to=max``, ``bucket_pad=longest``, or
        requests longer than every bucket); -1 when the requests have no padded input."""
        longest = max(lengths)
        if self.buckets and not self.bucket_longest:
            return self.target(longest)
        return longest

    def group(self, length: int) -> int:
        """The batch key part of a request of ``length``: requests with different
        groups never share a batch (-1: any length, ``pad_to=max``)."""
        if not self.buckets or length < 0:
            return -1 if length >= 0 else -2
        return self.target(length)

    def pad(self, request: ExecRequest, target: int) -> None:
        """Pad ``request``'s padded inputs to ``target`` along their dimension, in place
        (``request.inputs`` gets a new dict; the arrays it had are not changed)."""
        values = self.pad_values or {}
        lead = 1 if self.batching else 0
        inputs: dict[str, np.ndarray] | None = None
        for p in self.inputs:
            arr = request.inputs.get(p.name)
            if arr is None:
                continue
            axis = p.dim + lead
            missing = target - arr.shape[axis]
            if missing <= 0:
                continue
            if inputs is None:
                inputs = dict(request.inputs)
            inputs[p.name] = pad_array(arr, axis, target, values.get(p.name, 0))
        if inputs is not None:
            request.inputs = inputs

    def cut(self, model: str, result: ExecResult, length: int, target: int) -> ExecResult:
        """``result`` with the listed outputs cut back from ``target`` to ``length``.

        Returns:
            a new dict of outputs (views), the error ``result`` was, or an
            ``INTERNAL`` :class:`InferError` when a listed output does not have the
            padded length ``target`` along its dimension (the model did not keep the
            padded dimension there: its output would be cut wrongly).
        """
        if type(result) is not dict or not self.outputs:
            return result
        lead = 1 if self.batching else 0
        out = dict(result)
        for c in self.outputs:
            arr = out.get(c.name)
            if arr is None:
                continue
            axis = c.dim + lead
            if arr.ndim <= axis or arr.shape[axis] != target:
                shape = "[" + ",".join(str(d) for d in arr.shape) + "]"
                return internal(
                    f"model '{model}' returned output '{c.name}' with shape {shape}: "
                    f"dimension {axis} should have the padded length {target} (parameter "
                    f"'{PARAMETER}' cuts it back to the request's length {length})"
                )
            if length != target:
                index = [slice(None)] * arr.ndim
                index[axis] = slice(0, length)
                out[c.name] = arr[tuple(index)]
        return out


def _items(text: str, clause: str, *, with_value: bool) -> list[tuple[str, int, str]]:
    """``NAME:DIM[:VALUE]`` items of a clause."""
    items: list[tuple[str, int, str]] = []
    seen: set[str] = set()
    form = "NAME:DIM:VALUE" if with_value else "NAME:DIM"
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        parts = [p.strip() for p in item.split(":")]
        if len(parts) != (3 if with_value else 2) or not parts[0]:
            raise PaddingSyntaxError(f"{clause}: '{item}' is not {form}")
        try:
            dim = int(parts[1])
        except ValueError:
            raise PaddingSyntaxError(
                f"{clause}: dimension '{parts[1]}' of '{parts[0]}' is not an integer"
            ) from None
        if parts[0] in seen:
            raise PaddingSyntaxError(f"{clause}: '{parts[0]}' is listed twice")
        seen.add(parts[0])
        items.append((parts[0], dim, parts[2] if with_value else ""))
    if with_value and not items:
        raise PaddingSyntaxError(f"{clause}: no input listed")
    return items


def pad_scalar(text: str, datatype: str) -> Any:
    """The pad value ``text`` as a numpy scalar of ``datatype`` (V2 name).

    Integers must be integers in the type's range (``0``, ``-1``; not ``0.5`` nor
    ``300`` for UINT8); floats any float ``float()`` reads (``nan``, ``-inf`` too); BOOL
    ``true``/``false``/``1``/``0``.

    Raises:
        ValueError: BYTES (not padded), or a value the datatype cannot hold exactly.
    """
    dtype = V2_TO_NUMPY.get(datatype)
    if dtype is None or datatype == "BYTES":
        raise ValueError(f"{datatype} inputs cannot be padded (numeric and BOOL inputs only)")
    value = text.strip()
    if datatype == "BOOL":
        lowered = value.lower()
        if lowered in ("true", "1"):
            return np.bool_(True)
        if lowered in ("false", "0"):
            return np.bool_(False)
        raise ValueError(f"pad value '{text}' is not a BOOL (true, false, 1, 0)")
    if dtype.kind in "iu":
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"pad value '{text}' is not an integer, as {datatype} needs") from None
        info = np.iinfo(dtype)
        if not info.min <= number <= info.max:
            raise ValueError(
                f"pad value {number} is out of the range of {datatype} [{info.min}, {info.max}]"
            )
        return dtype.type(number)
    try:
        number_f = float(value)
    except ValueError:
        raise ValueError(f"pad value '{text}' is not a number, as {datatype} needs") from None
    with np.errstate(over="ignore"):  # an overflow is reported below, in words
        scalar = dtype.type(number_f)
    if math.isfinite(number_f) and not np.isfinite(scalar):
        raise ValueError(f"pad value {number_f} is out of the range of {datatype}")
    return scalar


def pad_array(arr: np.ndarray, axis: int, target: int, value: Any) -> np.ndarray:
    """A copy of ``arr`` grown to ``target`` along ``axis``, new positions = ``value``.

    ``arr`` keeps its values at the start of ``axis`` (padding goes at the end, as
    tokenizers pad on the right). ``target`` smaller than the size: ``arr`` unchanged.
    """
    size = arr.shape[axis]
    if target <= size:
        return arr
    shape = list(arr.shape)
    shape[axis] = target
    out = np.full(shape, value, dtype=arr.dtype)
    index = [slice(None)] * arr.ndim
    index[axis] = slice(0, size)
    out[tuple(index)] = arr
    return out


def policy_of(config: Any) -> PaddingPolicy | None:
    """The model's bound padding policy, or None when it has no ``padding`` parameter.

    Raises:
        ValueError / PaddingSyntaxError: the parameter is invalid (the load-time check,
            :func:`validate_padding`, reports why first).
    """
    text = cfgmod.get_parameter(config, PARAMETER)
    if text is None:
        return None
    return PaddingPolicy.parse(text).bind(config)


def validate_padding(config: Any, fail: Callable[[str, str], None]) -> None:
    """Check the model's ``padding`` parameter; call ``fail(FIELD, message)`` per problem.

    Nothing happens when the model has no such parameter. See :class:`PaddingPolicy` for
    the rules.
    """
    text = cfgmod.get_parameter(config, PARAMETER)
    if text is None:
        return
    try:
        policy = PaddingPolicy.parse(text)
    except PaddingSyntaxError as e:
        fail(
            FIELD,
            f"{e} (syntax: 'inputs=NAME:DIM:VALUE,...; outputs=NAME:DIM,...; "
            "pad_to=max|L1,L2,...[; bucket_pad=full|longest]')",
        )
        return
    if config.max_batch_size <= 0:
        fail(
            FIELD,
            "padding lets requests of different lengths share a batch: it needs max_batch_size > 0",
        )
    if not config.HasField("dynamic_batching"):
        fail(
            FIELD,
            "padding lets the dynamic batcher batch requests of different lengths: it needs 'dynamic_batching { }'",
        )
    inputs = {i.name: i for i in config.input}
    outputs = {o.name: o for o in config.output}
    for p in policy.inputs:
        io = _padded_io("input", p.name, p.dim, inputs, fail)
        if io is None:
            continue
        if io.allow_ragged_batch:
            fail(FIELD, f"input '{p.name}' is allow_ragged_batch: it is batched ragged, not padded")
        if io.HasField("reshape"):
            fail(
                FIELD,
                f"input '{p.name}' has a reshape: padding an input with a reshape is not supported",
            )
        try:
            pad_scalar(p.value, cfgmod.datatype_of(io))
        except ValueError as e:
            fail(FIELD, f"input '{p.name}': {e}")
    for c in policy.outputs:
        _padded_io("output", c.name, c.dim, outputs, fail)
    buckets = policy.buckets
    if any(b < 1 for b in buckets):
        fail(FIELD, f"pad_to: bucket lengths must be >= 1, got {list(buckets)}")
    elif any(b >= c for b, c in zip(buckets, buckets[1:], strict=False)):
        fail(FIELD, f"pad_to: bucket lengths must be strictly increasing, got {list(buckets)}")


def _padded_io(
    kind: str, name: str, dim: int, ios: dict[str, _IO], fail: Callable[[str, str], None]
) -> _IO | None:
    """The model's ``kind`` (input / output) ``name`` that the policy pads along ``dim``,
    checked; None (failed) when the model has no such ``kind``."""
    io = ios.get(name)
    if io is None:
        fail(FIELD, f"{kind} '{name}' is not an {kind} of the model ({cfgmod.quoted_names(ios)})")
        return None
    _check_dim(name, kind, list(io.dims), dim, fail)
    return io


def _check_dim(
    name: str, kind: str, dims: Sequence[int], dim: int, fail: Callable[[str, str], None]
) -> None:
    shape = "[" + ",".join(str(int(d)) for d in dims) + "]"
    if not 0 <= dim < len(dims):
        fail(
            FIELD,
            f"{kind} '{name}' has no dimension {dim}: its dims are {shape} (batch "
            "dimension not counted)",
        )
    elif dims[dim] != -1:
        fail(
            FIELD,
            f"{kind} '{name}' has no variable dimension at index {dim}: its dims are "
            f"{shape}; only a -1 dimension can be padded",
        )
