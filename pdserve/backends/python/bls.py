"""BLS: a python worker's ``pb_utils.InferenceRequest(...).exec()`` comes back over its
socket and runs through the server core (``infer_on`` / ``infer_stream``), so it is
scheduled, batched and counted like any request; its result goes back to the worker."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Protocol

import numpy as np

from pdserve import shm
from pdserve.backends.python.messages import Bls, BlsResult, Error, Message
from pdserve.core import tracing
from pdserve.core.api import ModelRunner
from pdserve.core.cancel import CancelToken, parse_timeout_us
from pdserve.core.errors import ErrorCode, InferError, internal
from pdserve.core.types import InferRequest, RequestedOutput
from pdserve.shm import TensorDesc

log = logging.getLogger("pdserve.python")


class BlsHost(Protocol):
    """What a BLS call needs of the server's side of a worker connection."""

    name: str
    server: ModelRunner | None
    pool: shm.ArenaPool
    peer: shm.PeerArenas
    #: The running batch's cancellation tokens (:func:`bls_token`).
    batch_tokens: list[CancelToken | None]

    def send(self, message: Message) -> None: ...


def _bls_request(conn: BlsHost, call: Bls) -> tuple[ModelRunner, InferRequest]:
    """The core to run a BLS call through and the request it makes (its inputs views of
    the worker's arenas).

    Raises:
        InferError(INTERNAL): the model has no server to run it through.
    """
    if conn.server is None:
        raise internal("BLS is not available: the model has no server")
    return conn.server, InferRequest(
        model_name=call.model_name,
        model_version=call.version,
        inputs={name: conn.peer.read(desc, release=True) for name, desc in call.inputs.items()},
        outputs=[RequestedOutput(n) for n in call.output_names] or None,
        id=call.request_id,
        parameters=call.parameters,
    )


def _write(conn: BlsHost, outputs: dict[str, np.ndarray]) -> dict[str, TensorDesc]:
    """A response's outputs copied into the server's arenas for the worker."""
    return {name: shm.write_tensor(arr, conn.pool.alloc) for name, arr in outputs.items()}


async def run_bls(conn: BlsHost, call: Bls) -> None:
    """Run a BLS request from the worker through the server core, send the result."""
    call_id = call.call_id
    token: CancelToken | None = None

    if call.decoupled:
        await _run_bls_stream(conn, call)
        return
    try:
        server, request = _bls_request(conn, call)
        token = request.cancelled = bls_token(conn.batch_tokens, call.parameters)
        ref = tracing.ref_from_traceparent(call.trace) if call.trace else None
        if ref is not None:  # BLS with trace=request.trace(): a "bls" span, the model under it
            bls_start = time.monotonic_ns()
            bls_id = tracing.new_span_id()
            request.trace = tracing.TraceRef(ref.trace, bls_id)
        try:
            mv = server.model_version(call.model_name, call.version)
            response = await server.infer_on(mv, request)
        finally:
            if ref is not None:
                ref.trace.add(
                    "bls",
                    ref.parent_id,
                    bls_start,
                    time.monotonic_ns(),
                    {"pdserve.bls_model": call.model_name},
                    bls_id,
                )
        del request
        descs = _write(conn, response.outputs)
        conn.send(BlsResult(call_id, descs, None))
    except asyncio.CancelledError:
        raise
    except InferError as e:
        conn.send(BlsResult(call_id, None, Error(e.message, e.code.triton_code.value)))
    except Exception as e:  # a server fault still answers the worker
        log.exception("BLS call from %s failed", conn.name)
        error = Error(f"{type(e).__name__}: {e}", ErrorCode.INTERNAL.value)
        conn.send(BlsResult(call_id, None, error))
    finally:
        if token is not None:
            token.finish()


async def _run_bls_stream(conn: BlsHost, call: Bls) -> None:
    """A decoupled BLS call (``exec(decoupled=True)``): one :class:`BlsResult` per
    response of the target, the last one ``final`` (``outputs={}`` for a final flag
    sent alone, an error as the final answer)."""
    call_id = call.call_id
    final_sent = False
    try:
        server, request = _bls_request(conn, call)
        async with contextlib.aclosing(server.infer_stream(request)) as items:
            async for item in items:
                if item.error is not None:
                    error = Error(item.error.message, item.error.code.triton_code.value)
                    conn.send(BlsResult(call_id, None, error, item.final))
                else:
                    outputs = item.response.outputs if item.response is not None else {}
                    descs = _write(conn, outputs)
                    conn.send(BlsResult(call_id, descs, None, item.final))
                final_sent = item.final
    except asyncio.CancelledError:
        raise
    except InferError as e:
        if not final_sent:
            error = Error(e.message, e.code.triton_code.value)
            conn.send(BlsResult(call_id, None, error, True))
    except Exception as e:  # a server fault still answers the worker
        log.exception("decoupled BLS call from %s failed", conn.name)
        if not final_sent:
            error = Error(f"{type(e).__name__}: {e}", ErrorCode.INTERNAL.value)
            conn.send(BlsResult(call_id, None, error, True))


def bls_token(parents: list[CancelToken | None], parameters: dict[str, object]) -> CancelToken:
    """The cancellation token of a BLS call made while a batch runs: cancelled once
    every request of that batch is (a batch of one: with its request; the same error),
    or when the call's own ``timeout`` parameter (µs) expires."""
    timeout_ns = parse_timeout_us(parameters) * 1000
    live = [t for t in parents if t is not None]
    if live and len(live) == len(parents):
        if len(live) == 1:
            return live[0].child(timeout_ns)
        token = CancelToken()
        left = [len(live)]

        def one_gone(parent: CancelToken) -> None:
            left[0] -= 1
            if left[0] == 0:
                token.cancel(parent.error)

        for t in live:
            t.add_callback(one_gone)
        if timeout_ns:
            token.set_deadline(timeout_ns)
        return token
    token = CancelToken()
    if timeout_ns:
        token.set_deadline(timeout_ns)
    return token
