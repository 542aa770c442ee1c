"""Unit tests for pdserve.backends.fil.postprocess: FIL's output__0 rules."""

from __future__ import annotations

import numpy as np

from pdserve.backends.fil.forest import ForestInfo
from pdserve.backends.fil.params import FilParams
from pdserve.backends.fil.postprocess import allowed_widths, fil_output, output_width

BINARY = ForestInfo(num_feature=4, num_class=1, task_type="kBinaryClf", postprocessor="sigmoid")
MULTI = ForestInfo(num_feature=4, num_class=3, task_type="kMultiClf", postprocessor="softmax")
REG = ForestInfo(num_feature=4, num_class=1, task_type="kRegressor", postprocessor="identity")


def test_widths() -> None:
    proba = FilParams(is_classifier=True, predict_proba=True)
    ids = FilParams(is_classifier=True)
    assert output_width(BINARY, proba) == 2 and allowed_widths(BINARY, proba) == (2, 1)
    assert output_width(MULTI, proba) == 3 and allowed_widths(MULTI, proba) == (3,)
    assert output_width(BINARY, ids) == 1 and output_width(MULTI, ids) == 1
    assert output_width(REG, FilParams()) == 1


def test_binary_scores() -> None:
    p = np.array([[0.2], [0.7], [0.5]], dtype=np.float32)
    proba = FilParams(is_classifier=True, predict_proba=True)
    np.testing.assert_allclose(
        fil_output(p, proba, 2), [[0.8, 0.2], [0.3, 0.7], [0.5, 0.5]], rtol=1e-6
    )
    np.testing.assert_array_equal(fil_output(p, proba, 1), p)
    # class ids: strictly above the threshold is class 1
    np.testing.assert_array_equal(fil_output(p, FilParams(is_classifier=True), 1), [[0], [1], [0]])
    low = FilParams(is_classifier=True, threshold=0.1)
    np.testing.assert_array_equal(fil_output(p, low, 1), [[1], [1], [1]])
    assert fil_output(p, low, 1).dtype == np.float32


def test_multiclass_ids_are_the_first_best() -> None:
    s = np.array([[0.1, 0.6, 0.3], [0.4, 0.2, 0.4]], dtype=np.float32)
    out = fil_output(s, FilParams(is_classifier=True), 1)
    np.testing.assert_array_equal(out, [[1.0], [0.0]])
    assert out.dtype == np.float32
    np.testing.assert_array_equal(
        fil_output(s, FilParams(is_classifier=True, predict_proba=True), 3), s
    )


def test_regression_is_the_prediction() -> None:
    s = np.array([[12.5], [-3.0]], dtype=np.float32)
    np.testing.assert_array_equal(fil_output(s, FilParams(), 1), s)
