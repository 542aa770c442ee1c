"""The traffic gate both frontends call at a request's entry (:class:`TrafficGate`), so HTTP
and gRPC follow the same rules, in order: the request's API category
(:mod:`pdserve.frontends.traffic.apis`); Triton's restricted-API flags (the category's
header must be present with its value: 403 / ``PERMISSION_DENIED``); a valid credential
for every category but ``health`` when auth is configured (401 / ``UNAUTHENTICATED``),
whose grants include the category and, for model-scoped ones, the model (403); and for
inference, the key's, the model's and the global rate limit (429 /
``RESOURCE_EXHAUSTED``).

The auth config is re-read when its files change and on SIGHUP; a broken one is logged
and counted, and the last good one stays. Counters for ``/metrics`` name a key by its
configured name, never the key or token (:meth:`TrafficGate.samples`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from pathlib import Path

from pdserve.core.errors import InferError
from pdserve.frontends.traffic.apis import (
    HEALTH,
    INFERENCE,
    MODEL_SCOPED,
    Restriction,
    restriction_met,
)
from pdserve.frontends.traffic.auth import (
    AuthConfig,
    AuthConfigError,
    Authenticator,
    AuthError,
    Principal,
    bearer_token,
    forbidden,
    load_auth_config,
)
from pdserve.frontends.traffic.ratelimit import RateLimitConfigError, RateLimiter

log = logging.getLogger("pdserve.auth")

#: The name of the authenticated principal (API key or JWT subject as configured) of
#: the request being handled, set by :meth:`TrafficGate.check`; traffic control uses it
#: as the sticky route key when the request carries no ``x-pdserve-route-key``.
principal_name: ContextVar[str | None] = ContextVar("pdserve_principal", default=None)

#: The principal of requests when no auth is configured.
NOBODY = Principal(name="", models=("*",), apis=frozenset(), kind="anonymous")

#: A metric sample: (name, type, help, labels, value).
Sample = tuple[str, str, str, dict[str, str], float]


class TrafficGate:
    """Restricted APIs, auth and rate limits for one server (both protocols).

    Args:
        config: the loaded auth config, or None (no auth; rate limits off unless
            ``limiter`` has its own).
        limiter: the :class:`RateLimiter`, or None.
        http_restricted / grpc_restricted: ``category -> Restriction`` from
            :func:`~pdserve.frontends.traffic.apis.parse_restricted`.
        reload_secs: how often the auth config's files are checked for changes.
    """

    def __init__(
        self,
        config: AuthConfig | None = None,
        limiter: RateLimiter | None = None,
        http_restricted: dict[str, Restriction] | None = None,
        grpc_restricted: dict[str, Restriction] | None = None,
        reload_secs: float = 2.0,
    ) -> None:
        self.auth = Authenticator(config) if config is not None and config.enabled else None
        self.config = config
        self.limiter = limiter
        self.http_restricted = http_restricted or {}
        self.grpc_restricted = grpc_restricted or {}
        self.reload_secs = reload_secs
        self.failures: dict[tuple[str, str], int] = {}
        self.reloads: dict[str, int] = {"ok": 0, "failed": 0}
        self._stamps = self._file_stamps()

    @property
    def active(self) -> bool:
        """True when the gate does anything (a frontend skips it otherwise): an auth
        config is given (a reload may add keys or limits), or a restricted API."""
        return bool(
            self.config is not None
            or self.auth is not None
            or (self.limiter is not None and self.limiter.active)
            or self.http_restricted
            or self.grpc_restricted
        )

    # -- the request path -----------------------------------------------------------

    async def check(
        self,
        protocol: str,
        category: str,
        model: str,
        header: Callable[[str], str | None],
    ) -> Principal:
        """Admit one request or raise.

        Args:
            protocol: ``http`` | ``grpc`` (selects the restricted-API table and the
                header prefix; a metrics label).
            category: the API category; ``model``: the model the request names ("").
            header: returns a request header / metadata value by lower-case name.

        Raises:
            AuthError: 401 / 403 (see the module docstring).
            RateLimitExceededError: 429.
            InferError(UNAVAILABLE): the rate-limit storage fails, fail mode closed.
        """
        try:
            restricted = (self.http_restricted if protocol == "http" else self.grpc_restricted).get(
                category
            )
            if restricted is not None:
                name = (
                    restricted.key
                    if protocol == "http"
                    else "triton-grpc-protocol-" + restricted.key
                )
                if not restriction_met(restricted, header(name)):
                    raise forbidden(
                        f"This API is restricted, expecting header '{name}'", "restricted"
                    )
            auth = self.auth
            if auth is None or category == HEALTH:
                principal = NOBODY
            else:
                token = bearer_token(
                    header("authorization"),
                    header("triton-access-token")
                    or (
                        header("triton-grpc-protocol-triton-access-token")
                        if protocol == "grpc"
                        else None
                    ),
                )
                principal = auth.authenticate(token)
                principal_name.set(principal.name)
                if category not in principal.apis:
                    raise forbidden(
                        f"'{principal.name}' may not use the {category} API",
                        "forbidden_api",
                        principal.name,
                    )
                if model and category in MODEL_SCOPED and not principal.may_use_model(model):
                    raise forbidden(
                        f"'{principal.name}' may not use model '{model}'",
                        "forbidden_model",
                        principal.name,
                    )
        except AuthError as e:
            key = (protocol, e.why)
            self.failures[key] = self.failures.get(key, 0) + 1
            log.debug(
                "refused %s %s request%s: %s",
                protocol,
                category,
                f" of '{e.principal}'" if e.principal else "",
                e.why,
            )
            raise
        limiter = self.limiter
        if limiter is not None and category == INFERENCE and model:
            await limiter.check(model, principal.name, principal.rate_limit)
        return principal

    # -- reload ---------------------------------------------------------------------

    def _file_stamps(self) -> dict[Path, tuple[float, int] | None]:
        out: dict[Path, tuple[float, int] | None] = {}
        if self.config is None:
            return out
        for f in self.config.files:
            try:
                st = os.stat(f)
                out[f] = (st.st_mtime, st.st_size)
            except OSError:
                out[f] = None
        return out

    def reload(self, why: str = "changed") -> bool:
        """Re-read the auth config file; keep the current one when it fails.

        Returns:
            True when the new configuration is in force.
        """
        if self.config is None:
            return False
        path = self.config.path
        try:
            config = load_auth_config(path)
            if self.limiter is not None:
                self.limiter.set_limits(config.rate_limits)
        except (AuthConfigError, RateLimitConfigError) as e:
            self.reloads["failed"] += 1
            self._stamps = self._file_stamps()
            log.error("auth config %s not reloaded (%s): %s; the previous one stays", path, why, e)
            return False
        self.config = config
        self.auth = Authenticator(config) if config.enabled else None
        self._stamps = self._file_stamps()
        self.reloads["ok"] += 1
        log.info(
            "auth config %s reloaded (%s): %d key(s), jwt %s",
            path,
            why,
            len(config.keys),
            "on" if config.jwt is not None else "off",
        )
        return True

    def changed(self) -> bool:
        """Whether a watched file changed since the last (re)load."""
        return self.config is not None and self._file_stamps() != self._stamps

    async def watch(self) -> None:
        """Reload on change, every :attr:`reload_secs` (run as a task; cancel to stop)."""
        while True:
            await asyncio.sleep(self.reload_secs)
            with contextlib.suppress(Exception):
                if self.changed():
                    self.reload("file changed")

    # -- metrics --------------------------------------------------------------------

    def samples(self) -> Iterator[Sample]:
        """The gate's counters as metric samples (read at each scrape)."""
        for (protocol, why), n in sorted(self.failures.items()):
            yield (
                "pdserve_auth_failures_total",
                "counter",
                "Requests refused by authentication or authorisation",
                {"protocol": protocol, "reason": why},
                n,
            )
        if self.config is not None:
            for result, n in sorted(self.reloads.items()):
                yield (
                    "pdserve_auth_config_reloads_total",
                    "counter",
                    "Reloads of the auth config file, by result",
                    {"result": result},
                    n,
                )
        limiter = self.limiter
        if limiter is not None:
            for (scope, model, key), n in sorted(limiter.limited.items()):
                yield (
                    "pdserve_rate_limited_total",
                    "counter",
                    "Inference requests refused by a rate limit (429)",
                    {"scope": scope, "model": model, "key": key},
                    n,
                )
            yield (
                "pdserve_rate_limit_storage_errors_total",
                "counter",
                "Rate-limit checks that found the storage (Redis) failing",
                {},
                limiter.storage_errors,
            )


def header_getter(headers: list[tuple[bytes, bytes]]) -> Callable[[str], str | None]:
    """A lower-case-name header lookup over ASGI ``scope["headers"]`` (first value)."""

    def get(name: str) -> str | None:
        key = name.encode("latin-1")
        for k, v in headers:
            if k == key:
                return v.decode("latin-1")
        return None

    return get


def metadata_getter(
    metadata: Iterable[tuple[str, str | bytes]] | None,
) -> Callable[[str], str | None]:
    """A header lookup over gRPC invocation metadata (``(key, value)`` pairs)."""

    def get(name: str) -> str | None:
        for k, v in metadata or ():
            if k == name:
                return v.decode("latin-1") if isinstance(v, bytes) else str(v)
        return None

    return get


def retry_after_of(error: InferError) -> int | None:
    """The ``Retry-After`` seconds an error carries (rate limit, open circuit), or None."""
    value = getattr(error, "retry_after", None)
    return int(value) if value is not None else None
