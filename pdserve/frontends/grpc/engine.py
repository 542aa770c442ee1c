"""grpcio settings that must be in place before grpc's core starts.

Importing this module sets ``GRPC_EXPERIMENTS`` (unless the environment already
sets it, even to an empty value) to turn off grpc core's EventEngine listener and
endpoints, :data:`GRPC_EXPERIMENTS`: grpc then uses its classic (iomgr) TCP
code, which costs the synchronous server about a quarter less CPU per unary call
on a one-core server (benchmarks/RESULTS.md, "Issue 11 point 3: gRPC"; no
difference for ``grpc.aio``). grpc reads the variable once, when it is first
imported, so ``pdserve.app.cli`` imports this module before anything else: a
process that imported ``grpc`` earlier (an embedding application, a test run)
keeps grpc's defaults, which work the same, only slower.
"""

from __future__ import annotations

import os

#: The experiments turned off (grpc core's names, ``-`` = disabled).
GRPC_EXPERIMENTS = "-event_engine_listener,-event_engine_for_all_other_endpoints"

#: ``--grpc-server`` choices: the native HTTP/2 transport on the event loop
#: (:mod:`pdserve.frontends.grpc.native`), grpcio's synchronous server with the servicer
#: bridged onto the event loop (:mod:`pdserve.frontends.grpc.sync_bridge`), or ``grpc.aio``.
GRPC_SERVERS = ("native", "threads", "aio")


def default_grpc_server() -> str:
    """``--grpc-server``'s default: ``$PDSERVE_GRPC_SERVER`` when set and not empty (so a
    test run can use either server throughout; a value that is not a choice is
    refused by ``Settings.validate``), else ``native``."""
    return os.environ.get("PDSERVE_GRPC_SERVER", "").strip() or "native"


if "GRPC_EXPERIMENTS" not in os.environ:
    os.environ["GRPC_EXPERIMENTS"] = GRPC_EXPERIMENTS
