"""The HTTP front-end workers' channel (:mod:`pdserve.frontends.workers.channel`): the
wire forms of requests, responses, errors and arena bookkeeping, and two real
:class:`Channel` ends on a socketpair in one process (tensors inline and through
memfd arenas, blocks released back to their writer, coalesced frames, end of file)."""

from __future__ import annotations

import asyncio
import gc
import pickle
import socket
from typing import Any

import numpy as np
import pytest

from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.types import InferRequest, InferResponse, RequestedOutput
from pdserve.frontends.shared_memory import ShmInput
from pdserve.frontends.workers import channel as ch
from pdserve.shm import ArenaControl, Block, NewArena


def _inline_write(arr: np.ndarray) -> Any:
    from pdserve import shm

    return tuple(shm.write_tensor(arr, lambda n: None))


def _inline_read(desc: Any) -> np.ndarray:
    from pdserve import shm
    from pdserve.shm import TensorDesc

    return shm.read_tensor(TensorDesc(*desc), {})


def test_request_round_trip_keeps_every_field() -> None:
    req = InferRequest(
        model_name="m",
        model_version="3",
        inputs={
            "A": np.arange(6, dtype=np.float32).reshape(2, 3),
            "S": np.array([b"x", b"yz"], dtype=object),
        },
        outputs=[RequestedOutput("O", binary_data=True, classification=2, parameters={"p": 1})],
        id="r1",
        parameters={"priority": 2, "timeout": 100},
        arrival_ns=123,
        route_key="k",
        pinned_version="2",
        traceparent=b"00-abc",
        shm_inputs={"B": ShmInput("FP32", [4], 4, "reg", 16, 64)},
    )
    req.cancelled = object()  # stays behind
    wire = pickle.loads(pickle.dumps(ch.request_to_wire(req, _inline_write), protocol=5))
    back = ch.request_from_wire(wire, _inline_read)
    assert back.model_name == "m" and back.model_version == "3" and back.id == "r1"
    np.testing.assert_array_equal(back.inputs["A"], req.inputs["A"])
    assert back.inputs["A"].dtype == np.float32
    assert list(back.inputs["S"]) == [b"x", b"yz"]
    assert back.outputs == req.outputs
    assert back.parameters == {"priority": 2, "timeout": 100}
    assert (back.arrival_ns, back.route_key, back.pinned_version) == (123, "k", "2")
    assert back.traceparent == b"00-abc"
    assert back.shm_inputs == req.shm_inputs
    assert back.cancelled is None and back.trace is None


def test_request_with_all_outputs_and_response_round_trip() -> None:
    req = InferRequest("m")
    back = ch.request_from_wire(ch.request_to_wire(req, _inline_write), _inline_read)
    assert back.outputs is None and back.inputs == {}
    resp = InferResponse("m", "1", {"O": np.ones((2, 2), np.int64)}, "id", {"x": "y"})
    rback = ch.response_from_wire(ch.response_to_wire(resp, _inline_write), _inline_read)
    assert (rback.model_name, rback.model_version, rback.id, rback.parameters) == (
        "m",
        "1",
        "id",
        {"x": "y"},
    )
    np.testing.assert_array_equal(rback.outputs["O"], np.ones((2, 2), np.int64))


def test_error_round_trip_keeps_code_reason_and_http_extras() -> None:
    err = InferError("slow down", ErrorCode.RESOURCE_EXHAUSTED, "RATE")
    err.retry_after = 3  # type: ignore[attr-defined]  # as the rate limiter sets it
    err.http_headers = [(b"www-authenticate", b"Bearer")]  # type: ignore[attr-defined]
    back = ch.error_from_wire(pickle.loads(pickle.dumps(ch.error_to_wire(err))))
    assert (back.message, back.code, back.reason) == ("slow down", err.code, "RATE")
    assert back.retry_after == 3  # type: ignore[attr-defined]
    assert back.http_headers == [(b"www-authenticate", b"Bearer")]  # type: ignore[attr-defined]
    plain = ch.error_from_wire(ch.error_to_wire(InferError("bad")))
    assert not hasattr(plain, "retry_after") and plain.code is ErrorCode.INVALID_ARG


def test_control_round_trip() -> None:
    assert ch.control_from_wire(ch.control_to_wire(None)) is None
    ctl = ArenaControl([NewArena(1, 4096)], [Block(0, 64), Block(2, 128)])
    assert ch.control_from_wire(ch.control_to_wire(ctl)) == ctl


def test_calls_are_a_closed_list() -> None:
    assert "infer" not in ch.CALLS and "stop" not in ch.CALLS
    assert {"ready", "model_statistics", "shm.register", "gate.check"} <= ch.CALLS


