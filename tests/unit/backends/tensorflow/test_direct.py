"""pdserve.backends.tensorflow.direct: a signature's graph function in one eager execute,
with the executor's call attributes made once; None (the flat call) where it cannot be."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pdserve.backends.tensorflow.direct import SINGLE_THREADED, DirectCall
from pdserve.backends.tensorflow.savedmodel import flat_inputs, import_tf
from tests.tensorflow_models import write_string_savedmodel, write_variable_savedmodel

pytest.importorskip("tensorflow")


def _signature(folder: Path) -> object:
    return import_tf().saved_model.load(str(folder)).signatures["serving_default"]


def test_a_call_with_variables_on_either_executor(tmp_path: Path) -> None:
    fn = _signature(write_variable_savedmodel(tmp_path / "m", 2.5))
    call = DirectCall.of(fn, flat_inputs(fn) or [])
    assert call is not None
    assert call.inputs == [("x", import_tf().float32.as_datatype_enum)]
    assert call.outputs == ["y"] and len(call.captured) == 1
    assert SINGLE_THREADED in call.attrs[True] and SINGLE_THREADED not in call.attrs[False]
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    for single_threaded in (False, True):
        np.testing.assert_array_equal(call({"x": x}, single_threaded)["y"].numpy(), x * 2.5)


def test_no_direct_call_for_strings_or_without_the_internals(tmp_path: Path) -> None:
    fn = _signature(write_string_savedmodel(tmp_path / "s"))
    assert DirectCall.of(fn, flat_inputs(fn) or []) is None
    assert DirectCall.of(SimpleNamespace(captured_inputs=[]), []) is None  # no graph function
