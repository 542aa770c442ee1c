"""Shared memory between two processes of one server: memfd arenas and a framed socket.

Tensors cross a process boundary through *arenas*: anonymous shared memory made with
``memfd_create`` and handed to the other process as a file descriptor over an
``AF_UNIX`` socketpair (``SCM_RIGHTS``). A memfd has no name that can be left behind:
the kernel frees it when the last descriptor and mapping are gone.

- :mod:`.records`: the arena records that ride with a frame (tensor descriptor, new
  arena, released block, the control that carries them).
- :mod:`.arenas`: one arena and its first-fit allocator.
- :mod:`.tensors`: copy a tensor into an arena once; read it back as a view.
- :mod:`.pools`: the arenas one side writes (:class:`~.pools.ArenaPool`) and the
  peer's arenas it reads (:class:`~.pools.PeerArenas`).
- :mod:`.framing`: length-prefixed pickle frames, descriptors with them, and
  :class:`~.framing.FramedSocket` (one end on an event loop).

Used by the python backend and its worker, and by the HTTP front-end workers' channel,
through this package's names (``from pdserve import shm``; ``shm.write_tensor``).
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
