"""The arena records that cross the socket with a frame, in either direction."""

from __future__ import annotations

from typing import NamedTuple


class TensorDesc(NamedTuple):
    """One tensor in a frame: its type, shape and where its bytes are.

    Written by :func:`pdserve.shm.tensors.write_tensor`, read by
    :func:`~pdserve.shm.tensors.read_tensor`.
    """

    #: numpy ``dtype.str`` (little-endian, e.g. ``"<f4"``), or ``"BYTES"``: then the
    #: bytes are the length-prefixed elements of
    #: :func:`pdserve.core.datatypes.serialize_bytes_tensor`.
    dtype: str
    #: The tensor's shape.
    shape: tuple[int, ...]
    #: The tensor's bytes when they ride inside the message (small tensors); None when
    #: they are in the sender's shared-memory arena ``arena``.
    inline: bytes | None
    #: Id of the sender's arena that holds the bytes (-1: inline).
    arena: int = -1
    #: Byte offset of the block in that arena.
    offset: int = 0
    #: Bytes of the block that are the tensor's.
    nbytes: int = 0


class NewArena(NamedTuple):
    """A shared-memory arena of the sender that the receiver has not mapped yet; its
    file descriptor rides with the frame (``SCM_RIGHTS``)."""

    #: The arena's id, as :attr:`TensorDesc.arena` names it.
    arena: int
    #: Its size in bytes.
    size: int


class Block(NamedTuple):
    """A block of the receiver's arena that the sender has finished reading: the
    receiver may reuse it."""

    #: Id of the receiver's arena.
    arena: int
    #: Byte offset of the block (as in :attr:`TensorDesc.offset`).
    offset: int


class ArenaControl(NamedTuple):
    """The arena bookkeeping that rides with a frame, in either direction (None in a
    frame that has nothing to say)."""

    #: The sender's new arenas; their descriptors come with the frame, in this order.
    new_arenas: list[NewArena]
    #: The receiver's blocks the sender has released.
    releases: list[Block]
