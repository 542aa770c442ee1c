"""Shared memory between two processes of one server: memfd arenas and a framed socket.

Tensors cross a process boundary through *arenas*: ``memfd_create`` memory handed to
the other process as a descriptor over an ``AF_UNIX`` socketpair (``SCM_RIGHTS``); the
kernel frees it with the last descriptor and mapping, so nothing is left behind.

- :mod:`.records`: the records that ride with a frame (tensor, arena, block, control).
- :mod:`.arenas`: one arena and its first-fit allocator.
- :mod:`.tensors`: copy a tensor into an arena once; read it back as a view.
- :mod:`.pools`: the arenas one side writes and the peer's arenas it reads.
- :mod:`.framing`: length-prefixed pickle frames, descriptors with them, and
  :class:`~.framing.FramedSocket` (one end on an event loop).

Used (``from pdserve import shm``) by the python backend and the HTTP front-end workers.
"""

from pdserve.shm.arenas import Arena, FreeListAllocator
from pdserve.shm.framing import (
    ANCILLARY_SPACE,
    RECV_BYTES,
    FramedSocket,
    FrameReader,
    apply_control,
    encode_payload,
    send_payload,
)
from pdserve.shm.pools import ArenaPool, PeerArenas, outgoing_control
from pdserve.shm.records import ArenaControl, Block, NewArena, TensorDesc
from pdserve.shm.tensors import INLINE_MAX, read_tensor, write_tensor

__all__ = [
    "ANCILLARY_SPACE",
    "INLINE_MAX",
    "RECV_BYTES",
    "Arena",
    "ArenaControl",
    "ArenaPool",
    "Block",
    "FrameReader",
    "FramedSocket",
    "FreeListAllocator",
    "NewArena",
    "PeerArenas",
    "TensorDesc",
    "apply_control",
    "encode_payload",
    "outgoing_control",
    "read_tensor",
    "send_payload",
    "write_tensor",
]
