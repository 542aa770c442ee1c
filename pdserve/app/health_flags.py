"""The ``pdserve serve`` flags of model health and per-request timing
(:class:`HealthFlags`, a base of :class:`~pdserve.app.serve_flags.ServeFlags`)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.repository.health import DEFAULT_HANG_TIMEOUT_S

from .flag_syntax import flag, switch


@dataclass(frozen=True)
class HealthFlags:
    """Wedged-instance bound and Server-Timing (docs/user-guide/health.md)."""

    instance_hang_timeout: float = flag(
        "--instance-hang-timeout",
        DEFAULT_HANG_TIMEOUT_S,
        "server",
        "seconds a model instance may hold a request without progress before it is "
        "declared wedged, its requests fail (503) and it is restarted; a model's "
        "config.pbtxt parameter instance_hang_timeout overrides it; 0: off (default {default})",
        type=float,
        metavar="SECS",
    )
    server_timing: bool = switch(
        "--server-timing",
        False,
        "server",
        "answer a request that asks (header x-pdserve-server-timing: 1 or the request "
        "parameter server_timing: true) with its queue and compute times: the HTTP "
        "Server-Timing header, gRPC trailing metadata server-timing (default {default})",
    )
