"""Shared-memory arenas, tensor descriptors and framing (pdserve.shm) as the python backend uses them."""

from __future__ import annotations

import gc
import os
import socket
import struct

import numpy as np
import pytest

from pdserve import shm
from pdserve.backends.python import triton_python_backend_utils as pb
from pdserve.backends.python.messages import Ready, read_frames, send_frame
from pdserve.core.datatypes import serialize_bytes_tensor
from pdserve.core.errors import ErrorCode, InferError
from pdserve.frontends.http.status import http_status
from pdserve.shm import ArenaControl, NewArena, arenas, framing, pools, records, tensors


def test_free_list_allocator_reuses_and_coalesces() -> None:
    a = shm.FreeListAllocator(1024)
    x, y, z = a.alloc(100), a.alloc(100), a.alloc(100)
    assert (x, y, z) == (0, 128, 256)
    assert a.alloc(1024) is None
    a.free(y)
    assert a.alloc(64) == 128  # first fit
    a.free(128)
    a.free(x)
    a.free(z)
    assert a.used_bytes == 0
    assert a.alloc(1024) == 0  # everything merged back into one block


def test_tensors_round_trip_through_arenas() -> None:
    owner = shm.ArenaPool("test")
    peer = shm.PeerArenas()
    image = np.random.default_rng(0).standard_normal((3, 224, 224), dtype=np.float32)
    strings = np.array([[b"abc" * 200, b""], [b"\x00\xff", "h\u00e9".encode()]], dtype=object)
    tiny = np.arange(3, dtype=np.int64)
    descs = [shm.write_tensor(t, owner.alloc) for t in (image, strings, tiny)]
    assert descs[0].inline is None and descs[2].inline is not None  # tiny ones ride inline
    announced, arenas = owner.take_announcements()
    peer.add(announced, [os.dup(a.fd) for a in arenas])
    owner.sent(arenas)
    got = [peer.read(d, release=True) for d in descs]
    np.testing.assert_array_equal(got[0], image)
    assert got[1].tolist() == strings.tolist() and got[1].dtype == object
    np.testing.assert_array_equal(got[2], tiny)
    # a view shares the writer's memory: no copy on the way in
    arena, _ = owner.arenas[descs[0].arena]
    first = np.frombuffer(arena.mm, dtype=np.float32, count=1, offset=descs[0].offset)
    first[0] = 42.0
    assert got[0][0, 0, 0] == 42.0
    # releases come once the last view is gone
    releases = peer.take_releases()
    assert len(releases) == 1  # the BYTES block, released at once
    view = got[0][1:2]
    del got, first
    gc.collect()
    assert peer.take_releases() == []
    del view
    gc.collect()
    assert peer.take_releases() == [(descs[0].arena, descs[0].offset)]
    owner.free_many(releases)
    peer.close()
    owner.close()


def test_a_full_pool_grows_with_a_new_arena() -> None:
    pool = shm.ArenaPool("grow", max_bytes=64 * 1024 * 1024)
    first = pool.alloc(arenas.DEFAULT_ARENA_BYTES - 64)
    second = pool.alloc(20 * 1024 * 1024)
    assert first is not None and second is not None
    assert first[0].id != second[0].id and second[0].size >= 20 * 1024 * 1024
    assert pool.alloc(64 * 1024 * 1024) is None  # past max_bytes: the caller goes inline
    assert len(pool.take_announcements()[0]) == 2
    pool.close()


def test_frames_carry_descriptors() -> None:
    a, b = socket.socketpair()
    try:
        arena = shm.Arena.create(0, 4096, "frame")
        arena.mm[:5] = b"hello"
        control = ArenaControl([NewArena(0, 4096)], [])
        send_frame(a, Ready(1), control, [arena.fd])
        send_frame(a, Ready(2))
        reader = shm.FrameReader()
        frames: list = []
        while len(frames) < 2:
            data, anc, _, _ = b.recvmsg(1 << 16, shm.ANCILLARY_SPACE)
            reader.feed(data, anc)
            frames += read_frames(reader)
        assert [f.message for f in frames] == [Ready(1), Ready(2)]
        assert [f.control for f in frames] == [control, None]
        (fd,) = reader.take_fds(1)
        other = shm.Arena.attach(0, 4096, fd)
        assert bytes(other.mm[:5]) == b"hello"
        other.close()
        arena.close()
        with pytest.raises(RuntimeError):
            reader.take_fds(1)
    finally:
        a.close()
        b.close()


def test_pb_utils_model_config_helpers() -> None:
    config = pb.ModelConfig('{"name": "m", "input": [], "output": [], "max_batch_size": 0}')
    config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [4]})
    config.add_input({"name": "X", "data_type": "TYPE_FP32", "dims": [4]})  # same: no-op
    with pytest.raises(ValueError, match="configuration expects datatype TYPE_FP32"):
        config.add_input({"name": "X", "data_type": "TYPE_INT32", "dims": [4]})
    with pytest.raises(ValueError, match="missing 'dims'"):
        config.add_output({"name": "Y", "data_type": "TYPE_FP32"})
    config.set_max_batch_size(8)
    config.set_dynamic_batching()
    assert config.as_dict()["max_batch_size"] == 8 and config.as_dict()["dynamic_batching"] == {}
    assert pb.triton_string_to_numpy("TYPE_FP16") is np.float16
    assert pb.numpy_to_triton_type(np.object_) == 13
    invalid = pb.TritonError("x", pb.TritonError.INVALID_ARG).code()
    assert http_status(ErrorCode.from_triton(invalid)) == 400
    assert http_status(ErrorCode.from_triton(pb.TritonError("x").code())) == 500  # Triton's default
    with pytest.raises(pb.TritonModelException):
        pb.Tensor("s", np.array(["unicode"]))
    with pytest.raises(pb.TritonModelException, match="only available inside"):
        pb.InferenceRequest(model_name="m", requested_output_names=[], inputs=[]).exec()


