"""Deploy an application onto a running Ray cluster, show it, tear it down (``pdserve ray``).

:func:`deploy` connects to the cluster, starts Serve's proxies when they are not running
(HTTP, and gRPC with the KServe ``GRPCInferenceService`` registered), checks that one
replica of each deployment fits on some node, runs the application and waits a bounded
time for it: a deployment that cannot be placed fails with a :class:`DeployError` naming
the resources it asked for and what the cluster has (and the application is deleted, so
nothing stays pending). :func:`status` and :func:`teardown` read and delete applications.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.serve import Application

from pdserve.ray.grpc_proxy import SERVICER_FUNCTION

#: Serve's names of the resources a replica asks for -> Ray's resource names.
_RESOURCE_NAMES = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}


#: Listen addresses meaning every interface (clients then use the node's address).
_ANY_HOST = frozenset(("0.0.0.0", "::", "[::]", ""))


class DeployError(RuntimeError):
    """The application did not become RUNNING (the message says why)."""


@dataclass
class Proxies:
    """Where Serve's proxies listen (used only when Serve is not running yet)."""

    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 9000
    location: str = "HeadOnly"


def connect(address: str | None, node_ip: str | None = None) -> None:
    """Connect this process to the cluster at ``address`` (None: ``RAY_ADDRESS`` or a
    local one, Ray's ``auto``).

    Args:
        node_ip: this machine's address as the cluster sees it (None: Ray's guess).

    Raises:
        ConnectionError: no cluster there; an explicit ``host:port`` where nothing
            accepts a connection fails within :data:`PROBE_S` seconds (Ray's own
            connection retries would take minutes).
    """
    if not ray.is_initialized():
        _probe(address)
        ray.init(
            address=address or "auto",
            _node_ip_address=node_ip,
            logging_level=logging.WARNING,
            log_to_driver=False,
            namespace="serve",
        )


#: Seconds to wait for a TCP connection to an explicit cluster address.
PROBE_S = 5.0


def _probe(address: str | None) -> None:
    """Raise ConnectionError when ``address`` is a ``host:port`` (the GCS) where nothing
    accepts a TCP connection; other forms (None, ``auto``, ``ray://...``) pass."""
    if not address or "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S).close()
    except (OSError, ValueError) as e:
        raise ConnectionError(f"nothing accepts a connection at {address} ({e})") from None


def start_proxies(proxies: Proxies) -> None:
    """Start Serve with its HTTP and gRPC proxies (the gRPC one serving the KServe V2
    service); a Serve already running keeps its own proxies."""
    serve.start(
        proxy_location=proxies.location,
        http_options={"host": proxies.host, "port": proxies.http_port},
        grpc_options={
            "port": proxies.grpc_port,
            "grpc_servicer_functions": [SERVICER_FUNCTION],
        },
    )


def replica_resources(actor_options: Mapping[str, Any]) -> dict[str, float]:
    """Ray resource name -> amount one replica with ``ray_actor_options`` reserves."""
    need = {_RESOURCE_NAMES[k]: float(v) for k, v in actor_options.items() if k in _RESOURCE_NAMES}
    need.update({str(k): float(v) for k, v in (actor_options.get("resources") or {}).items()})
    return {k: v for k, v in need.items() if v > 0}


#: Resources a cluster's summary leaves out (in bytes; every node has them).
_UNSHOWN = frozenset({"memory", "object_store_memory"})


def _fmt(resources: Mapping[str, float]) -> str:
    shown = {
        k: v
        for k, v in resources.items()
        if v > 0 and not k.startswith("node:") and k not in _UNSHOWN
    }
    return ", ".join(f"{k} {v:g}" for k, v in sorted(shown.items())) or "nothing"


def cluster_summary() -> str:
    """The cluster's resources: in all, free now and per alive node."""
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    per_node = "; ".join(f"{n['NodeManagerAddress']}: {_fmt(n['Resources'])}" for n in nodes)
    return (
        f"the cluster has {_fmt(ray.cluster_resources())} in all, "
        f"{_fmt(ray.available_resources())} free ({len(nodes)} nodes: {per_node})"
    )


def _state(value: object) -> str:
    """A Serve status enum as its name (``RUNNING``)."""
    return str(getattr(value, "value", value))


def check_fits(deployments: Mapping[str, Mapping[str, Any]]) -> None:
    """Fail now when one replica of a deployment fits on no alive node.

    Args:
        deployments: deployment name -> its Serve options (``ray_actor_options``).

    Raises:
        DeployError: names the deployment, what one replica asks for and the cluster.
    """
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    for name, opts in deployments.items():
        need = replica_resources(opts.get("ray_actor_options") or {})
        if not any(all(node.get(k, 0.0) >= v for k, v in need.items()) for node in nodes):
            raise DeployError(
                f"deployment '{name}' cannot be placed: one replica asks for {_fmt(need)} "
                f"and no node has that; {cluster_summary()}. Ask for less "
                "(--num-cpus, fewer models or instances) or add nodes"
            )


