"""One tensor into shared memory (one copy) and back out (a view, no copy).

BYTES tensors travel in the binary tensor extension's layout (uint32 LE length + bytes
per element, :func:`pdserve.core.datatypes.serialize_bytes_tensor`). Tensors of at
most :data:`INLINE_MAX` bytes, and any that find no room, travel inside the frame.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable

import numpy as np

from pdserve.core.datatypes import deserialize_bytes_tensor, serialize_bytes_tensor
from pdserve.shm.arenas import Arena
from pdserve.shm.records import TensorDesc

#: Tensors of at most this many bytes ride inside the control message.
INLINE_MAX = 256


def is_bytes_dtype(dtype: np.dtype) -> bool:
    """True for the numpy dtypes that hold BYTES tensors (object, S, U)."""
    return dtype.kind in "OSU"


def write_tensor(array: np.ndarray, alloc: Callable[[int], tuple[Arena, int] | None]) -> TensorDesc:
    """Copy ``array`` once into shared memory (or inline when tiny) and describe it.

    Args:
        array: any numpy array; object/``S``/``U`` arrays are BYTES.
        alloc: ``alloc(nbytes) -> (arena, offset)``, or None when no space is left
            (the tensor is then sent inline, inside the control message).

    Returns:
        the descriptor :func:`read_tensor` understands.
    """
    shape = array.shape  # a tuple of ints
    if is_bytes_dtype(array.dtype):
        data = serialize_bytes_tensor(array)
        nbytes = len(data)
        placed = alloc(nbytes) if nbytes > INLINE_MAX else None
        if placed is None:
            return TensorDesc("BYTES", shape, data)
        arena, offset = placed
        arena.mm[offset : offset + nbytes] = data
        return TensorDesc("BYTES", shape, None, arena.id, offset, nbytes)
    dtype = array.dtype
    if dtype.byteorder == ">":
        array = array.astype(dtype.newbyteorder("<"))
        dtype = array.dtype
    nbytes = array.nbytes
    placed = alloc(nbytes) if nbytes > INLINE_MAX else None
    if placed is None:
        return TensorDesc(dtype.str, shape, np.ascontiguousarray(array).tobytes())
    arena, offset = placed
    dst = np.ndarray(shape, dtype=dtype, buffer=arena.mm, offset=offset)
    np.copyto(dst, array, casting="no")
    return TensorDesc(dtype.str, shape, None, arena.id, offset, nbytes)


def read_tensor(
    desc: TensorDesc,
    arenas: dict[int, Arena],
    on_release: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """Turn a descriptor back into an array.

    Fixed-size tensors in an arena become views of the shared memory (no copy);
    with ``on_release``, ``on_release(arena_id, offset)`` is called once the last
    view is garbage-collected. BYTES tensors are rebuilt as object arrays of
    ``bytes`` (their block is released at once).

    Raises:
        KeyError: the arena is not mapped here.
        pdserve.core.errors.InferError: BYTES data that does not hold the shape's
            element count (a peer's bug).
    """
    shape = desc.shape
    count = math.prod(shape)
    inline = desc.inline
    if inline is not None:
        if desc.dtype == "BYTES":
            return deserialize_bytes_tensor(inline, count).reshape(shape)
        return np.frombuffer(inline, dtype=np.dtype(desc.dtype)).reshape(shape).copy()
    arena_id, offset = desc.arena, desc.offset
    arena = arenas[arena_id]
    if desc.dtype == "BYTES":
        block = memoryview(arena.mm)[offset : offset + desc.nbytes]
        try:
            out = deserialize_bytes_tensor(block, count).reshape(shape)
        finally:
            block.release()
        if on_release is not None:
            on_release(arena_id, offset)
        return out
    dtype = np.dtype(desc.dtype)
    flat = np.frombuffer(arena.mm, dtype=dtype, count=count, offset=offset)
    if on_release is not None:
        root: object = flat
        while isinstance(root, np.ndarray):
            root = root.base
        weakref.finalize(root, on_release, arena_id, offset)
    return flat.reshape(shape)


# --------------------------------------------------------------------------- pools
