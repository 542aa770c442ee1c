"""Triton's statistics extension over the served versions of a model table.

One home for how a statistics request names models and versions: no name means
every served version of every model, a name without a version every served version
of that model, and a version must be one of the served ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.core.errors import InferError
from pdserve.repository.entry import ModelEntry


def statistics_of(models: Mapping[str, ModelEntry], name: str, version: str) -> dict[str, Any]:
    """``{"model_stats": [...]}`` for ``name`` / ``version`` ("" for all) of ``models``.

    Raises:
        InferError(INVALID_ARG): the model is unknown or has no ready version, or
            ``version`` is not one of them (HTTP 400, gRPC INVALID_ARGUMENT, as
            Triton's ``TRITONSERVER_ServerModelStatistics`` answers).
    """
    if name:
        entry = models.get(name)
        if entry is None or not entry.serving:
            raise InferError(f"requested model '{name}' is not available")
        if version:
            mv = None
            if version.isascii() and version.isdigit() and len(version) <= 19:
                mv = entry.serving.get(int(version))
            if mv is None:
                raise InferError(
                    f"requested model version '{version}' is not available for model '{name}'"
                )
            versions = [mv]
        else:
            versions = list(entry.serving.values())
    else:
        versions = [mv for _, e in sorted(models.items()) for mv in e.serving.values()]
    return {"model_stats": [mv.stats.as_dict() for mv in versions]}