def test_pb_utils_bytes_helpers_are_the_core_codec() -> None:
    array = np.array([[b"x", "\u00e9"]], dtype=object)
    assert pb.serialize_byte_tensor(array) == serialize_bytes_tensor(array)
    assert pb.serialize_byte_tensor(np.array([b"a", b"bc"])) == _elements(b"a", b"bc")
    assert pb.serialize_byte_tensor(np.empty(0, dtype=object)) == ()  # as Triton
    assert pb.serialize_byte_tensor(np.zeros(3, dtype=np.float32)) is None  # as Triton
    out = pb.deserialize_bytes_tensor(_elements(b"x", b"\xc3\xa9"))
    assert out.dtype == object and out.tolist() == [b"x", b"\xc3\xa9"]
    with pytest.raises(InferError, match="truncated"):
        pb.deserialize_bytes_tensor(struct.pack("<I", 3) + b"a")


def _elements(*items: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(i)) + i for i in items)


# --------------------------------------------------------------------------- FramedSocket


async def _until(cond: object, timeout: float = 5.0) -> None:
    import asyncio

    async with asyncio.timeout(timeout):
        while not cond():  # type: ignore[operator]  # a callable
            await asyncio.sleep(0.001)


def test_framed_socket_reads_frames_split_anywhere_and_sees_end_of_file() -> None:
    """Bytes arrive in pieces cut inside the length header and inside the pickle: a
    payload is delivered once, whole and in order; end of file is reported once."""
    import asyncio

    async def run() -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        got: list[list[object]] = []
        eofs: list[int] = []
        link = shm.FramedSocket(mine, "test.fs", got.append, lambda: eofs.append(1))
        data = b"".join(shm.encode_payload(("p", i, b"x" * i)) for i in range(5))
        # cuts inside the first header, inside a pickle, and one byte before the end
        pieces = [data[:2], data[2:9], data[9:60], data[60:-1], data[-1:]]
        for piece in pieces:
            theirs.sendall(piece)
            await asyncio.sleep(0.01)
        await _until(lambda: sum(len(g) for g in got) == 5)
        flat = [p for batch in got for p in batch]
        assert flat == [("p", i, b"x" * i) for i in range(5)]
        theirs.sendall(shm.encode_payload("half")[:6])  # the peer dies mid-frame
        theirs.close()
        await _until(lambda: eofs == [1])
        await asyncio.sleep(0.02)
        assert sum(len(g) for g in got) == 5  # the half frame is never delivered
        assert link.closed
        link.close()

    asyncio.run(run())


def test_framed_socket_queues_what_the_socket_does_not_take_and_passes_descriptors() -> None:
    """A frame far larger than the socket buffer goes out in pieces (the loop's writer),
    the frames queued behind it keep their order, and a new arena's descriptor rides
    with its frame."""
    import asyncio

    async def run() -> None:
        a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        got: list[object] = []
        a = shm.FramedSocket(a_sock, "test.fa", lambda ps: None, lambda: None)
        b = shm.FramedSocket(b_sock, "test.fb", got.extend, lambda: None)
        big = os.urandom(8 << 20)
        arena, offset = a.pool.alloc(1 << 20) or (None, 0)
        assert arena is not None
        a.send(lambda control: shm.encode_payload((control, "big", big)))
        assert a._writing  # the socket took only part of it
        a.send(lambda control: shm.encode_payload((control, "after")))
        await _until(lambda: len(got) == 2, timeout=20.0)
        (control, name, data), (control2, name2) = got  # type: ignore[misc]
        assert (name, name2) == ("big", "after") and data == big
        assert control is not None and [n.arena for n in control.new_arenas] == [arena.id]
        assert control2 is None
        b.peer.add(control.new_arenas, b.frames.take_fds(1))
        arena.mm[offset : offset + 4] = b"pdsv"  # the peer maps the same memory
        assert bytes(b.peer.arenas[arena.id].mm[offset : offset + 4]) == b"pdsv"
        assert not a._writing
        a.close()
        b.close()

    asyncio.run(run())


def test_the_package_names_are_its_modules_names() -> None:
    """``from pdserve import shm`` gives each module's public names."""
    assert shm.Arena is arenas.Arena and shm.FreeListAllocator is arenas.FreeListAllocator
    assert shm.write_tensor is tensors.write_tensor and shm.read_tensor is tensors.read_tensor
    assert shm.ArenaPool is pools.ArenaPool and shm.PeerArenas is pools.PeerArenas
    assert shm.FramedSocket is framing.FramedSocket and shm.FrameReader is framing.FrameReader
    assert shm.TensorDesc is records.TensorDesc and shm.ArenaControl is records.ArenaControl
    assert sorted(shm.__all__) == sorted(set(shm.__all__))
