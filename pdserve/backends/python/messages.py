"""The messages between the server and a python worker, each declared once.

:mod:`~pdserve.backends.python.backend` (the server side) and
:mod:`~pdserve.backends.python.worker` build and read these records; nothing else
crosses the worker's socket. Every frame (:func:`encode_frame`) carries one message
and the :class:`~pdserve.shm.records.ArenaControl` that rides along with it.

Server -> worker: :class:`Exec`, :class:`BlsResult`, :class:`CancelStream`, :class:`Stop`,
:class:`ReadyCheck`. Worker -> server: :class:`Ready`, :class:`InitError`, :class:`Result`,
:class:`Bls`, :class:`AutoCompleteResult`, :class:`Respond`, :class:`ReadyState`. :class:`WorkerInit`: start-up data.

Records are ``NamedTuple`` s; on the wire they are plain tuples (:func:`to_wire`,
:func:`from_wire`), which pickle and load in C. Error codes are Triton's
``TRITONSERVER_Error_Code`` values, carried unchanged.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from pdserve.shm.framing import FrameReader, encode_payload, send_payload
from pdserve.shm.records import ArenaControl, Block, NewArena, TensorDesc

# --------------------------------------------------------------------------- parts


class Error(NamedTuple):
    """A failure, as Triton reports it."""

    #: What went wrong (the client sees it).
    message: str
    #: Triton's ``TRITONSERVER_Error_Code`` (``pb_utils.TritonError`` code, the value of
    #: a :class:`pdserve.core.errors.ErrorCode`).
    code: int


class Request(NamedTuple):
    """One inference request of an :class:`Exec` batch (a ``pb_utils.InferenceRequest``
    in the worker)."""

    #: The request's ``id`` ("" when the client gave none).
    id: str
    #: The request's ``parameters``.
    parameters: dict[str, object]
    #: Input tensors by name, in the sender's arenas; valid until the worker answers
    #: the batch (the server frees them then).
    inputs: dict[str, TensorDesc]
    #: Outputs the client asked for (empty: all).
    output_names: list[str]
    #: The W3C ``traceparent`` of the worker's ``execute`` span when the request is
    #: traced ("" otherwise): ``request.trace().get_context()`` in the model.
    trace: str = ""


# --------------------------------------------------------------------------- messages


class WorkerInit(NamedTuple):
    """What a worker process is started with (its ``multiprocessing`` argument)."""

    #: ``"serve"``: run the model; ``"autocomplete"``: call its
    #: ``auto_complete_config``, answer :class:`AutoCompleteResult` and exit.
    mode: str
    #: Path of ``model.py``.
    model_file: str
    #: The version folder (first on ``sys.path``).
    version_dir: str
    #: The model folder (on ``sys.path``; ``args["model_repository"]``).
    model_dir: str
    #: The model's name.
    model_name: str
    #: The model version.
    model_version: int
    #: The model configuration as Triton's JSON (``args["model_config"]``).
    model_config: str
    #: The instance's name (``args["model_instance_name"]``).
    instance_name: str
    #: ``"CPU"``, ``"GPU"`` or ``"MODEL"`` (``args["model_instance_kind"]``).
    instance_kind: str = "CPU"
    #: The instance's device id (``args["model_instance_device_id"]``).
    device_id: int = 0
    #: CPU ids to pin the process to (its host policy), or None.
    cpu_cores: list[int] | None = None
    #: The server's pid: the worker exits when that process is gone (0: no watch).
    server_pid: int = 0
    #: ``KIND_GPU``: the worker's ``CUDA_VISIBLE_DEVICES``, set before ``model.py`` is
    #: imported, so that it sees only its own GPU (None: inherited unchanged).
    cuda_visible_devices: str | None = None


class Ready(NamedTuple):
    """Worker -> server: ``initialize`` returned; the worker waits for :class:`Exec`."""

    #: The worker's process id.
    pid: int
    #: The model defines ``is_ready()`` (the server asks it with :class:`ReadyCheck`).
    has_is_ready: bool = False


class ReadyCheck(NamedTuple):
    """Server -> worker: call the model's ``is_ready()`` between two batches and
    answer :class:`ReadyState`."""

    #: Identifies the check; the answer repeats it.
    check_id: int


class ReadyState(NamedTuple):
    """Worker -> server: what ``is_ready()`` returned (``bool(...)``), or what it raised."""

    #: The :attr:`ReadyCheck.check_id` answered.
    check_id: int
    #: Its truth value (False when it raised).
    ready: bool
    #: The exception, as ``"Type: message"``, or None.
    error: str | None = None


class InitError(NamedTuple):
    """Worker -> server: importing ``model.py`` or ``initialize`` failed; the worker exits."""

    #: The exception, as ``"Type: message"``.
    message: str


class AutoCompleteResult(NamedTuple):
    """Worker -> server: the answer to a ``mode="autocomplete"`` start."""

    #: The configuration (Triton's JSON as a dict) after ``auto_complete_config``;
    #: None when it failed.
    config: dict[str, object] | None
    #: The exception, as ``"Type: message"``, or None.
    error: str | None
    #: What raised (or ran last): ``"import"`` (importing ``model.py``) or
    #: ``"auto_complete_config"``.
    stage: str = "auto_complete_config"


class Exec(NamedTuple):
    """Server -> worker: run one ``execute(requests)`` call on these requests."""

    #: Identifies the batch; :class:`Result` repeats it.
    batch_id: int
    #: The requests, in the order of the call's list.
    requests: list[Request]


class Result(NamedTuple):
    """Worker -> server: the outcome of an :class:`Exec`."""

    #: The :attr:`Exec.batch_id` answered.
    batch_id: int
    #: One entry per request, in order: its output tensors by name (in the worker's
    #: arenas; the server releases each when its last view is gone), or the
    #: :class:`Error` of that request's response. None when :attr:`error` is set.
    responses: list[dict[str, TensorDesc] | Error] | None
    #: ``execute`` raised or returned something else than one response per request:
    #: every request of the batch fails with this error.
    error: Error | None
    #: ``time.monotonic_ns()`` when ``execute`` was called and when it returned (the
    #: worker's execute span of a traced request); None when not measured.
    exec_ns: tuple[int, int] | None = None


class Bls(NamedTuple):
    """Worker -> server: a BLS request (``pb_utils.InferenceRequest.exec()``) to run
    through the server core."""

    #: Identifies the call; :class:`BlsResult` repeats it.
    call_id: int
    #: The model to run.
    model_name: str
    #: Its version ("": the version policy's latest).
    version: str
    #: The request's ``id``.
    request_id: str
    #: The request's ``parameters`` (``timeout`` included when set).
    parameters: dict[str, object]
    #: Input tensors by name, in the worker's arenas (released once read).
    inputs: dict[str, TensorDesc]
    #: Outputs asked for (empty: all).
    output_names: list[str]
    #: The ``traceparent`` of the request's trace context (``trace=request.trace()``),
    #: "" when the call is not traced.
    trace: str = ""
    #: ``exec(decoupled=True)``: every response comes back (several :class:`BlsResult`,
    #: the last one ``final``).
    decoupled: bool = False


class BlsResult(NamedTuple):
    """Server -> worker: the answer to a :class:`Bls`."""

    #: The :attr:`Bls.call_id` answered.
    call_id: int
    #: Output tensors by name, in the server's arenas (released when the worker's last
    #: view is gone); None on error.
    outputs: dict[str, TensorDesc] | None
    #: Why the call failed, or None.
    error: Error | None
    #: The call's last answer (always, unless :attr:`Bls.decoupled`); a decoupled
    #: call's final flag alone comes as ``outputs={}``.
    final: bool = True


class Stop(NamedTuple):
    """Server -> worker: call ``finalize()`` and exit."""


class Cancel(NamedTuple):
    """Server -> worker: request ``position`` of batch ``batch_id`` was cancelled (client
    gone, gRPC cancel or deadline, ``timeout`` expired): its ``request.is_cancelled()``
    turns True."""

    #: The :attr:`Exec.batch_id` of the request.
    batch_id: int
    #: Its position in the batch's requests.
    position: int


class Respond(NamedTuple):
    """Worker -> server: one response of a decoupled model
    (``response_sender.send(response, flags)``), from ``execute`` or any thread."""

    #: The :attr:`Exec.batch_id` of the request's batch.
    batch_id: int
    #: The request's index in that batch.
    slot: int
    #: Output tensors by name (in the worker's arenas), the response's :class:`Error`,
    #: or None: no response, only the flag (``send(flags=FINAL)``).
    outputs: dict[str, TensorDesc] | Error | None
    #: ``TRITONSERVER_RESPONSE_COMPLETE_FINAL`` was set: the request's last message.
    final: bool
    #: The response's parameters (``InferenceResponse(parameters=...)``), or None.
    parameters: dict[str, object] | None = None


class CancelStream(NamedTuple):
    """Server -> worker: the server no longer wants responses to this decoupled
    request (client gone, timeout): its sender is closed and ``is_cancelled()`` is True."""

    #: The :attr:`Exec.batch_id` of the request's batch.
    batch_id: int
    #: The request's index in that batch.
    slot: int


#: Every message a frame may carry.
Message = (
    Ready
    | InitError
    | AutoCompleteResult
    | Exec
    | Result
    | Bls
    | BlsResult
    | Stop
    | Cancel
    | Respond
    | CancelStream
    | ReadyCheck
    | ReadyState
)


class Frame(NamedTuple):
    """A received frame (what :func:`read_frames` returns)."""

    #: The message.
    message: Message
    #: The arena bookkeeping that came with it (apply it before reading the
    #: message's tensors), or None.
    control: ArenaControl | None


# --------------------------------------------------------------------------- wire form
#
# A frame's payload is the plain tuple ``(tag, fields, control)``: ``tag`` the message
# kind's index in _KINDS, ``fields`` the message's tuple with nested records as plain
# tuples too, ``control`` the ArenaControl's tuple of lists of tuples, or None. The
# decoders rebuild records with tuple.__new__ (C), which skips the Python __new__ of a
# NamedTuple; they trust the field count, as the sender is this module.

_new = tuple.__new__
_R = TypeVar("_R", bound=tuple[object, ...])

# The wire form of each record (what the *_to functions build, the *_from ones read).
_WireDesc = tuple[object, ...]  # a TensorDesc's fields
_WireDescs = dict[str, _WireDesc]
_WireError = tuple[object, ...]  # an Error's fields
_WireRequest = tuple[str, dict[str, object], _WireDescs, list[str], str]
_WireExec = tuple[int, list[_WireRequest]]
_WireResult = tuple[
    int, list[_WireDescs | _WireError] | None, _WireError | None, tuple[int, int] | None
]
_WireBls = tuple[int, str, str, str, dict[str, object], _WireDescs, list[str], str, bool]
_WireBlsResult = tuple[int, _WireDescs | None, _WireError | None, bool]
_WireRespond = tuple[
    int, int, _WireDescs | tuple[str, _WireError] | None, bool, dict[str, object] | None
]
_WireControl = tuple[list[tuple[int, ...]], list[tuple[int, ...]]]
#: A frame: (tag, the message's wire form, the arena control's or None).
Wire = tuple[int, tuple[object, ...], _WireControl | None]


def _exec_to(m: Exec) -> _WireExec:
    requests: list[_WireRequest] = []
    for r in m.requests:
        inputs: _WireDescs = {name: tuple(desc) for name, desc in r.inputs.items()}
        requests.append((r.id, r.parameters, inputs, r.output_names, r.trace))
    return (m.batch_id, requests)


def _exec_from(f: _WireExec) -> Exec:
    requests = []
    for r in f[1]:
        inputs = {name: _new(TensorDesc, desc) for name, desc in r[2].items()}
        requests.append(_new(Request, (r[0], r[1], inputs, r[3], r[4])))
    return _new(Exec, (f[0], requests))


def _result_to(m: Result) -> _WireResult:
    responses: list[_WireDescs | _WireError] | None = None
    if m.responses is not None:
        responses = []
        for r in m.responses:  # outputs: a dict; an error: a tuple
            if isinstance(r, Error):
                responses.append(tuple(r))
            else:
                responses.append({name: tuple(desc) for name, desc in r.items()})
    return (m.batch_id, responses, None if m.error is None else tuple(m.error), m.exec_ns)


def _result_from(f: _WireResult) -> Result:
    responses: list[dict[str, TensorDesc] | Error] | None = None
    if f[1] is not None:
        responses = []
        for r in f[1]:
            if type(r) is dict:
                responses.append({name: _new(TensorDesc, desc) for name, desc in r.items()})
            else:
                responses.append(_new(Error, r))
    return _new(Result, (f[0], responses, None if f[2] is None else _new(Error, f[2]), f[3]))


def _bls_to(m: Bls) -> _WireBls:
    inputs: _WireDescs = {name: tuple(desc) for name, desc in m.inputs.items()}
    return (
        m.call_id,
        m.model_name,
        m.version,
        m.request_id,
        m.parameters,
        inputs,
        m.output_names,
        m.trace,
        m.decoupled,
    )


def _bls_from(f: _WireBls) -> Bls:
    inputs = {name: _new(TensorDesc, desc) for name, desc in f[5].items()}
    return _new(Bls, (f[0], f[1], f[2], f[3], f[4], inputs, f[6], f[7], f[8]))


def _bls_result_to(m: BlsResult) -> _WireBlsResult:
    outputs: _WireDescs | None = None
    if m.outputs is not None:
        outputs = {name: tuple(desc) for name, desc in m.outputs.items()}
    return (m.call_id, outputs, None if m.error is None else tuple(m.error), m.final)


def _bls_result_from(f: _WireBlsResult) -> BlsResult:
    outputs = None
    if f[1] is not None:
        outputs = {name: _new(TensorDesc, desc) for name, desc in f[1].items()}
    error = None if f[2] is None else _new(Error, f[2])
    return _new(BlsResult, (f[0], outputs, error, f[3]))


def _respond_to(m: Respond) -> _WireRespond:
    out = m.outputs
    if type(out) is dict:
        wire: _WireDescs | tuple[str, _WireError] | None = {
            name: tuple(desc) for name, desc in out.items()
        }
    else:
        wire = None if out is None else ("error", tuple(out))
    return (m.batch_id, m.slot, wire, m.final, m.parameters)


def _respond_from(f: _WireRespond) -> Respond:
    wire = f[2]
    out: dict[str, TensorDesc] | Error | None = None
    if isinstance(wire, dict):
        out = {name: _new(TensorDesc, desc) for name, desc in wire.items()}
    elif wire is not None:
        out = _new(Error, wire[1])
    return _new(Respond, (f[0], f[1], out, f[3], f[4]))


def _flat(
    cls: type[_R],
) -> tuple[Callable[[_R], tuple[object, ...]], Callable[[tuple[object, ...]], _R]]:
    """Codec of a record without nested records: its own tuple."""
    return tuple, lambda f: _new(cls, f)


#: (record class, to wire, from wire); a kind's tag is its index. Each codec takes its
#: own record or wire form (hence ``...``: the table holds them all).
_KINDS: list[tuple[type[Message], Callable[..., tuple[object, ...]], Callable[..., Message]]] = [
    (Exec, _exec_to, _exec_from),
    (Result, _result_to, _result_from),
    (Bls, _bls_to, _bls_from),
    (BlsResult, _bls_result_to, _bls_result_from),
    (Ready, *_flat(Ready)),
    (InitError, *_flat(InitError)),
    (AutoCompleteResult, *_flat(AutoCompleteResult)),
    (Stop, *_flat(Stop)),
    (Cancel, *_flat(Cancel)),
    (Respond, _respond_to, _respond_from),
    (CancelStream, *_flat(CancelStream)),
    (ReadyCheck, *_flat(ReadyCheck)),
    (ReadyState, *_flat(ReadyState)),
]
_TAG: dict[type[Message], int] = {cls: tag for tag, (cls, _, _) in enumerate(_KINDS)}
_TO = [to for _, to, _ in _KINDS]
_FROM = [frm for _, _, frm in _KINDS]


def to_wire(message: Message, control: ArenaControl | None) -> Wire:
    """The plain-tuple form of a frame's content (what is pickled).

    Raises:
        KeyError: ``message`` is not one of the :data:`Message` records.
    """
    tag = _TAG[type(message)]
    if control is None:
        return (tag, _TO[tag](message), None)
    new_arenas = [tuple(a) for a in control.new_arenas]
    return (tag, _TO[tag](message), (new_arenas, [tuple(b) for b in control.releases]))


def from_wire(wire: Wire) -> Frame:
    """Inverse of :func:`to_wire`.

    Raises:
        IndexError, KeyError, TypeError, ValueError: not a frame of this module's format.
    """
    ctl = wire[2]
    control = None
    if ctl is not None:
        new_arenas = [_new(NewArena, a) for a in ctl[0]]
        control = _new(ArenaControl, (new_arenas, [_new(Block, b) for b in ctl[1]]))
    return _new(Frame, (_FROM[wire[0]](wire[1]), control))


def encode_frame(message: Message, control: ArenaControl | None = None) -> bytes:
    """A message and its arena control as one frame of
    :func:`pdserve.shm.framing.encode_payload`.

    Raises:
        KeyError: ``message`` is not a :data:`Message`.
    """
    return encode_payload(to_wire(message, control))


def read_frames(reader: FrameReader) -> list[Frame]:
    """Every complete frame ``reader`` has received so far, in order.

    Raises:
        pickle.UnpicklingError, IndexError, TypeError, ValueError: bytes that are
            not a frame of :func:`encode_frame`.
    """
    return [from_wire(wire) for wire in reader.payloads()]


def send_frame(
    sock: socket.socket,
    message: Message,
    control: ArenaControl | None = None,
    fds: list[int] | None = None,
) -> None:
    """Send one frame on a *blocking* socket, with ``fds`` attached to its first byte."""
    send_payload(sock, encode_frame(message, control), fds)
