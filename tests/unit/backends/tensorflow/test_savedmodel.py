"""Opening a SavedModel and choosing its signature as Triton's tensorflow backend does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from pdserve.backends.tensorflow.backend import run_signature
from pdserve.backends.tensorflow.savedmodel import load_signature
from tests.tensorflow_models import (
    write_dashed_savedmodel,
    write_keyed_savedmodel,
    write_savedmodel,
    write_string_savedmodel,
    write_two_input_savedmodel,
    write_variable_savedmodel,
)

pytest.importorskip("tensorflow")


def _cfg(**params: str) -> model_config_pb2.ModelConfig:
    text = "".join(
        f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}\n' for k, v in params.items()
    )
    return text_format.Parse(text, model_config_pb2.ModelConfig(name="m"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_savedmodel(tmp_path_factory.mktemp("tf") / "model.savedmodel")


def test_serving_default_is_the_default_signature(saved: Path) -> None:
    sig = load_signature(_cfg(), saved, "m")
    assert sig.key == "serving_default"
    assert (sig.inputs, sig.outputs) == ([("x", "FP32", [None, 4])], [("y", "FP32", [None, 4])])
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(run_signature(sig, {"x": x})["y"], x * 2)


def test_a_signature_call_matches_inputs_and_outputs_by_name(tmp_path: Path) -> None:
    sig = load_signature(_cfg(), write_two_input_savedmodel(tmp_path / "m"), "m")
    a = np.array([[5, 7]], np.float32)
    b = np.array([[1, 2]], np.float32)
    out = run_signature(sig, {"subtrahend": b, "minuend": a})
    np.testing.assert_array_equal(out["difference"], [[4, 5]])
    np.testing.assert_array_equal(out["sum"], [[6, 9]])
    keywords = sig.function(minuend=a, subtrahend=b)  # TensorFlow's own keyword call
    np.testing.assert_array_equal(keywords["difference"].numpy(), out["difference"])


@pytest.mark.parametrize("single_threaded", [False, True])
def test_the_direct_call_gives_what_the_signature_gives(
    tmp_path: Path, single_threaded: bool
) -> None:
    """A numeric signature runs in one execute of its graph function (DirectCall), on
    either executor, with the outputs TensorFlow's own keyword call gives, by name."""
    sig = load_signature(_cfg(), write_two_input_savedmodel(tmp_path / "m"), "m")
    assert sig._direct is not None and sig._direct.outputs == ["difference", "sum"]
    a = np.array([[5, 7], [1, 1]], np.float32)
    b = np.array([[1, 2], [3, 4]], np.float32)
    out = sig.run({"subtrahend": b, "minuend": a}, single_threaded)
    keywords = sig.function(minuend=a, subtrahend=b)
    assert sorted(out) == ["difference", "sum"]
    for name in out:
        np.testing.assert_array_equal(out[name].numpy(), keywords[name].numpy())


def test_the_direct_call_passes_the_variables(tmp_path: Path) -> None:
    sig = load_signature(_cfg(), write_variable_savedmodel(tmp_path / "m", 3.0), "m")
    assert sig._direct is not None and len(sig._direct.captured) == 1
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(run_signature(sig, {"x": x})["y"], x * 3)


@pytest.mark.parametrize("direct", [True, False])
def test_inputs_are_the_signature_def_keys(tmp_path: Path, direct: bool) -> None:
    """Inputs are named as the SignatureDef names them (as Triton), also where they are
    not Python names and TensorFlow's function arguments are named otherwise; both the
    direct call and the flat call find them."""
    keyed = load_signature(_cfg(), write_keyed_savedmodel(tmp_path / "k"), "m")
    dashed = load_signature(_cfg(), write_dashed_savedmodel(tmp_path / "d"), "m")
    assert sorted(n for n, _, _ in keyed.inputs) == ["2d", "a/b", "x:0"]
    assert sorted(n for n, _, _ in dashed.inputs) == ["alpha", "z.in", "zeta-in"]
    for sig in (keyed, dashed):
        assert sig._direct is not None
        if not direct:
            sig._direct = None
    x = np.array([[5, 7]], np.float32)
    a = np.array([[1, 2]], np.float32)
    c = np.array([[2, 3]], np.int32)
    out = run_signature(keyed, {"x:0": x, "a/b": a, "2d": c})
    np.testing.assert_array_equal(out["o:0"], x - a)
    np.testing.assert_array_equal(out["o/1"], c * 3)
    out = run_signature(dashed, {"zeta-in": x, "alpha": a, "z.in": a * 3})
    np.testing.assert_array_equal(out["out/a"], x - a)
    np.testing.assert_array_equal(out["out-b"], a * 2 - a * 3)


def test_a_string_signature_takes_its_own_flat_call(tmp_path: Path) -> None:
    sig = load_signature(_cfg(), write_string_savedmodel(tmp_path / "m"), "m")
    assert sig._direct is None
    text = np.array([b"ab", b"Cd"], dtype=object)
    for single_threaded in (False, True):
        out = sig.run({"text": text}, single_threaded)["upper"].numpy()
        assert out.tolist() == [b"AB", b"CD"]


def test_tf_signature_def_picks_another(saved: Path) -> None:
    sig = load_signature(_cfg(TF_SIGNATURE_DEF="plus_one"), saved, "m")
    assert sig.key == "plus_one" and sig.outputs[0][0] == "z"


def test_a_missing_named_signature_fails_naming_the_ones_there(saved: Path) -> None:
    with pytest.raises(RuntimeError) as e:
        load_signature(_cfg(TF_SIGNATURE_DEF="nope"), saved, "m")
    assert "expected 'nope' signature" in str(e.value)
    assert "'plus_one'" in str(e.value) and "TF_SIGNATURE_DEF" in str(e.value)


def test_without_serving_default_the_first_other_signature_serves(tmp_path: Path) -> None:
    folder = write_savedmodel(tmp_path / "model.savedmodel", default=False)
    assert load_signature(_cfg(), folder, "m").key in ("double", "plus_one")


def test_a_wrong_tag_or_a_corrupt_folder_names_the_folder(saved: Path, tmp_path: Path) -> None:
    with pytest.raises(RuntimeError) as e:
        load_signature(_cfg(TF_GRAPH_TAG="train"), saved, "m")
    assert f"model 'm': TensorFlow cannot load the SavedModel {saved} (tag 'train')" in str(e.value)
    broken = tmp_path / "broken.savedmodel"
    broken.mkdir()
    (broken / "saved_model.pb").write_bytes(b"not a protobuf")
    with pytest.raises(RuntimeError, match="TensorFlow cannot load the SavedModel .*broken"):
        load_signature(_cfg(), broken, "m")