async def _pair() -> tuple[ch.Channel, ch.Channel, list[Any], list[Any], list[str]]:
    a_sock, b_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    got_a: list[Any] = []
    got_b: list[Any] = []
    closed: list[str] = []
    a = ch.Channel(a_sock, "test.a", lambda k, b: got_a.append((k, b)), lambda: closed.append("a"))
    b = ch.Channel(b_sock, "test.b", lambda k, b: got_b.append((k, b)), lambda: closed.append("b"))
    return a, b, got_a, got_b, closed


async def _until(cond: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.001)


def test_channel_tensors_inline_and_through_arenas_and_release() -> None:
    async def run() -> None:
        a, b, _got_a, got_b, _ = await _pair()
        small = np.arange(16, dtype=np.float32)
        large = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32)  # 256 KiB
        words = np.array([b"a" * 40000, b"b"], dtype=object)
        req = InferRequest("m", inputs={"S": small, "L": large, "W": words})
        a.send(ch.INFER, (7, ch.request_to_wire(req, a.write)))
        await _until(lambda: got_b)
        kind, (call_id, wire) = got_b.pop()
        assert (kind, call_id) == (ch.INFER, 7)
        assert wire[2]["S"][2] is not None  # inline
        assert wire[2]["L"][2] is None  # in a's arena
        back = ch.request_from_wire(wire, b.read)
        np.testing.assert_array_equal(back.inputs["S"], small)
        np.testing.assert_array_equal(back.inputs["L"], large)
        assert list(back.inputs["W"]) == [b"a" * 40000, b"b"]
        ((arena, allocator),) = a.pool.arenas.values()
        assert allocator.used_bytes > 0  # L (W's block was released once rebuilt)
        del back
        gc.collect()
        b.send(ch.RESULT, (7, None))  # the release rides on b's next frame
        await _until(lambda: allocator.used_bytes == 0)
        a.close()
        b.close()

    asyncio.run(run())


def test_channel_coalesces_a_turns_frames_and_sees_end_of_file() -> None:
    async def run() -> None:
        a, b, _got_a, got_b, closed = await _pair()
        sent: list[int] = []
        real_send = a.sock.send

        def counting_send(data: Any) -> int:
            sent.append(len(data))
            return real_send(data)

        a.sock = _SockProxy(a.sock, counting_send)  # type: ignore[assignment]
        for i in range(50):
            a.send(ch.RESULT, (i, {"n": i}))
        await _until(lambda: len(got_b) == 50)
        assert [body[0] for _, body in got_b] == list(range(50))
        assert len(sent) == 1  # one system call for the turn's 50 frames
        a.close()
        await _until(lambda: closed == ["b"])
        assert b.closed
        b.send(ch.RESULT, (0, None))  # ignored once closed

    asyncio.run(run())


class _SockProxy:
    def __init__(self, sock: socket.socket, send: Any) -> None:
        self._sock = sock
        self.send = send
        self.sendmsg = sock.sendmsg

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


@pytest.mark.parametrize("dtype", ["<f4", "<i8", "|u1", "|b1"])
def test_inline_read_is_a_view_of_the_right_dtype(dtype: str) -> None:
    async def run() -> None:
        a, b, *_ = await _pair()
        arr = np.arange(10).astype(np.dtype(dtype))
        out = b.read(a.write(arr))
        np.testing.assert_array_equal(out, arr)
        assert out.dtype == arr.dtype
        a.close()
        b.close()

    asyncio.run(run())


@pytest.mark.parametrize(
    "dtype", ["<f2", "<f4", "<f8", "<i1", "<i2", "<i4", "<i8", "<u2", "<u4", "<u8", "|b1", "<c8"]
)
def test_wire_forms_carry_small_tensors_inline_by_dtype_code(dtype: str) -> None:
    """request/response_to_wire write small native numeric tensors into the frame
    themselves (the dtype as its one-letter code), and the from_wire functions read
    them back as the same values and dtype; ``write``/``read`` are not called."""

    def no_write(arr: np.ndarray) -> Any:
        raise AssertionError("write called for an inline tensor")

    def no_read(desc: Any) -> np.ndarray:
        raise AssertionError("read called for an inline tensor")

    arr = (np.arange(12) % 2 if dtype == "|b1" else np.arange(12)).astype(dtype).reshape(3, 4)
    wire = ch.request_to_wire(InferRequest("m", "", {"X": arr}), no_write)
    assert wire[2]["X"][0] == np.dtype(dtype).char and wire[2]["X"][3:] == (-1, 0, 0)
    back = pickle.loads(pickle.dumps(wire, protocol=5))
    got = ch.request_from_wire(back, no_read).inputs["X"]
    assert got.dtype == arr.dtype and got.shape == (3, 4)
    np.testing.assert_array_equal(got, arr)
    resp = ch.response_to_wire(InferResponse("m", "1", {"Y": arr}), no_write)
    out = ch.response_from_wire(pickle.loads(pickle.dumps(resp)), no_read).outputs["Y"]
    assert out.dtype == arr.dtype
    np.testing.assert_array_equal(out, arr)


