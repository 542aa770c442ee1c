"""Ray Serve deployment of a model repository (the optional extra ``pdserve[ray]``).

:mod:`pdserve.ray.plan` (no Ray import) turns a repository into deployment plans;
:mod:`pdserve.ray.deployments` builds the Serve application. ``build_app`` and
``application`` are imported from there on first use, so that ``import pdserve.ray``
works without Ray installed.
"""

from __future__ import annotations

__all__ = ["application", "build_app"]


def __getattr__(name: str) -> object:
    if name in __all__:
        from pdserve.ray import deployments

        return getattr(deployments, name)
    raise AttributeError(f"module 'pdserve.ray' has no attribute {name!r}")
