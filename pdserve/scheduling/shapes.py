"""Triton's ``reshape`` of tensor shapes, and shape matching against configured dims.

:func:`reshape_dims` maps a shape between ``dims`` (what a client sends / receives)
and ``reshape.shape`` (what the model takes / produces), once for every backend:
inputs are reshaped when a request is checked (``ModelVersion.prepare``), outputs by
the output check the schedulers run on every result
(:class:`pdserve.scheduling.base.OutputCheck`).
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.core.datatypes import WILDCARD_DIM, shape_str


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
