"""The OpenAI-compatible REST front end, served beside the V2 routes on the HTTP port.

- :mod:`.routes`: ``GET /v1/models[/{id}]``, ``POST /v1/embeddings``,
  ``POST /v1/completions``, ``POST /v1/chat/completions``; each request passes the
  traffic gate (auth, restricted APIs, rate limits) and the admission step as V2
  requests do, then the core's ``infer`` / ``infer_stream``.
- :mod:`.catalog`: which models the front end serves and as what (embeddings or
  completions), and a generator's chat template.
- :mod:`.codec`: OpenAI request fields checked, OpenAI response and error bodies.
"""
