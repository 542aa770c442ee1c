"""pdserve.backends.python.messages: every server <-> worker record round-trips through
the frame codec of pdserve.backends.python.messages and pdserve.shm."""

from __future__ import annotations

import pickle
import socket
from typing import Any

import pytest

from pdserve import shm
from pdserve.backends.python import messages as m
from pdserve.core.errors import ErrorCode

IMAGE = shm.TensorDesc("<f4", (1, 3, 224, 224), None, 2, 4096, 602112)
SMALL = shm.TensorDesc("<i8", (2,), b"\x01\x00\x00\x00\x00\x00\x00\x00" * 2)
TEXT = shm.TensorDesc("BYTES", (1,), b"\x02\x00\x00\x00hi")
INVALID = m.Error("input 'X' is odd", ErrorCode.INVALID_ARG.value)

#: One of each message kind, with every optional part present and absent.
MESSAGES: list[Any] = [
    m.Ready(pid=4242),
    m.InitError("ImportError: no module named 'cv2'"),
    m.AutoCompleteResult({"name": "m", "max_batch_size": 8, "input": []}, None),
    m.AutoCompleteResult(None, "ValueError: bad dims"),
    m.Exec(
        7,
        [
            m.Request("req-1", {"p": 1, "s": "x"}, {"IMAGE": IMAGE, "N": SMALL}, ["OUT"]),
            m.Request("", {}, {}, []),
        ],
    ),
    m.Exec(8, []),
    m.Result(7, [{"OUT": IMAGE, "T": TEXT}, INVALID, {}], None),
    m.Result(8, None, m.Error("Failed to process the request(s)", ErrorCode.INTERNAL.value)),
    m.Bls(3, "preprocess", "", "r", {"timeout": 5}, {"JPEG": TEXT}, ["PIXELS"]),
    m.Bls(4, "m", "2", "", {}, {}, []),
    m.BlsResult(3, {"PIXELS": IMAGE}, None),
    m.BlsResult(4, None, m.Error("model 'x' is not found", ErrorCode.NOT_FOUND.value)),
    m.Bls(5, "stream", "", "", {}, {"IN": SMALL}, [], True),
    m.BlsResult(5, {"OUT": SMALL}, None, False),
    m.BlsResult(5, {}, None, True),
    m.Stop(),
    m.Cancel(3, 1),
    m.Respond(2, 0, {"OUT": SMALL, "T": TEXT}, False),
    m.Respond(2, 1, m.Error("boom", ErrorCode.INTERNAL.value), True),
    m.Respond(2, 2, None, True),
    m.Respond(2, 3, {"T": TEXT}, False, {"finish_reason": "stop", "completion_tokens": 7}),
    m.CancelStream(2, 1),
]

CONTROLS = [
    None,
    shm.ArenaControl([shm.NewArena(0, 8 << 20), shm.NewArena(1, 16 << 20)], []),
    shm.ArenaControl([], [shm.Block(0, 64), shm.Block(1, 0)]),
]


def _types(value: Any) -> Any:
    """``value`` with the type of every record and container spelled out, so that
    equality also compares types (a NamedTuple equals a plain tuple)."""
    if isinstance(value, tuple):
        return (type(value).__name__, [_types(v) for v in value])
    if isinstance(value, list):
        return ["list", [_types(v) for v in value]]
    if isinstance(value, dict):
        return ["dict", {k: _types(v) for k, v in value.items()}]
    return value


@pytest.mark.parametrize("message", MESSAGES, ids=lambda msg: type(msg).__name__)
@pytest.mark.parametrize("control", CONTROLS, ids=["no-control", "new-arenas", "releases"])
def test_each_record_round_trips_through_the_frame_codec(message: Any, control: Any) -> None:
    data = m.encode_frame(message, control)
    reader = shm.FrameReader()
    # fed in two pieces: the reader waits for the whole frame
    reader.feed(data[:5], [])
    assert m.read_frames(reader) == []
    reader.feed(data[5:], [])
    (frame,) = m.read_frames(reader)
    assert isinstance(frame, m.Frame)
    assert _types(frame.message) == _types(message)
    assert _types(frame.control) == _types(control)


def test_the_wire_form_is_plain_tuples() -> None:
    """Frames name no class: pickle builds them in C on both sides (and a frame
    cannot make the reader import anything)."""
    for message in MESSAGES:
        payload = m.encode_frame(message, CONTROLS[2])[4:]
        assert b"pdserve" not in payload and b"messages" not in payload
        assert type(pickle.loads(payload)) is tuple


def test_error_codes_cross_unchanged() -> None:
    for code in ErrorCode:
        value = code.triton_code.value
        data = m.encode_frame(m.Result(1, [m.Error("x", value)], None))
        reader = shm.FrameReader()
        reader.feed(data, [])
        (frame,) = m.read_frames(reader)
        assert isinstance(frame.message, m.Result) and frame.message.responses is not None
        (error,) = frame.message.responses
        assert isinstance(error, m.Error)
        assert ErrorCode.from_triton(error.code) is code.triton_code


def test_frames_on_a_socket_in_order() -> None:
    a, b = socket.socketpair()
    try:
        for message in MESSAGES:
            m.send_frame(a, message, CONTROLS[2])
        reader = shm.FrameReader()
        frames: list[m.Frame] = []
        while len(frames) < len(MESSAGES):
            data, anc, _, _ = b.recvmsg(1 << 16, shm.ANCILLARY_SPACE)
            reader.feed(data, anc)
            frames += m.read_frames(reader)
        assert [_types(f.message) for f in frames] == [_types(msg) for msg in MESSAGES]
    finally:
        a.close()
        b.close()


def test_worker_init_pickles_for_the_process_start() -> None:
    init = m.WorkerInit(
        mode="serve",
        model_file="/r/m/1/model.py",
        version_dir="/r/m/1",
        model_dir="/r/m",
        model_name="m",
        model_version=1,
        model_config='{"name": "m"}',
        instance_name="m_0_0",
        cpu_cores=[0, 1],
    )
    again = pickle.loads(pickle.dumps(init))
    assert again == init and type(again) is m.WorkerInit
    assert (again.instance_kind, again.device_id) == ("CPU", 0)


def test_what_is_not_a_message_is_refused() -> None:
    with pytest.raises(KeyError):
        m.encode_frame(("exec", 1, []))  # type: ignore[arg-type]  # the old tuple form
    with pytest.raises(KeyError):
        m.encode_frame(shm.TensorDesc("<f4", (), b""))  # type: ignore[arg-type]  # a part
