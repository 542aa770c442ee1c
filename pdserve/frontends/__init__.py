"""Wire-protocol frontends: thin adapters between the network and :mod:`pdserve.server`.

- :mod:`pdserve.frontends.http`: KServe V2 over HTTP: one set of handlers
  (:class:`~pdserve.frontends.http.app.HttpApp`) behind two transports (native, ASGI).
- :mod:`pdserve.frontends.grpc`: KServe V2 ``GRPCInferenceService`` (native, aio, threads).
- :mod:`pdserve.frontends.admission`: the request setup both protocols share.

Frontends hold no model logic: they translate, call the protocol-neutral
``InferenceServer`` API, and translate back. Nothing is imported here so that
importing one frontend does not pull in the other's dependencies.
"""
