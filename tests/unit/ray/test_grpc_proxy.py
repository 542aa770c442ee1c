"""pdserve.ray.grpc_proxy: what Serve's gRPC proxy registers, and parsing the bytes it forwards."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError
from tritonclient.grpc import service_pb2, service_pb2_grpc

from pdserve.ray.grpc_proxy import (
    REQUEST_TYPES,
    SERVICE_NAME,
    add_GRPCInferenceServiceServicer_to_server,
    parse_request,
)


class Server:
    """Records what a gRPC server is given (as Serve's proxy server does)."""

    def __init__(self) -> None:
        self.generic: list[Any] = []
        self.registered: dict[str, dict[str, grpc.RpcMethodHandler]] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(
        self, name: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.registered[name] = handlers


def test_every_rpc_is_registered_without_a_request_deserializer() -> None:
    server = Server()
    servicer = service_pb2_grpc.GRPCInferenceServiceServicer()  # as Serve passes one
    add_GRPCInferenceServiceServicer_to_server(servicer, server)
    handlers = server.registered[SERVICE_NAME]
    assert {"ModelInfer", "ModelStreamInfer", "ServerReady", "ModelMetadata"} <= set(handlers)
    assert all(h.request_deserializer is None for h in handlers.values())
    # responses still serialized (Serve replaces the behaviours, not the serializer)
    assert handlers["ModelInfer"].response_serializer is not None
    assert handlers["ModelStreamInfer"].stream_stream is not None
    assert len(server.generic) == 1


def test_parse_request() -> None:
    req = service_pb2.ModelInferRequest(model_name="tiny", id="7")
    parsed = parse_request("ModelInfer", req.SerializeToString())
    assert isinstance(parsed, service_pb2.ModelInferRequest) and parsed.id == "7"
    assert parse_request("ModelInfer", req) is req
    assert REQUEST_TYPES["ModelStreamInfer"] is service_pb2.ModelInferRequest
    assert REQUEST_TYPES["ServerLive"] is service_pb2.ServerLiveRequest
    with pytest.raises(DecodeError):
        parse_request("ModelInfer", b"\xff\xff\xff")
