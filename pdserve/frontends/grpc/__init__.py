"""The KServe V2 gRPC frontend: ``inference.GRPCInferenceService`` on pdserve's own
HTTP/2 transport on the event loop (the default, :mod:`pdserve.frontends.grpc.native`)
or on grpcio (its synchronous server with the handlers bridged onto the event loop, or
``grpc.aio``): ``--grpc-server``, :mod:`pdserve.frontends.grpc.server`.

The service, messages and method names are tritonclient's generated stubs
(``tritonclient.grpc.service_pb2`` / ``service_pb2_grpc``), so ``tritonclient.grpc``,
``perf_analyzer -i grpc`` and KServe's V2 gRPC clients talk to it unchanged. Like the
HTTP frontend this is a thin adapter: wire messages <-> :class:`~pdserve.core.types.InferRequest`
/ :class:`~pdserve.core.types.InferResponse`, and every call goes to the protocol-neutral
``InferenceServer``.

RPCs: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig,
ModelInfer, ModelStreamInfer (one response per request; a decoupled model's responses
streamed as they come), ModelStatistics, RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload.
The shared-memory, trace and log-settings RPCs answer UNIMPLEMENTED.

Tensor data, as Triton's gRPC frontend accepts and sends it:

- inputs come either all in ``raw_input_contents`` (one little-endian, row-major buffer
  per input, in input order; a BYTES element is a uint32 little-endian length and its
  bytes) or each in its typed ``contents`` (``fp32_contents``...; FP16 has no typed
  field and must be raw). Raw fixed-size inputs become zero-copy read-only
  ``np.frombuffer`` views.
- outputs are always sent in ``raw_output_contents``, which is what Triton does and
  what ``tritonclient``'s ``InferResult.as_numpy`` reads first.

Errors: an :class:`~pdserve.core.errors.InferError` is answered with the gRPC status code
Triton uses for its :class:`~pdserve.core.errors.ErrorCode` (one table,
:data:`~pdserve.frontends.grpc.service.GRPC_STATUS`: ``INVALID_ARGUMENT`` bad request,
``NOT_FOUND`` unknown model / version, ``UNAVAILABLE`` not ready / queue full /
shutting down / model control disabled, ``INTERNAL`` model failure, ``CANCELLED``
client gone, and a python model's own code by name); anything else is ``INTERNAL``
and logged. A bad request never takes the server down.
"""
