"""Wire-protocol frontends: thin adapters between the network and :mod:`pdserve.server`.

- :mod:`pdserve.frontends.http.codec`: pure V2 REST (+ binary tensor extension) encode /
  decode functions, ``bytes`` <-> :class:`~pdserve.core.types.InferRequest` /
  :class:`~pdserve.core.types.InferResponse`. No I/O, unit-testable.
- :mod:`pdserve.frontends.http`: the raw ASGI application serving the KServe V2 REST
  routes, and :func:`~pdserve.frontends.http.serve_http` to run it on uvicorn.

Frontends hold no model logic: they translate, call the protocol-neutral
``InferenceServer`` API, and translate back. Nothing is imported here so that
importing one frontend does not pull in the other's dependencies.
"""
