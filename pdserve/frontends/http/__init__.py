"""The KServe V2 REST frontend (Open Inference Protocol plus Triton's extensions; status
codes as Triton's ``src/http_server.cc``), with no web framework.

- :mod:`.app`: :class:`~.app.HttpApp`, the handlers: ``handle(method, path, headers,
  exchange) -> Answer`` routes a request, calls the core, encodes the answer; inference.
- :mod:`.routes`, :mod:`.generate`: the other routes (health, metadata, config, stats,
  repository, shared memory, logging, trace, traffic; generate / generate_stream).
- :mod:`.answer` (what handlers return, errors as ``{"error": message}``), :mod:`.body`
  (body limits, ``Content-Encoding``), :mod:`.decode` / :mod:`.encode` (the V2 codec),
  :mod:`.status` (error code -> HTTP status), :mod:`.compression`.
- Transports, both calling ``HttpApp.handle``: :mod:`.native` + :mod:`.native_reply`
  (asyncio.Protocol on httptools, the default; :mod:`.wire`, :mod:`.chunks`,
  :mod:`.upgrade`) and :mod:`.asgi` (under uvicorn, run by :mod:`.server`).
"""
