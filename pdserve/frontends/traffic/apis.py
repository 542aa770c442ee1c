"""API categories (Triton's "Limit endpoint access": :func:`classify_http`,
:func:`classify_grpc`) and the restricted-API flags (:func:`parse_restricted`).

``--http-restricted-api`` / ``--grpc-restricted-protocol`` take Triton's syntax,
``<api-1>,<api-2>,...:<key>=<value>`` (repeatable; an API in at most one group):
a request to a listed API must carry the header ``<key>: <value>`` (HTTP) or the
metadata ``triton-grpc-protocol-<key>: <value>`` (gRPC), else it is refused with
Triton's message ``This API is restricted, expecting header '<key>'`` (HTTP 403,
as Triton; gRPC ``PERMISSION_DENIED``, where Triton answers ``UNAVAILABLE``).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

# Every request falls into one of Triton's API categories, classified by its HTTP
# path or its gRPC method name, so routes added later are covered by the rule of
# their prefix:
#
# =================  =========================================================  ==========================
# category           HTTP                                                       gRPC
# =================  =========================================================  ==========================
# health             ``/v2/health/*``, ``/v2/models/{m}[/versions/{v}]/ready``  ServerLive, ServerReady,
#                                                                               ModelReady
# metadata           ``/v2``, ``/v2/models/{m}[/versions/{v}]``, openapi.json   ServerMetadata,
#                                                                               ModelMetadata
# inference          ``.../infer``, ``.../generate``, ``.../generate_stream``   ModelInfer, ModelStreamInfer
# model-config       ``.../config``                                             ModelConfig
# statistics         ``/v2/models/stats``, ``.../stats``                        ModelStatistics
# model-repository   ``/v2/repository/...``, ``/v2/models/{m}/traffic``,        Repository*
#                    ``/v2/models/{m}/rollout``, any other path
# shared-memory      ``/v2/systemsharedmemory/...``, ``/v2/cudasharedmemory/...``  *SharedMemory*
# trace              ``/v2/trace/setting``, ``/v2/models/{m}/trace/setting``    TraceSetting
# logging            ``/v2/logging``                                            LogSettings
# =================  =========================================================  ==========================
#
# A path or method not in the table is ``model-repository`` (the admin category):
# an unknown route is refused unless the caller may use the admin APIs.
HEALTH = "health"
METADATA = "metadata"
INFERENCE = "inference"
MODEL_CONFIG = "model-config"
MODEL_REPOSITORY = "model-repository"
STATISTICS = "statistics"
SHARED_MEMORY = "shared-memory"
TRACE = "trace"
LOGGING = "logging"

#: Triton's API / protocol names, in its order.
CATEGORIES = (
    HEALTH,
    METADATA,
    INFERENCE,
    SHARED_MEMORY,
    MODEL_CONFIG,
    MODEL_REPOSITORY,
    STATISTICS,
    TRACE,
    LOGGING,
)

#: Categories whose requests name a model that a credential's model patterns restrict.
MODEL_SCOPED = frozenset({INFERENCE, METADATA, MODEL_CONFIG})

#: The gRPC prefix Triton puts before a restricted key.
GRPC_HEADER_PREFIX = "triton-grpc-protocol-"

_GRPC_METHODS = {
    "ServerLive": HEALTH,
    "ServerReady": HEALTH,
    "ModelReady": HEALTH,
    "ServerMetadata": METADATA,
    "ModelMetadata": METADATA,
    "ModelInfer": INFERENCE,
    "ModelStreamInfer": INFERENCE,
    "ModelConfig": MODEL_CONFIG,
    "ModelStatistics": STATISTICS,
    "RepositoryIndex": MODEL_REPOSITORY,
    "RepositoryModelLoad": MODEL_REPOSITORY,
    "RepositoryModelUnload": MODEL_REPOSITORY,
    "TraceSetting": TRACE,
    "LogSettings": LOGGING,
}

_MODEL_ACTIONS = {
    "": METADATA,
    "ready": HEALTH,
    "infer": INFERENCE,
    "generate": INFERENCE,
    "generate_stream": INFERENCE,
    "config": MODEL_CONFIG,
    "stats": STATISTICS,
}


def classify_grpc(method: str) -> str:
    """The category of a gRPC method (its bare name, e.g. ``ModelInfer``, or the full
    ``/inference.GRPCInferenceService/ModelInfer``)."""
    name = method.rsplit("/", 1)[-1]
    found = _GRPC_METHODS.get(name)
    if found is not None:
        return found
    if "SharedMemory" in name:
        return SHARED_MEMORY
    return MODEL_REPOSITORY


def classify_http(path: str) -> tuple[str, str]:
    """``(category, model)`` of an HTTP request path (``model`` empty when none).

    Examples: ``/v2/models/m/versions/2/infer`` -> ``("inference", "m")``;
    ``/v2/health/ready`` -> ``("health", "")``; ``/v2/logging`` -> ``("logging", "")``.
    """
    parts = path.split("/")
    n = len(parts)
    if n < 2 or parts[0] != "" or parts[1] != "v2":
        return MODEL_REPOSITORY, ""
    if n == 2 or (n == 3 and parts[2] in ("", "openapi.json")):
        return METADATA, ""
    section = parts[2]
    if section == "health":
        return HEALTH, ""
    if section == "models":
        if n == 4 and parts[3] == "stats":
            return STATISTICS, ""
        if n < 4:
            return METADATA, ""
        model = parts[3]
        rest = parts[4:]
        if len(rest) >= 2 and rest[0] == "versions":
            rest = rest[2:]
        if not rest:
            return METADATA, model
        if len(rest) == 1 and rest[0] in _MODEL_ACTIONS:
            return _MODEL_ACTIONS[rest[0]], model
        if rest[0] == "trace":
            return TRACE, model
        return MODEL_REPOSITORY, model  # traffic, rollout and any other admin route
    if section in ("systemsharedmemory", "cudasharedmemory"):
        return SHARED_MEMORY, ""
    if section == "trace":
        return TRACE, ""
    if section == "logging":
        return LOGGING, ""
    return MODEL_REPOSITORY, ""


class RestrictedApiError(ValueError):
    """A malformed ``--http-restricted-api`` / ``--grpc-restricted-protocol`` value."""


@dataclass(frozen=True)
class Restriction:
    """One restricted group: its categories and the header that opens them."""

    categories: frozenset[str]
    key: str
    value: str


def parse_restricted(options: tuple[str, ...] | list[str], flag: str) -> dict[str, Restriction]:
    """Parse Triton's ``<api-1>,<api-2>,...:<key>=<value>`` options into
    ``category -> Restriction``.

    Raises:
        RestrictedApiError: a malformed option, an unknown API name, an empty key or
            value, or an API in two groups (Triton refuses that too).
    """
    out: dict[str, Restriction] = {}
    for option in options:
        apis, sep, kv = option.partition(":")
        key, sep2, value = kv.partition("=")
        key = key.strip().lower()
        if not sep or not sep2 or not key or not value:
            raise RestrictedApiError(
                f"{flag} {option!r}: expected <api-1>,<api-2>,...:<restricted-key>=<restricted-value>"
            )
        names = [a.strip() for a in apis.split(",") if a.strip()]
        if not names:
            raise RestrictedApiError(f"{flag} {option!r}: no API named before ':'")
        group = Restriction(frozenset(names), key, value)
        for name in names:
            if name not in CATEGORIES:
                raise RestrictedApiError(
                    f"{flag} {option!r}: unknown API {name!r}; expected one of "
                    f"{', '.join(CATEGORIES)}"
                )
            if name in out:
                raise RestrictedApiError(
                    f"{flag}: API {name!r} is in more than one restricted group"
                )
            out[name] = group
    return out


def restriction_met(restriction: Restriction, presented: str | None) -> bool:
    """Whether a presented header value opens the restriction (constant-time compare)."""
    if presented is None:
        return False
    return hmac.compare_digest(presented.encode("utf-8"), restriction.value.encode("utf-8"))
