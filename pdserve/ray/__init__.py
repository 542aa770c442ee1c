"""Ray Serve deployment of a model repository (the optional extra ``pdserve[ray]``).

:mod:`pdserve.ray.plan` (no Ray import) turns a repository into deployment plans;
:mod:`pdserve.ray.server_replica` builds the one-hop application (every replica a whole
server: ``server_application``), :mod:`pdserve.ray.deployments` the one of a deployment
per model (``application``) and ``build_app`` (``serve run``); :mod:`pdserve.ray.control`
deploys onto a running cluster (``pdserve ray``). They are imported on first use, so
that ``import pdserve.ray`` works without Ray installed.
"""

from __future__ import annotations

__all__ = ["application", "build_app", "server_application"]


def __getattr__(name: str) -> object:
    if name == "server_application":
        from pdserve.ray import server_replica

        return server_replica.server_application
    if name in __all__:
        from pdserve.ray import deployments

        return getattr(deployments, name)
    raise AttributeError(f"module 'pdserve.ray' has no attribute {name!r}")
