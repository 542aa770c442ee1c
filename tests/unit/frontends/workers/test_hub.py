"""The hub (main process) and the worker's proxy over a real socketpair channel.

The core behind the hub is a small stand-in that answers each loop turn's requests
together (as the dynamic batcher does); the channel, the hub and the proxy are the
real ones (:mod:`pdserve.frontends.workers`).
"""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pdserve.core.cancel import CancelToken
from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.types import InferRequest, InferResponse, RequestedOutput
from pdserve.frontends.shared_memory import SharedMemoryRegistry
from pdserve.frontends.traffic.auth import load_auth_config
from pdserve.frontends.traffic.gate import TrafficGate
from pdserve.frontends.workers import channel as ch
from pdserve.frontends.workers.hub import FrontendHub
from pdserve.frontends.workers.proxy import ProxyCore, ProxyGate, WorkerClient
from tests.cyclic import collector_off
from tests.traffic_keys import sha256_hash


class _TurnCore:
    """Doubles INPUT0 into OUTPUT0, answering a loop turn's requests together.
    Model ``bad``: InferError(INVALID_ARG); ``boom``: ValueError; ``hang``: waits
    until the request is cancelled and records the token's error."""

    def __init__(self) -> None:
        self.pending: list[tuple[asyncio.Future[Any], InferRequest]] = []
        self.cancelled: list[Any] = []
        self.seen_tokens: list[Any] = []

    async def infer(self, request: InferRequest) -> InferResponse:
        self.seen_tokens.append(request.cancelled)
        if request.model_name == "bad":
            raise InferError("bad input", ErrorCode.INVALID_ARG)
        if request.model_name == "boom":
            raise ValueError("model crashed")
        loop = asyncio.get_running_loop()
        if request.model_name == "hang":
            token = request.cancelled
            assert isinstance(token, CancelToken)
            done: asyncio.Future[None] = loop.create_future()
            token.add_callback(lambda t: done.done() or done.set_result(None))
            await done
            self.cancelled.append(token.error)
            assert token.error is not None
            raise token.error.fresh()
        fut: asyncio.Future[Any] = loop.create_future()
        if not self.pending:
            loop.call_soon(self._flush)
        self.pending.append((fut, request))
        out = await fut
        return InferResponse(request.model_name, "1", {"OUTPUT0": out}, request.id)

    def live(self) -> bool:
        return True

    def _flush(self) -> None:
        pending, self.pending = self.pending, []
        for fut, request in pending:
            fut.set_result(request.inputs["INPUT0"] * 2)


async def _pair() -> tuple[FrontendHub, _TurnCore, WorkerClient, ProxyCore]:
    hub_sock, worker_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    core = _TurnCore()
    hub = FrontendHub(core, SharedMemoryRegistry(enabled=False))  # type: ignore[arg-type]  # the stand-in core implements infer only
    hub.attach(hub_sock, 0, lambda: None)
    client = WorkerClient()
    client.connect(lambda on_frame, on_close: ch.Channel(worker_sock, "t", on_frame, on_close))
    return hub, core, client, ProxyCore(client)


def _request(model: str, value: float, token: CancelToken | None = None) -> InferRequest:
    return InferRequest(model, "", {"INPUT0": np.full((1, 4), value, np.float32)}, cancelled=token)


def test_a_turns_requests_are_answered_in_order_with_their_own_values() -> None:
    async def run() -> None:
        hub, core, client, proxy = await _pair()
        loop = asyncio.get_running_loop()
        waits = [proxy.infer(_request("m", i, CancelToken(None, loop))) for i in range(40)]
        assert all(isinstance(w, asyncio.Future) for w in waits)  # no coroutine level
        responses = await asyncio.gather(*waits)
        for i, response in enumerate(responses):
            out = response.outputs["OUTPUT0"]
            assert out.dtype == np.float32 and out.shape == (1, 4)
            assert out.tolist() == [[2.0 * i] * 4]
        # every hub request had a token bound to the loop; all were forgotten
        assert all(isinstance(t, CancelToken) and t.loop is loop for t in core.seen_tokens)
        (link,) = hub.links
        assert link.tokens == {} and client._calls == {} and client._watched == {}
        client.channel.close()  # type: ignore[union-attr]

    asyncio.run(run())


def test_a_request_naming_its_outputs_takes_the_general_start() -> None:
    async def run() -> None:
        _hub, _core, client, proxy = await _pair()
        request = _request("m", 5)
        request.outputs = [RequestedOutput("OUTPUT0", binary_data=True)]
        response = await proxy.infer(request)
        assert response.outputs["OUTPUT0"].tolist() == [[10.0] * 4]
        client.channel.close()  # type: ignore[union-attr]

    asyncio.run(run())


def test_answers_call_results_and_errors_in_flight_together_reach_their_callers() -> None:
    async def run() -> None:
        _hub, _core, client, proxy = await _pair()
        got = await asyncio.gather(
            proxy.infer(_request("m", 1)),
            proxy.live(),
            proxy.infer(_request("bad", 1)),
            proxy.infer(_request("m", 2)),
            return_exceptions=True,
        )
        assert got[0].outputs["OUTPUT0"].tolist() == [[2.0] * 4]  # type: ignore[union-attr]
        assert got[1] is True
        assert isinstance(got[2], InferError) and got[2].code == ErrorCode.INVALID_ARG
        assert got[3].outputs["OUTPUT0"].tolist() == [[4.0] * 4]  # type: ignore[union-attr]
        assert client._calls == {}
        client.channel.close()  # type: ignore[union-attr]

    asyncio.run(run())


