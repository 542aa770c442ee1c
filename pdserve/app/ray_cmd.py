"""``pdserve ray``: deploy a model repository onto a running Ray cluster, show it, tear it down.

``deploy`` builds the one-hop application (``--shape server``: one deployment whose
every replica serves all the models over HTTP and gRPC) or one deployment per model
behind an ingress (``--shape split``), starts Serve's proxies if Serve is not running
(HTTP, and gRPC with the KServe V2 service) and waits at most ``--timeout`` seconds: a
deployment that cannot be placed fails naming what it asked for and what the cluster
has. ``status`` prints the applications; ``teardown`` deletes one. Ray is imported only
when a subcommand runs (``pip install 'pdserve[ray]'``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

from pdserve.app.subcommands import Subparsers

T = TypeVar("T")

DEFAULT_NAME = "pdserve"

#: Serve's options that set a deployment's replica count (one excludes the other).
_SCALING = frozenset({"num_replicas", "autoscaling_config"})


def per_model(values: list[str], parse: Callable[[str], T]) -> tuple[T | None, dict[str, T]]:
    """``[VALUE | MODEL=VALUE, ...]`` -> (the value for every deployment, per model).

    Raises:
        ValueError: a value ``parse`` refuses, or two values for the same target.
    """
    every: T | None = None
    models: dict[str, T] = {}
    for text in values:
        # a JSON value may hold "=": only a name before the first "=" is a model
        model, sep, value = ("", "", text) if text.startswith("{") else text.partition("=")
        if not sep:
            model, value = "", text
        if sep and model:
            if model in models:
                raise ValueError(f"two values for model '{model}'")
            models[model] = parse(value)
        else:
            if every is not None:
                raise ValueError("two values for every deployment")
            every = parse(value)
    return every, models


def autoscale(text: str) -> dict[str, object]:
    """``MIN:MAX[:TARGET]`` -> Serve's ``autoscaling_config`` (target ongoing requests
    per replica, default 2).

    Raises:
        ValueError: not that form, or MIN > MAX.
    """
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"expected MIN:MAX[:TARGET], got {text!r}")
    lo, hi = int(parts[0]), int(parts[1])
    if lo < 0 or hi < max(lo, 1):
        raise ValueError(f"expected 0 <= MIN <= MAX and MAX >= 1, got {text!r}")
    target = float(parts[2]) if len(parts) == 3 else 2.0
    return {"min_replicas": lo, "max_replicas": hi, "target_ongoing_requests": target}


def _count(low: int) -> Callable[[str], int]:
    """A parser of an integer >= ``low`` (replicas, ongoing requests)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise ValueError(f"expected an integer >= {low}, got {text!r}")
        return value

    return parse


def _amount(text: str) -> float:
    """A finite number >= 0 (CPUs or GPUs a replica reserves)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise ValueError(f"expected a number >= 0, got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object.

    Raises:
        ValueError: not JSON, or not an object.
    """
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, got {text!r}")
    return value