def test_wire_forms_hand_big_endian_bytes_and_large_tensors_to_write() -> None:
    """A non-native byte order, a BYTES tensor and one of SHM_MIN_BYTES or more go
    through the channel's ``write`` (the arena / general path), a plain list output is
    made an array first."""
    written: list[np.ndarray] = []

    def write(arr: np.ndarray) -> Any:
        written.append(arr)
        return _inline_write(arr)

    big_endian = np.arange(4, dtype=">i4")
    words = np.array([b"ab", b"c"], dtype=object)
    large = np.zeros(ch.SHM_MIN_BYTES // 4, np.float32)
    wire = ch.request_to_wire(
        InferRequest("m", "", {"A": big_endian, "B": words, "C": large}), write
    )
    assert [w.dtype for w in written] == [big_endian.dtype, words.dtype, large.dtype]
    got = ch.request_from_wire(wire, _inline_read).inputs
    np.testing.assert_array_equal(got["A"], big_endian)
    assert got["B"].tolist() == [b"ab", b"c"]
    assert got["C"].shape == large.shape
    resp = ch.response_to_wire(InferResponse("m", "1", {"L": [1.5, 2.5]}), write)  # type: ignore[dict-item]  # a list output, as a model may return
    out = ch.response_from_wire(resp, _inline_read).outputs["L"]
    assert out.tolist() == [1.5, 2.5] and out.dtype == np.float64


def test_a_turns_requests_and_the_answers_each_go_in_one_frame() -> None:
    """300 requests submitted in one loop turn (small ones inline, every 50th through
    the arena) leave in one frame and one system call; the answers of one turn come
    back the same way, each to its call id with its own data."""

    async def run() -> None:
        a, b, got_a, got_b, _ = await _pair()
        sends: dict[str, int] = {"a": 0, "b": 0}
        for name, end in (("a", a), ("b", b)):
            real_sock = end.sock

            def counting(*args: Any, name: str = name, real: Any = real_sock.send) -> int:
                sends[name] += 1
                return int(real(*args))

            def counting_msg(*args: Any, name: str = name, real: Any = real_sock.sendmsg) -> int:
                sends[name] += 1  # a frame that announces a new arena (its descriptor)
                return int(real(*args))

            proxy = _SockProxy(real_sock, counting)
            proxy.sendmsg = counting_msg
            end.sock = proxy  # type: ignore[assignment]
        sizes = [64 if i % 50 else 8192 for i in range(300)]  # 8192 FP32 = 32 KiB
        for i, n in enumerate(sizes):
            req = InferRequest("m", inputs={"X": np.full(n, i, np.float32)}, id=str(i))
            a.send(ch.INFER, (i, ch.request_to_wire(req, a.write)))
        await _until(lambda: len(got_b) == 300)
        assert sends["a"] == 1
        for kind, (call_id, wire) in got_b:
            req = ch.request_from_wire(wire, b.read)
            assert kind == ch.INFER and req.id == str(call_id)
            assert req.inputs["X"].shape == (sizes[call_id],)
            assert (req.inputs["X"] == call_id).all()
            resp = InferResponse("m", "1", {"Y": req.inputs["X"] * 2}, req.id)
            b.send(ch.RESPONSE, (call_id, ch.response_to_wire(resp, b.write)))
        await _until(lambda: len(got_a) == 300)
        assert sends["b"] == 1
        assert [body[0] for _, body in got_a] == list(range(300))
        for _, (call_id, wire) in got_a:
            out = ch.response_from_wire(wire, a.read).outputs["Y"]
            assert out.shape == (sizes[call_id],) and (out == 2 * call_id).all()
        a.close()
        b.close()

    asyncio.run(run())


def test_a_peer_dying_mid_frame_closes_the_channel_once_and_delivers_nothing() -> None:
    """The peer wrote whole frames, then half of one, then died: the whole ones are
    dispatched, the half one never is, ``on_close`` runs once and later sends are
    dropped."""

    async def run() -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        got: list[Any] = []
        closed: list[int] = []
        end = ch.Channel(
            mine, "test.dying", lambda k, b: got.append((k, b)), lambda: closed.append(1)
        )
        from pdserve import shm

        whole = shm.encode_payload((None, [(ch.RESULT, (1, "one")), (ch.RESULT, (2, "two"))]))
        half = shm.encode_payload((None, [(ch.RESULT, (3, "x" * 1000))]))[:500]
        theirs.sendall(whole + half)
        theirs.close()
        await _until(lambda: closed == [1])
        await asyncio.sleep(0.02)
        assert got == [(ch.RESULT, (1, "one")), (ch.RESULT, (2, "two"))]
        assert end.closed
        end.send(ch.RESULT, (4, None))  # ignored: nothing raises, nothing queued
        await asyncio.sleep(0.01)
        assert closed == [1]

    asyncio.run(run())
