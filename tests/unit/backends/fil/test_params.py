"""Unit tests for pdserve.backends.fil.params: FIL's parameters read as Triton's FIL
backend reads them."""

from __future__ import annotations

import pytest
from tritonclient.grpc import model_config_pb2

from pdserve.backends.fil.params import FilParams, read_params
from pdserve.config import ConfigError


def cfg(**params: str) -> model_config_pb2.ModelConfig:
    c = model_config_pb2.ModelConfig(name="m", backend="fil")
    for k, v in params.items():
        c.parameters[k].string_value = v
    return c


def test_defaults_are_fils() -> None:
    assert read_params(cfg(), "c") == FilParams(
        model_type="xgboost",
        is_classifier=False,
        predict_proba=False,
        threshold=0.5,
        allow_unknown_field=False,
        cpu_nthread=1,
        predictor="auto",
    )


def test_values_are_read() -> None:
    p = read_params(
        cfg(
            model_type="lightgbm",
            is_classifier="true",
            predict_proba="True",
            threshold="0.3",
            xgboost_allow_unknown_field="true",
            cpu_nthread="2",
            predictor="gtil",
            storage_type="SPARSE",  # GPU-only: accepted, ignored
            algo="NAIVE",
        ),
        "c",
    )
    assert (p.model_type, p.is_classifier, p.predict_proba) == ("lightgbm", True, True)
    assert (p.threshold, p.allow_unknown_field, p.cpu_nthread, p.predictor) == (
        0.3,
        True,
        2,
        "gtil",
    )


def test_output_class_is_the_older_is_classifier() -> None:
    assert read_params(cfg(output_class="true"), "c").is_classifier is True
    # is_classifier wins when both are given
    assert read_params(cfg(output_class="true", is_classifier="false"), "c").is_classifier is False


@pytest.mark.parametrize(
    ("params", "field", "text"),
    [
        ({"model_type": "catboost"}, "parameters.model_type", "'catboost' is not a FIL model_type"),
        ({"predict_proba": "maybe"}, "parameters.predict_proba", "'maybe' is not true or false"),
        ({"threshold": "high"}, "parameters.threshold", "'high' is not a number"),
        ({"cpu_nthread": "1.5"}, "parameters.cpu_nthread", "'1.5' is not an integer"),
        ({"predictor": "cuml"}, "parameters.predictor", "'cuml' is not one of auto"),
    ],
)
def test_bad_values_name_the_parameter(params: dict[str, str], field: str, text: str) -> None:
    with pytest.raises(ConfigError) as e:
        read_params(cfg(**params), "repo/m/config.pbtxt")
    assert e.value.field == field
    assert text in e.value.message