def deployment_options(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The ``--replicas`` / ``--autoscale`` / ``--num-cpus`` / ``--num-gpus`` /
    ``--max-ongoing-requests`` / ``--max-replicas-per-node`` / ``--serve-options`` flags
    as Serve options: ``{"*": every deployment's, MODEL: that model's}`` (``--shape
    server`` has only ``"*"``). ``--serve-options`` objects merge into what the other
    flags set (``{"autoscaling_config": {"upscale_delay_s": 1}}`` keeps ``--autoscale``'s
    replicas).

    Raises:
        ValueError: a bad value; a per-model value with ``--shape server``; replicas
            and autoscaling for the same deployment.
    """
    out: dict[str, dict[str, Any]] = {}

    def put(flag: str, values: list[str], parse: Callable[[str], Any], key: str) -> None:
        try:
            every, models = per_model(values, parse)
        except ValueError as e:
            raise ValueError(f"{flag}: {e}") from None
        if models and args.shape == "server":
            raise ValueError(
                f"{flag} MODEL=VALUE needs --shape split (with --shape server every "
                "replica holds every model)"
            )
        for target, value in ([("*", every)] if every is not None else []) + list(models.items()):
            opts = out.setdefault(target, {})
            if key.startswith("ray_actor_options."):
                opts.setdefault("ray_actor_options", {})[key.split(".", 1)[1]] = value
            else:
                opts[key] = value

    if not 0 < args.timeout < math.inf:
        raise ValueError(f"--timeout: expected a number of seconds > 0, got {args.timeout}")
    put("--replicas", args.replicas, _count(1), "num_replicas")  # Serve refuses 0
    put("--autoscale", args.autoscale, autoscale, "autoscaling_config")
    put("--num-cpus", args.num_cpus, _amount, "ray_actor_options.num_cpus")
    put("--num-gpus", args.num_gpus, _amount, "ray_actor_options.num_gpus")
    put("--max-ongoing-requests", args.max_ongoing_requests, _count(1), "max_ongoing_requests")
    put("--max-replicas-per-node", args.max_replicas_per_node, _count(1), "max_replicas_per_node")
    every, models = per_model(args.serve_options, _json_object)
    if models and args.shape == "server":
        raise ValueError("--serve-options MODEL=JSON needs --shape split")
    for target, extra in ([("*", every)] if every is not None else []) + list(models.items()):
        opts = out.setdefault(target, {})
        for key, value in extra.items():
            if isinstance(value, dict) and isinstance(opts.get(key), dict):
                opts[key] = {**opts[key], **value}  # e.g. autoscaling_config's delays
            else:
                opts[key] = value
    for target, opts in out.items():
        if "num_replicas" in opts and "autoscaling_config" in opts:
            who = "every deployment" if target == "*" else f"model '{target}'"
            raise ValueError(f"--replicas and --autoscale both given for {who}")
    return out


def add_parser(sub: Subparsers) -> argparse.ArgumentParser:
    """Add ``pdserve ray`` (``deploy``, ``status``, ``teardown``) to the subcommands."""
    p = sub.add_parser(
        "ray",
        help="deploy a model repository onto a Ray cluster (Ray Serve), show it, tear it down",
        description="deploy: a repository as a Ray Serve application on a running cluster "
        "(--shape server: one deployment, every replica a whole server for HTTP and gRPC; "
        "--shape split: a deployment per model behind an ingress), waiting at most --timeout "
        "s; a deployment that cannot be placed fails naming what it asked for and what the "
        "cluster has. status: the applications and their replicas. teardown: delete one. "
        "`pdserve ray deploy --help` lists deploy's flags.",
    )
    actions = p.add_subparsers(
        dest="ray_command", required=True, metavar="{deploy,status,teardown}"
    )
    d = actions.add_parser("deploy", help="deploy a repository as a Serve application")
    d.description = "Deploy a model repository onto a running Ray cluster (Ray Serve)."
    d.add_argument("model_repository", help="the repository folder (the same path on every node)")
    d.add_argument("--models", default="", help="comma-separated models (default: all)")
    d.add_argument(
        "--shape",
        choices=("server", "split"),
        default="server",
        help="server (default): one deployment, every replica a whole server; split: a "
        "deployment per model behind an ingress",
    )
    per = "MODEL=VALUE: that model's deployment (--shape split); VALUE: every deployment"
    for flag, metavar, what in (
        ("--replicas", "[MODEL=]N", "replicas"),
        ("--autoscale", "[MODEL=]MIN:MAX[:TARGET]", "autoscaling (target ongoing requests 2)"),
        ("--num-cpus", "[MODEL=]CPUS", "CPUs a replica reserves (default: its models')"),
        ("--num-gpus", "[MODEL=]GPUS", "GPUs a replica reserves (default: its models')"),
        ("--max-ongoing-requests", "[MODEL=]N", "Serve's per-replica limit (one hop: 64)"),
        ("--max-replicas-per-node", "[MODEL=]N", "replicas on one node at most"),
        ("--serve-options", "[MODEL=]JSON", "more Serve deployment options, as JSON"),
    ):
        d.add_argument(flag, action="append", default=[], metavar=metavar, help=f"{what}; {per}")
    d.add_argument("--host", default="127.0.0.1", help="Serve's proxies' address")
    d.add_argument("--http-port", type=int, default=8000, help="Serve's HTTP proxy port")
    d.add_argument("--grpc-port", type=int, default=9000, help="Serve's gRPC proxy port")
    d.add_argument(
        "--route-prefix",
        default="/",
        help="the application's HTTP route prefix (default /: the V2 routes at the root; "
        "a second application on the same cluster needs its own, e.g. /b)",
    )
    d.add_argument(
        "--timeout", type=float, default=120.0, help="seconds to wait for RUNNING (default 120)"
    )
    status = actions.add_parser("status", help="the application's status and its replicas")
    status.add_argument("--all", action="store_true", help="every Serve application")
    teardown = actions.add_parser("teardown", help="delete the application from Serve")
    for action in (d, status, teardown):
        action.add_argument(
            "--address", default=os.environ.get("RAY_ADDRESS"), help="the Ray cluster (GCS)"
        )
        action.add_argument("--name", default=DEFAULT_NAME, help="the Serve application")
        action.add_argument(
            "--node-ip-address",
            default=None,
            help="this machine's address as the cluster sees it (default: Ray's guess)",
        )
    p.set_defaults(run=lambda args: run(args, p))
    return p


def _build(args: argparse.Namespace, opts: dict[str, dict[str, Any]]) -> tuple[Any, dict]:
    """The application and its deployments' planned Serve options."""
    from pdserve.ray.deployments import application
    from pdserve.ray.plan import INGRESS_NAME, SERVER_NAME, plan_application, plan_server
    from pdserve.ray.server_replica import server_application

    models = [m for m in args.models.split(",") if m] or None
    every = opts.pop("*", {})
    if args.shape == "server":
        plan = plan_server(args.model_repository, models, every)
        app = server_application(args.model_repository, models, every)
        return app, {SERVER_NAME: plan.options}
    names = [p.model for p in plan_application(args.model_repository, models)]
    unknown = sorted(set(opts) - set(names))
    if unknown:
        raise ValueError(f"options given for models that are not served: {unknown}")
    per: dict[str, dict[str, Any]] = {}
    for name in names:
        own = opts.get(name, {})
        # a model's own replicas or autoscaling replace every deployment's
        scaling = _SCALING & own.keys()
        merged = {k: v for k, v in every.items() if not (scaling and k in _SCALING)}
        merged.update(own)
        if "ray_actor_options" in every and "ray_actor_options" in own:
            merged["ray_actor_options"] = {
                **every["ray_actor_options"],
                **own["ray_actor_options"],
            }
        per[name] = merged
    plans = plan_application(args.model_repository, models, per)
    app = application(args.model_repository, models, per)
    planned = {p.model: p.options for p in plans}
    planned[INGRESS_NAME] = {"ray_actor_options": {"num_cpus": 0.5}}
    return app, planned


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run ``pdserve ray ACTION``; the exit code: 0 done, 1 the cluster refused or the
    application did not start (the reason is printed), 2 bad flags."""
    try:
        from pdserve.ray import control
    except ImportError as e:
        print(f"pdserve ray: Ray Serve is not installed ({e}): pip install 'pdserve[ray]'")
        return 1
    try:
        opts = deployment_options(args) if args.ray_command == "deploy" else {}
    except ValueError as e:
        parser.error(str(e))
    try:
        control.connect(args.address, args.node_ip_address)
    except (ConnectionError, RuntimeError) as e:
        print(f"pdserve ray: no Ray cluster at {args.address or 'auto'}: {e}")
        return 1
    if args.ray_command == "status":
        try:
            print(json.dumps(control.status(None if args.all else args.name), indent=2))
        except KeyError as e:
            print(f"pdserve ray status: {e.args[0]}")
            return 1
        return 0
    if args.ray_command == "teardown":
        try:
            control.teardown(args.name)
        except KeyError as e:
            print(f"pdserve ray teardown: {e.args[0]}")
            return 1
        print(f"deleted application '{args.name}'")
        return 0
    try:
        app, planned = _build(args, opts)
    except ValueError as e:
        parser.error(str(e))
    control.start_proxies(control.Proxies(args.host, args.http_port, args.grpc_port))
    try:
        took = control.deploy(
            app, args.name, planned, timeout_s=args.timeout, route_prefix=args.route_prefix
        )
    except control.DeployError as e:
        print(f"pdserve ray deploy: {e}")
        return 1
    for dep, o in planned.items():
        print(f"deployment '{dep}': one replica reserves {o.get('ray_actor_options')}")
    # where Serve says the application answers: its proxies, or under direct ingress
    # its replicas' own ports; else the proxies asked for
    where = control.endpoints(args.name)
    http = ", ".join(f"http://{e}" for e in where.get("http", []))
    grpc = ", ".join(where.get("grpc", []))
    print(
        f"application '{args.name}' RUNNING after {took:.1f} s; HTTP "
        f"{http or f'http://{args.host}:{args.http_port}'}, gRPC "
        f"{grpc or f'{args.host}:{args.grpc_port}'}"
    )
    shared = where.get("http", [])
    if len(set(shared)) < len(shared):  # replicas on several nodes, each on its loopback
        print(
            "note: replicas on several nodes listen on the same loopback address; start "
            "Serve with --host 0.0.0.0 to reach each from other machines"
        )
    return 0
