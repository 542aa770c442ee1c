"""The KServe V2 REST frontend: a raw ASGI application, served by pdserve's native
HTTP/1.1 transport (:mod:`pdserve.frontends.http.native`, ``--http-server native``,
the default) or by uvicorn (``--http-server asgi``, :mod:`pdserve.frontends.http.server`).

No web framework: :class:`HttpApp` routes on the path by hand, reads the body with a
running size limit, and calls the protocol-neutral ``InferenceServer``; the codec lives
in :mod:`pdserve.frontends.http.codec`. Measured in ``/work/shared/DESIGN.md``: a
framework per request costs up to 4x on small models.

Routes (Open Inference Protocol REST, https://github.com/kserve/open-inference-protocol,
plus Triton's extensions; status codes mimic Triton's ``src/http_server.cc``):

=======  ==================================================  ==============================
GET      ``/v2/health/live``, ``/v2/health/ready``            200 empty / 400 empty when not
GET      ``/v2``                                             server metadata
GET      ``/v2/openapi.json``                                this API's OpenAPI 3.0 document
GET      ``/v2/models/{m}[/versions/{v}]``                   model metadata
GET      ``/v2/models/{m}[/versions/{v}]/ready``             200 empty / 400 when not ready
GET      ``/v2/models/{m}[/versions/{v}]/config``            Triton model configuration JSON
POST     ``/v2/models/{m}[/versions/{v}]/infer``             inference (+ binary extension)
GET      ``/v2/models/stats``, ``/v2/models/{m}[/versions/{v}]/stats``   statistics extension
POST     ``/v2/repository/index``                            repository index (``{"ready": b}``)
POST     ``/v2/repository/models/{m}/load`` / ``unload``     model control (explicit mode)
=======  ==================================================  ==============================

Errors are ``{"error": message}``: an :class:`~pdserve.core.errors.InferError` with the
status of its code (one table, :data:`~pdserve.frontends.http.status.HTTP_STATUS`,
Triton's mapping); HTTP's own errors (405, 408, 413, 415) are
:class:`~pdserve.frontends.http.status.HttpError`; any other exception 500 (logged;
the server keeps serving); an unknown path 404; a known path with the wrong method
405; a route the server object lacks (no ``model_statistics``...) 404.
"""
