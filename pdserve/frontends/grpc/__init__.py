"""The KServe V2 gRPC frontend: ``inference.GRPCInferenceService`` (tritonclient's generated
stubs, so ``tritonclient.grpc``, ``perf_analyzer -i grpc`` and KServe's V2 gRPC clients
talk to it unchanged) on pdserve's own HTTP/2 transport (:mod:`.native`, the default)
or on grpcio (threads through :mod:`.sync_bridge`, or ``grpc.aio``): ``--grpc-server``;
:mod:`.server` picks and starts one.

A thin adapter: wire messages <-> :class:`~pdserve.core.types.InferRequest` /
:class:`~pdserve.core.types.InferResponse` (:mod:`.codec`), each RPC a call into the
protocol-neutral core (:mod:`.service`). An :class:`~pdserve.core.errors.InferError` is
answered with the gRPC status Triton uses for its code
(:data:`~pdserve.frontends.grpc.service.GRPC_STATUS`); anything else is ``INTERNAL``
and logged. A bad request never takes the server down.
"""