def deploy(
    app: Application,
    name: str,
    deployments: Mapping[str, Mapping[str, Any]],
    timeout_s: float = 120.0,
    route_prefix: str = "/",
) -> float:
    """Run ``app`` as application ``name`` and wait until it is RUNNING.

    Args:
        deployments: its deployment names -> their Serve options (for the checks and
            the error message).
        timeout_s: how long to wait for RUNNING.

    Returns:
        the seconds it took.

    Raises:
        DeployError: a replica fits on no node (before deploying), or the application
            failed or was not RUNNING within ``timeout_s`` (then it is deleted): the
            message names the deployments not running, what their replicas ask for,
            Serve's own message and the cluster's resources.
    """
    check_fits(deployments)
    t0 = time.monotonic()
    # serve.run waits for RUNNING without a bound; _run(_blocking=False) returns once
    # the controller has the application (Ray is pinned in the ``ray`` extra)
    try:
        serve._run(app, _blocking=False, name=name, route_prefix=route_prefix)
    except Exception as e:  # noqa: BLE001 - Serve's refusal, e.g. a route prefix in use
        lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
        raise DeployError(
            f"Serve refused application '{name}' at route prefix '{route_prefix}': "
            f"{lines[-1] if lines else type(e).__name__}"
        ) from e
    state = ""
    while time.monotonic() - t0 < timeout_s:
        app_status = serve.status().applications.get(name)
        state = _state(app_status.status) if app_status is not None else "MISSING"
        if state == "RUNNING":
            return time.monotonic() - t0
        if state == "DEPLOY_FAILED":
            break
        time.sleep(0.5)
    why = _not_running(name, deployments)
    serve.delete(name)
    waited = f"within {timeout_s:g} s" if state != "DEPLOY_FAILED" else "(DEPLOY_FAILED)"
    raise DeployError(f"application '{name}' did not start {waited}: {why}; {cluster_summary()}")


def _not_running(name: str, deployments: Mapping[str, Mapping[str, Any]]) -> str:
    app_status = serve.status().applications.get(name)
    if app_status is None:
        return "Serve does not know it"
    parts = []
    for dep, st in app_status.deployments.items():
        if _state(st.status) == "HEALTHY":
            continue
        need = replica_resources(deployments.get(dep, {}).get("ray_actor_options", {}))
        states = ", ".join(f"{_state(k)} {v}" for k, v in st.replica_states.items())
        msg = f" ({st.message})" if st.message else ""
        parts.append(
            f"deployment '{dep}' is {_state(st.status)} [replicas: {states or 'none'}], "
            f"one replica asks for {_fmt(need)}{msg}"
        )
    if app_status.message:
        parts.append(app_status.message)
    return "; ".join(parts) or _state(app_status.status)


def status(name: str | None = None) -> dict[str, Any]:
    """Serve's applications (``name``: that one) with their deployments' status and
    replica counts by state, and the cluster's resources.

    Raises:
        KeyError: no application ``name``.
    """
    apps = serve.status().applications
    if name is not None and name not in apps:
        raise KeyError(f"no Serve application '{name}' (there are: {sorted(apps) or 'none'})")
    doc: dict[str, Any] = {"applications": {}, "cluster": cluster_summary()}
    for app_name, app in sorted(apps.items()):
        if name is not None and app_name != name:
            continue
        doc["applications"][app_name] = {
            "status": _state(app.status),
            "message": app.message,
            "deployments": {
                dep: {
                    "status": _state(st.status),
                    "replicas": {_state(k): v for k, v in st.replica_states.items()},
                }
                for dep, st in app.deployments.items()
            },
            "endpoints": endpoints(app_name),
        }
    return doc


def endpoints(app_name: str) -> dict[str, list[str]]:
    """Where application ``app_name`` answers, per protocol (``http``, ``grpc``): the
    ``host:port`` of Serve's proxies, or under Serve's direct ingress (the cluster
    started with ``RAY_SERVE_ENABLE_DIRECT_INGRESS=1``) of the application's own
    replicas, each serving HTTP and gRPC on a port of its own. HTTP entries end with the
    application's route prefix when it is not ``/``; an IPv6 host is bracketed. Empty
    when Serve does not say (the controller's target groups are Serve's alpha API)."""
    try:
        from ray.serve.context import _get_global_client

        client = _get_global_client()
        if client is None:
            return {}
        controller = client._controller
        groups = ray.get(controller.get_target_groups.remote(app_name), timeout=10)
        http_host = ray.get(controller.get_http_config.remote(), timeout=10).host
        details = ray.get(controller.get_serve_instance_details.remote(), timeout=10)
        prefix = (details.get("applications", {}).get(app_name) or {}).get("route_prefix")
    except Exception:  # noqa: BLE001 - an older or newer Serve: the rest of status stands
        return {}
    path = "" if prefix in (None, "", "/") else str(prefix).rstrip("/")
    found: dict[str, list[str]] = {}
    for group in groups:
        if group.app_name and group.app_name != app_name:
            continue
        protocol = str(getattr(group.protocol, "value", group.protocol)).lower()
        for t in group.targets:
            # HTTP listens on Serve's http_options host (the node's address when that is
            # every interface); gRPC on every interface
            if protocol == "http":
                host = http_host if http_host not in _ANY_HOST else t.ip
                found.setdefault(protocol, []).append(_host_port(host, t.port) + path)
            else:
                found.setdefault(protocol, []).append(_host_port(t.ip, t.port))
    return found


def _host_port(host: str, port: int) -> str:
    """``host:port``, an IPv6 host in brackets (``[::1]:30000``)."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def teardown(name: str) -> None:
    """Delete application ``name`` (its replicas end after their in-flight requests).

    Raises:
        KeyError: no application ``name``.
    """
    if name not in serve.status().applications:
        raise KeyError(f"no Serve application '{name}'")
    serve.delete(name)
