"""Shared-memory arenas, tensor descriptors and framing of the python backend."""

from __future__ import annotations

import gc
import os
import socket

import numpy as np
import pytest

from pdserve.backends.python import shm
from pdserve.backends.python import triton_python_backend_utils as pb
from pdserve.core.errors import ErrorCode
from pdserve.frontends.http.status import http_status


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
    assert descs[0][2][0] == "s" and descs[2][2][0] == "i"  # tiny tensors ride inline
    announced, arenas = owner.take_announcements()
    peer.add(announced, [os.dup(a.fd) for a in arenas])
    owner.sent(arenas)
    got = [peer.read(d, release=True) for d in descs]
    np.testing.assert_array_equal(got[0], image)
    assert got[1].tolist() == strings.tolist() and got[1].dtype == object
    np.testing.assert_array_equal(got[2], tiny)
    # a view shares the writer's memory: no copy on the way in
    arena, _ = owner.arenas[descs[0][2][1]]
    first = np.frombuffer(arena.mm, dtype=np.float32, count=1, offset=descs[0][2][2])
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
    assert peer.take_releases() == [(descs[0][2][1], descs[0][2][2])]
    owner.free_many(releases)
    peer.close()
    owner.close()


def test_a_full_pool_grows_with_a_new_arena() -> None:
    pool = shm.ArenaPool("grow", max_bytes=64 * 1024 * 1024)
    first = pool.alloc(shm.DEFAULT_ARENA_BYTES - 64)
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
        shm.send_frame(a, ("msg", 1, {"nfds": 1}), [arena.fd])
        shm.send_frame(a, ("msg", 2, {}))
        reader = shm.FrameReader()
        frames: list = []
        while len(frames) < 2:
            data, anc, _, _ = b.recvmsg(1 << 16, shm.ANCILLARY_SPACE)
            reader.feed(data, anc)
            frames += reader.frames()
        assert [f[1] for f in frames] == [1, 2]
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
