""":func:`pdserve.frontends.grpc.service.direct_unary`: the servicer method a transport
may await directly (the native transport's one coroutine level fewer per call)."""

from __future__ import annotations

from typing import Any

from pdserve.frontends.grpc.service import GrpcService, direct_unary, method_handlers


def test_direct_unary_is_the_servicer_method_of_an_ungated_unary_handler() -> None:
    servicer = GrpcService(object())  # type: ignore[arg-type]  # no call is made
    handlers: dict[str, Any] = method_handlers(servicer)
    assert direct_unary(handlers["ModelInfer"]) == servicer.ModelInfer
    assert direct_unary(handlers["ServerLive"]) == servicer.ServerLive
    assert direct_unary(handlers["ModelStreamInfer"]) is None  # streaming
    assert direct_unary(None) is None
