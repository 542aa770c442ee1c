"""pdserve.ray.server_replica without a cluster: a replica as Serve constructs it, its
HTTP app and its gRPC methods on the bytes Serve's proxy forwards."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from tritonclient.grpc import service_pb2

from pdserve.core.errors import ErrorCode, InferError
from pdserve.ray.server_replica import (
    ReplicaServer,
    RootPathApp,
    ServeAbort,
    ServeContext,
    ServerReplica,
    server_application,
)
from tests.conftest import EXAMPLE_REPO, copy_models


class Context:
    """What Serve's RayServegRPCContext offers the replica (a plain record)."""

    def __init__(self, metadata: list[tuple[str, str]] | None = None) -> None:
        self.metadata = metadata or []
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.trailing: list[tuple[str, str]] = []

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self.metadata

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def set_trailing_metadata(self, md: list[tuple[str, str]]) -> None:
        self.trailing = md


def infer_bytes(name: str, x: np.ndarray, model: str = "tiny") -> bytes:
    req = service_pb2.ModelInferRequest(model_name=model)
    inp = req.inputs.add(name=name, datatype="FP32", shape=list(x.shape))
    inp.contents.fp32_contents.extend(x.ravel().tolist())
    return req.SerializeToString()


async def asgi_post(app: Any, root: str, path: str, body: object) -> tuple[int, Any]:
    """POST ``body`` (JSON) to ``root + path`` as Serve's proxy hands it to the app
    (the full path and ``root_path`` set to the route prefix)."""
    data = json.dumps(body).encode()
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": root + path, "raw_path": (root + path).encode(),
        "root_path": root, "query_string": b"", "server": ("r", 80), "client": ("c", 1),
        "headers": [(b"content-type", b"application/json"),
                    (b"content-length", str(len(data)).encode())],
    }  # fmt: skip
    sent: list[dict[str, Any]] = []
    fed = False

    async def receive() -> dict[str, Any]:
        nonlocal fed
        if not fed:
            fed = True
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(payload)


# Serve awaits the async __del__; garbage collection later calls it too, unawaited.
@pytest.mark.filterwarnings("ignore:coroutine .*__del__' was never awaited")
def test_a_replica_serves_its_models_over_http_and_grpc(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "tiny", "pool")
    x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(1, 64)

    async def main() -> None:
        replica: Any = object.__new__(ServerReplica)
        await ServerReplica.__init__(replica, str(repo), ["tiny"])  # as Serve constructs it
        try:
            replica.check_health()
            # gRPC: request bytes in, a response message out
            ctx = Context()
            resp = await replica.ModelInfer(infer_bytes("INPUT0", x), grpc_context=ctx)
            out = np.frombuffer(resp.raw_output_contents[0], np.float32)
            assert out.shape == (64,) and (out >= 0).all() and out.any()
            ready = await replica.ModelReady(
                service_pb2.ModelReadyRequest(name="tiny").SerializeToString(), grpc_context=ctx
            )
            assert ready.ready
            not_loaded = await replica.ModelReady(
                service_pb2.ModelReadyRequest(name="pool").SerializeToString(), grpc_context=ctx
            )
            assert not not_loaded.ready
            # an error: the status set on Serve's context, then ServeAbort
            bad = Context()
            with pytest.raises(ServeAbort):
                await replica.ModelInfer(infer_bytes("WRONG", x), grpc_context=bad)
            assert bad.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "unexpected inference input 'WRONG'" in bad.details
            garbage = Context()
            with pytest.raises(ServeAbort):
                await replica.ModelInfer(b"\xff\xff\xff", grpc_context=garbage)
            assert garbage.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "not a valid ModelInferRequest" in garbage.details
            load = Context()
            with pytest.raises(ServeAbort):
                await replica.RepositoryModelLoad(
                    service_pb2.RepositoryModelLoadRequest(model_name="pool").SerializeToString(),
                    grpc_context=load,
                )
            assert load.code == grpc.StatusCode.UNAVAILABLE

            # the stream: one response per request, a bad message answered in the stream
            async def requests() -> Any:
                yield infer_bytes("INPUT0", x)
                yield b"\xff\xff"

            answers = [r async for r in replica.ModelStreamInfer(requests(), grpc_context=ctx)]
            # (concurrent requests: the answers come in any order)
            good, bad_one = sorted(answers, key=lambda a: bool(a.error_message))
            assert not good.error_message and good.infer_response.model_name == "tiny"
            assert "not a valid ModelInferRequest" in bad_one.error_message
            # HTTP: the V2 app under a route prefix
            app = replica.__serve_build_asgi_app__()
            assert isinstance(app, RootPathApp)
            body = {
                "inputs": [
                    {"name": "INPUT0", "shape": [1, 64], "datatype": "FP32",
                     "data": x.ravel().tolist()}
                ]
            }  # fmt: skip
            status, doc = await asgi_post(app, "/one", "/v2/models/tiny/infer", body)
            assert status == 200, doc
            np.testing.assert_allclose(doc["outputs"][0]["data"], out, rtol=1e-6)
            status, doc = await asgi_post(app, "/one", "/v2/repository/models/tiny/unload", {})
            assert status == 503, doc
        finally:
            await replica.__del__()
        with pytest.raises(RuntimeError, match="without a ready version"):
            replica.check_health()

    asyncio.run(main())


def test_the_context_keeps_what_the_servicer_sets() -> None:
    ctx = Context([("application", "pdserve")])
    serve_ctx = ServeContext(ctx)
    assert serve_ctx.invocation_metadata() == [("application", "pdserve")]
    assert not serve_ctx.cancelled()
    with pytest.raises(NotImplementedError):
        serve_ctx.add_done_callback(lambda _: None)
    serve_ctx.set_trailing_metadata([("retry-after", "1")])
    assert ctx.trailing == [("retry-after", "1")]
    with pytest.raises(ServeAbort, match="slow down"):
        asyncio.run(serve_ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "slow down"))
    assert ctx.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ServeContext(None).invocation_metadata() == []


def test_the_replica_server_refuses_load_and_unload(tmp_path: Path) -> None:
    repo = copy_models(tmp_path / "models", "tiny")
    server = ReplicaServer(str(repo), load_models=[], model_control_mode="explicit")
    with pytest.raises(InferError) as err:
        asyncio.run(server.unload_model("tiny"))
    assert err.value.code is ErrorCode.UNAVAILABLE


def test_server_application_binds_one_deployment_with_every_model() -> None:
    app = server_application(
        EXAMPLE_REPO, ["image_classifier", "tiny"], {"num_replicas": 2}, {"x": 1}
    )
    dep = app._bound_deployment
    assert dep.name == "pdserve" and dep.num_replicas == 2
    assert dep.max_ongoing_requests == 64
    # the steps before the ensemble; the ensemble reserves nothing of its own
    repo, models, http = dep.init_args
    assert repo == str(EXAMPLE_REPO.resolve()) and http == {"x": 1}
    assert models == ["preprocess", "efficientnet_lite0", "postprocess", "image_classifier", "tiny"]
    assert dep.ray_actor_options == {"num_cpus": 6.0}
