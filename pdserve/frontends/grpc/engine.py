"""grpcio settings that must be in place before grpc's core starts.

Importing this module sets ``GRPC_EXPERIMENTS`` (unless the environment already sets
it, even to an empty value) to turn off grpc core's EventEngine listener and endpoints
(:data:`GRPC_EXPERIMENTS`): grpc then uses its classic (iomgr) TCP code, which costs the
synchronous server less CPU per call. grpc reads the variable once, when it is first
imported, so ``pdserve.app.cli`` imports this module before anything else: a process
that imported ``grpc`` earlier keeps grpc's defaults, which work the same, only slower.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

#: The experiments turned off (grpc core's names, ``-`` = disabled).
GRPC_EXPERIMENTS = "-event_engine_listener,-event_engine_for_all_other_endpoints"

#: ``--grpc-server`` choices: the native HTTP/2 transport on the event loop
#: (:mod:`pdserve.frontends.grpc.native`), grpcio's synchronous server with the servicer
#: bridged onto the event loop (:mod:`pdserve.frontends.grpc.sync_bridge`), or ``grpc.aio``.
GRPC_SERVERS = ("native", "threads", "aio")


@dataclass(frozen=True)
class GrpcKeepalive:
    """gRPC keepalive and ping policing, Triton's ``--grpc-keepalive-*`` and
    ``--grpc-http2-*`` flags (grpc core's channel arguments of the same meaning; the
    defaults are grpc core's server defaults, which Triton keeps). Durations in
    milliseconds, as Triton's flags.

    Attributes:
        time_ms: after this long with nothing received, the server sends a keepalive
            PING (``GRPC_ARG_KEEPALIVE_TIME_MS``; 7200000 = 2 h).
        timeout_ms: a keepalive PING not acknowledged within this long closes the
            connection (``GRPC_ARG_KEEPALIVE_TIMEOUT_MS``; 20000).
        permit_without_calls: keepalive PINGs are sent, and the client's PINGs judged
            by ``min_recv_ping_interval_ms``, even with no call open; otherwise a
            connection with no call open is pinged never, and a client may PING it
            only every 2 hours (``GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS``; false).
        max_pings_without_data: most keepalive PINGs sent while no data or headers are
            sent (``GRPC_ARG_HTTP2_MAX_PINGS_WITHOUT_DATA``; 2; 0: no limit).
        min_recv_ping_interval_ms: a client PING sooner than this after the previous
            one, with no data or headers received between them, is a "ping strike"
            (``GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS``; 300000 = 5 min).
        max_ping_strikes: more strikes than this: GOAWAY ``ENHANCE_YOUR_CALM``
            (debug data ``too_many_pings``) and close
            (``GRPC_ARG_HTTP2_MAX_PING_STRIKES``; 2; 0: any number).
    """

    time_ms: int = 7_200_000
    timeout_ms: int = 20_000
    permit_without_calls: bool = False
    max_pings_without_data: int = 2
    min_recv_ping_interval_ms: int = 300_000
    max_ping_strikes: int = 2

    def channel_options(self) -> list[tuple[str, int]]:
        """The same settings as grpcio server options (``--grpc-server threads|aio``)."""
        return [
            ("grpc.keepalive_time_ms", self.time_ms),
            ("grpc.keepalive_timeout_ms", self.timeout_ms),
            ("grpc.keepalive_permit_without_calls", int(self.permit_without_calls)),
            ("grpc.http2.max_pings_without_data", self.max_pings_without_data),
            ("grpc.http2.min_ping_interval_without_data_ms", self.min_recv_ping_interval_ms),
            ("grpc.http2.max_ping_strikes", self.max_ping_strikes),
        ]


def default_grpc_server() -> str:
    """``--grpc-server``'s default: ``$PDSERVE_GRPC_SERVER`` when set and not empty (so a
    test run can use either server throughout; a value that is not a choice is
    refused by ``Settings.validate``), else ``native``."""
    return os.environ.get("PDSERVE_GRPC_SERVER", "").strip() or "native"


if "GRPC_EXPERIMENTS" not in os.environ:
    os.environ["GRPC_EXPERIMENTS"] = GRPC_EXPERIMENTS
