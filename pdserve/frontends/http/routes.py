"""The V2 REST routes other than inference: each reads what its request says, calls the
core and returns its :class:`~pdserve.frontends.http.answer.Answer` (see the package
docstring's table of routes)."""

from __future__ import annotations

import base64
import binascii
import functools
import importlib.resources
import inspect
from collections.abc import Callable
from typing import Any

from pdserve.core.api import InferenceCore
from pdserve.core.errors import InferError, not_found
from pdserve.frontends.http.answer import (
    EMPTY_ANSWER,
    EMPTY_JSON_ANSWER,
    NOT_READY_ANSWER,
    Answer,
    Exchange,
    Headers,
    WrongMethodError,
    check_method,
    dumps,
    json_answer,
)
from pdserve.frontends.http.body import read_json_object
from pdserve.frontends.shared_memory import (
    SharedMemoryRegistry,
    with_shm_extension,
)
from pdserve.observability import logs


@functools.cache
def openapi_document() -> bytes:
    """The OpenAPI 3.0 description of this API (``openapi.json`` next to this module),
    served at ``GET /v2/openapi.json``."""
    return (importlib.resources.files(__package__) / "openapi.json").read_bytes()


async def call(func: Callable[..., Any], *args: Any) -> Any:
    """Call a core method that may be sync or async."""
    result = func(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


def optional(core: InferenceCore, name: str, what: str) -> Callable[..., Any]:
    """The core's method ``name``; 404 naming ``what`` when this core lacks it."""
    method = getattr(core, name, None)
    if method is None:
        raise not_found(f"this server does not support {what}")
    return method


async def server_metadata(core: InferenceCore, shm: SharedMemoryRegistry) -> Answer:
    return json_answer(dumps(with_shm_extension(await call(core.metadata), shm)))


async def health(core: InferenceCore, probe: str) -> Answer:
    """``/v2/health/live|ready``: 200 or 400, empty."""
    ok = bool(await call(core.live if probe == "live" else core.ready))
    return EMPTY_ANSWER if ok else NOT_READY_ANSWER


async def model_get(core: InferenceCore, action: str, model: str, version: str) -> Answer:
    """``GET /v2/models/{m}[/versions/{v}][/config|/stats|/ready]``."""
    if action == "":
        body = dumps(await call(core.model_metadata, model, version))
    elif action == "config":
        body = dumps(await call(core.model_config, model, version))
    elif action == "stats":
        stats = optional(core, "model_statistics", "the statistics extension")
        body = dumps(await call(stats, model, version))
    else:  # ready
        if not await call(core.model_ready, model, version):
            raise InferError("Model version not ready")
        body = b""
    return json_answer(body)


async def shared_memory(
    shm: SharedMemoryRegistry,
    parts: list[str],
    method: str,
    path: str,
    headers: Headers,
    exchange: Exchange,
) -> Answer:
    """Triton's shared-memory extension: ``/v2/systemsharedmemory[/region/{r}]/status``
    (GET), ``.../register`` (POST ``{key, offset, byte_size}``),
    ``[/region/{r}]/unregister`` (POST; no region: all). CUDA shared memory
    (``/v2/cudasharedmemory/...``) answers as Triton without GPUs: status ``[]``,
    unregister success, register 400 (:meth:`SharedMemoryRegistry.cuda_status` ...)."""
    n = len(parts)
    if n == 4:
        region, action = "", parts[3]
    elif n == 6 and parts[3] == "region" and parts[4]:
        region, action = parts[4], parts[5]
    else:
        raise not_found(f"no route for {path}")
    if action not in ("status", "register", "unregister") or (action == "register" and not region):
        raise not_found(f"no route for {path}")
    check_method(method, "GET" if action == "status" else "POST")
    if parts[2] == "cudasharedmemory":  # no CUDA region is ever registered
        if action == "status":
            return json_answer(dumps(shm.cuda_status(region)))
        if action == "register":
            shm.cuda_register(region)  # raises: INVALID_ARG, or UNSUPPORTED when off
        shm.cuda_unregister(region)
        return json_answer(b"")
    body = b""
    if action == "status":
        body = dumps(await call(shm.status, region))
    elif action == "register":
        doc = await read_json_object(exchange, headers)
        args = (region, doc.get("key"), doc.get("offset", 0), doc.get("byte_size"))
        await call(shm.register, *args)  # awaitable in an --http-workers worker
    else:
        await call(shm.unregister, region)
    return json_answer(body)


async def logging_settings(
    core: InferenceCore, method: str, headers: Headers, exchange: Exchange
) -> Answer:
    """``GET /v2/logging`` (the settings) and ``POST /v2/logging`` (change some,
    answer all): Triton's logging extension (:mod:`pdserve.observability.logs`).
    A bad name or type is a 400 and changes nothing."""
    if method not in ("GET", "POST"):
        raise WrongMethodError("GET, POST")
    update = await read_json_object(exchange, headers) if method == "POST" else None
    hook = getattr(core, "log_settings", None)  # an --http-workers worker's core
    if hook is not None:
        return json_answer(dumps(await hook(update)))
    if update is not None:
        return json_answer(dumps(logs.update_settings(update)))
    return json_answer(dumps(logs.settings_dict()))


async def trace_setting(
    core: InferenceCore, method: str, model: str, headers: Headers, exchange: Exchange
) -> Answer:
    """``GET/POST /v2[/models/{m}]/trace/setting``: Triton's trace extension."""
    if method not in ("GET", "POST"):
        raise WrongMethodError("GET, POST")
    setting = optional(core, "trace_setting", "the trace extension")
    update = await read_json_object(exchange, headers) if method == "POST" else None
    return json_answer(dumps(await call(setting, model, update)))


async def traffic(
    core: InferenceCore,
    model: str,
    action: str,
    method: str,
    headers: Headers,
    exchange: Exchange,
) -> Answer:
    """``GET|POST /v2/models/{m}/traffic`` and ``/v2/models/{m}/rollout``: traffic
    control's admin endpoints (:mod:`pdserve.repository.rollout`)."""
    if method not in ("GET", "POST"):
        raise WrongMethodError("GET, POST")
    control = getattr(core, "traffic", None)
    if control is None:
        raise not_found("this server does not support traffic control")
    if method == "GET":
        describe = control.describe_traffic if action == "traffic" else control.describe_rollout
        return json_answer(dumps(await call(describe, model)))
    doc = await read_json_object(exchange, headers)
    change = control.set_traffic if action == "traffic" else control.rollout_action
    return json_answer(dumps(await call(change, model, doc)))


async def repository(
    core: InferenceCore, parts: list[str], method: str, headers: Headers, exchange: Exchange
) -> Answer | None:
    """``POST /v2/repository/index`` (optional ``{"ready": bool}``) and
    ``POST /v2/repository/models/{m}/load|unload``; None for another path."""
    n = len(parts)
    if n == 4 and parts[3] == "index":
        check_method(method, "POST")
        index = optional(core, "repository_index", "the model repository extension")
        doc = await read_json_object(exchange, headers)
        ready = doc.get("ready", False)
        if type(ready) is not bool:
            raise InferError("repository index 'ready' must be true or false")
        return json_answer(dumps(await call(index, ready)))
    if n == 6 and parts[3] == "models" and parts[5] in ("load", "unload"):
        check_method(method, "POST")
        if not parts[4]:
            raise InferError("missing model name in the repository request path")
        doc = await read_json_object(exchange, headers)
        if parts[5] == "load":
            await _load(core, parts[4], doc)
        else:
            await _unload(core, parts[4], doc)
        return EMPTY_JSON_ANSWER
    return None


async def _load(core: InferenceCore, model: str, doc: dict[str, Any]) -> None:
    """Load request body (Triton model repository extension):
    ``{"parameters": {"config": "<json>", "file:<path>": "<base64>"}}``.

    The core gets ``config`` (str or None) and ``files`` mapping ``<path>`` (the
    part after ``file:``, e.g. ``1/model.onnx``) to the decoded bytes.
    """
    load = optional(core, "load_model", "model control")
    params = doc.get("parameters", {})
    if type(params) is not dict:
        raise InferError("load request 'parameters' must be a JSON object")
    config: str | None = None
    files: dict[str, bytes] = {}
    for key, value in params.items():
        if type(value) is not str:
            raise InferError(f"load parameter '{key}' must be a string")
        if key == "config":
            config = value
        elif key.startswith("file:"):
            try:
                files[key[5:]] = base64.b64decode(value, validate=True)
            except (binascii.Error, ValueError) as exc:
                raise InferError(f"load parameter '{key}' is not valid base64: {exc}") from None
        else:
            raise InferError(f"unknown load parameter '{key}'; expected 'config' or 'file:<path>'")
    await call(load, model, config, files)


async def _unload(core: InferenceCore, model: str, doc: dict[str, Any]) -> None:
    """Unload request body: ``{"parameters": {"unload_dependents": bool}}``."""
    unload = optional(core, "unload_model", "model control")
    params = doc.get("parameters", {})
    if type(params) is not dict:
        raise InferError("unload request 'parameters' must be a JSON object")
    dependents = params.get("unload_dependents", False)
    if type(dependents) is not bool:
        raise InferError("unload parameter 'unload_dependents' must be true or false")
    await call(unload, model, dependents)
