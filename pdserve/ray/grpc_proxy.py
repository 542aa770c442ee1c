"""What Serve's gRPC proxy registers for the KServe V2 ``GRPCInferenceService``.

Serve's proxy takes ``grpc_servicer_functions``: functions like the generated
``add_GRPCInferenceServiceServicer_to_server``, whose method handlers it re-routes to
the replica method named by the RPC. :func:`add_GRPCInferenceServiceServicer_to_server`
registers the service's handlers without request deserializers: the proxy forwards the
request bytes as they came and the replica parses them (:func:`parse_request`), so the
proxy neither decodes the tensors nor needs the message classes to pickle them.
"""

from __future__ import annotations

from typing import Any

import grpc
from google.protobuf.message import Message
from tritonclient.grpc import service_pb2, service_pb2_grpc

from pdserve.frontends.grpc.service import HandlerRecorder

SERVICE_NAME = "inference.GRPCInferenceService"

#: The ``grpc_servicer_functions`` entry of Serve's gRPC options.
SERVICER_FUNCTION = "pdserve.ray.grpc_proxy.add_GRPCInferenceServiceServicer_to_server"

_METHODS = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].methods_by_name

#: RPC name -> its request message class.
REQUEST_TYPES: dict[str, type[Message]] = {
    name: getattr(service_pb2, m.input_type.name) for name, m in _METHODS.items()
}


def add_GRPCInferenceServiceServicer_to_server(servicer: Any, server: Any) -> None:  # noqa: N802
    """Register ``inference.GRPCInferenceService`` on ``server`` (Serve's proxy) with
    request bytes passed through (no ``request_deserializer``)."""
    recorder = HandlerRecorder()
    service_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(servicer, recorder)
    handlers = {m: h._replace(request_deserializer=None) for m, h in recorder.handlers.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    add_registered = getattr(server, "add_registered_method_handlers", None)
    if add_registered is not None:
        add_registered(SERVICE_NAME, handlers)


def parse_request(rpc: str, data: bytes | Message) -> Message:
    """The request message of RPC ``rpc`` from the bytes the proxy forwarded (a message
    already parsed is returned as it is).

    Raises:
        google.protobuf.message.DecodeError: the bytes are not that message.
    """
    if isinstance(data, Message):
        return data
    return REQUEST_TYPES[rpc].FromString(data)