def test_errors_keep_their_code_and_other_exceptions_become_internal() -> None:
    async def run() -> None:
        _hub, _core, client, proxy = await _pair()
        with pytest.raises(InferError) as bad:
            await proxy.infer(_request("bad", 1))
        assert bad.value.code == ErrorCode.INVALID_ARG and "bad input" in bad.value.message
        with pytest.raises(InferError) as boom:
            await proxy.infer(_request("boom", 1))
        assert boom.value.code == ErrorCode.INTERNAL and "model crashed" in boom.value.message
        # the channel still serves
        ok = await proxy.infer(_request("m", 3))
        assert ok.outputs["OUTPUT0"].tolist() == [[6.0] * 4]
        client.channel.close()  # type: ignore[union-attr]

    asyncio.run(run())


def test_client_gone_cancels_the_hub_request_and_callbacks_are_dropped() -> None:
    async def run() -> None:
        hub, core, client, proxy = await _pair()
        loop = asyncio.get_running_loop()
        token = CancelToken(None, loop)
        fut = proxy.infer(_request("hang", 1, token))
        (link,) = hub.links
        async with asyncio.timeout(5):
            while not link.tokens:
                await asyncio.sleep(0.001)
        assert client._watched  # the worker listens for the client going away
        token.cancel(InferError("client went away", ErrorCode.CLIENT_GONE))
        with pytest.raises(InferError) as gone:
            await fut
        assert gone.value.code == ErrorCode.CLIENT_GONE
        assert [e.code for e in core.cancelled] == [ErrorCode.CLIENT_GONE]
        assert link.tokens == {} and client._watched == {}
        # a request answered normally leaves no callback on its token
        kept = CancelToken(None, loop)
        await proxy.infer(_request("m", 1, kept))
        assert kept._callbacks == [] and client._watched == {}
        client.channel.close()  # type: ignore[union-attr]

    asyncio.run(run())


def test_finished_requests_form_no_reference_cycles() -> None:
    """Answered and failed requests are freed by reference counting (cyclic garbage
    costs a collection's walk per request under load)."""

    async def run() -> set[str]:
        _hub, _core, client, proxy = await _pair()
        loop = asyncio.get_running_loop()
        await proxy.infer(_request("m", 0, CancelToken(None, loop)))  # warm up
        with collector_off() as collect:
            for _ in range(3):
                waits = [proxy.infer(_request("m", i, CancelToken(None, loop))) for i in range(20)]
                await asyncio.gather(*waits)
            with pytest.raises(InferError):
                await proxy.infer(_request("bad", 1, CancelToken(None, loop)))
            await asyncio.sleep(0.01)
            kinds = {type(o).__name__ for o in collect()}
        client.channel.close()  # type: ignore[union-attr]
        return kinds

    kinds = asyncio.run(run())
    assert not kinds & {"InferRequest", "InferResponse", "CancelToken", "Future", "Task"}, kinds


def test_the_proxy_gate_answers_the_main_gates_principal_and_model_folders_pass_through(
    tmp_path: Path,
) -> None:
    """A worker's gate check returns the principal the main gate found (its name, kind
    and model grants, so a worker filters a model list as the main process would), and
    ``model_folders`` is the main core's answer."""
    auth = tmp_path / "auth.yaml"
    auth.write_text(
        f"keys:\n  - name: scoped\n    hash: {sha256_hash('k-1')}\n"
        "    models: ['emb*']\n    apis: [metadata]\n"
    )
    gate = TrafficGate(load_auth_config(auth))

    async def run() -> None:
        hub_sock, worker_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        core = _TurnCore()
        core.model_folders = lambda name, version: [f"/m/{name}/1", f"/m/{name}"]  # type: ignore[attr-defined]
        hub = FrontendHub(core, SharedMemoryRegistry(enabled=False), gate)  # type: ignore[arg-type]  # the stand-in core
        hub.attach(hub_sock, 0, lambda: None)
        client = WorkerClient()
        client.connect(lambda on_frame, on_close: ch.Channel(worker_sock, "t", on_frame, on_close))
        proxy_gate = ProxyGate(client, ["authorization"])
        headers = {"authorization": "Bearer k-1"}
        principal = await proxy_gate.check("http", "metadata", "", headers.get)
        assert (principal.name, principal.kind, principal.models) == ("scoped", "key", ("emb*",))
        assert principal.may_use_model("embedder") and not principal.may_use_model("gen")
        with pytest.raises(InferError) as refused:
            await proxy_gate.check("http", "metadata", "", {}.get)
        assert refused.value.code is ErrorCode.UNAUTHENTICATED
        assert await ProxyCore(client).model_folders("gen") == ["/m/gen/1", "/m/gen"]
        client.channel.close()  # type: ignore[union-attr]

    asyncio.run(run())
