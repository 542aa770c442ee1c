"""statistics_of: the statistics extension's choice of versions and its errors."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pytest

from pdserve.core.errors import ErrorCode, InferError
from pdserve.core.stats import ModelStats
from pdserve.repository.entry import ModelEntry
from pdserve.repository.statistics import statistics_of


@dataclass
class _Served:
    """What statistics_of reads of a served version: its statistics."""

    stats: ModelStats


def _entry(name: str, *versions: int) -> ModelEntry:
    entry = ModelEntry(name)
    entry.serving = cast(Any, {v: _Served(ModelStats(name, str(v))) for v in versions})
    return entry


MODELS = {"b": _entry("b", 1, 3), "a": _entry("a", 2), "idle": ModelEntry("idle")}


def _ids(result: dict[str, Any]) -> list[tuple[str, str]]:
    return [(row["name"], row["version"]) for row in result["model_stats"]]


def test_every_served_version_by_name_then_version() -> None:
    assert _ids(statistics_of(MODELS, "", "")) == [("a", "2"), ("b", "1"), ("b", "3")]


def test_one_model_and_one_version() -> None:
    assert _ids(statistics_of(MODELS, "b", "")) == [("b", "1"), ("b", "3")]
    assert _ids(statistics_of(MODELS, "b", "3")) == [("b", "3")]


@pytest.mark.parametrize(
    ("name", "version", "message"),
    [
        ("nope", "", "requested model 'nope' is not available"),
        ("idle", "", "requested model 'idle' is not available"),
        ("b", "2", "requested model version '2' is not available for model 'b'"),
        ("b", "x1", "requested model version 'x1' is not available for model 'b'"),
        ("b", "9" * 20, "is not available for model 'b'"),
    ],
)
def test_unknown_model_or_version_is_invalid_arg(name: str, version: str, message: str) -> None:
    with pytest.raises(InferError) as e:
        statistics_of(MODELS, name, version)
    assert message in e.value.message
    assert e.value.code == ErrorCode.INVALID_ARG
