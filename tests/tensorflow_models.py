"""Small TensorFlow SavedModels written at test time, for the backend's tests."""

from __future__ import annotations

from pathlib import Path


def write_savedmodel(folder: Path, default: bool = True) -> Path:
    """A SavedModel at ``folder``: signature ``serving_default`` (or ``double`` only when
    not ``default``) ``x`` FP32 ``[-1, 4]`` -> ``y = 2x``, and ``plus_one`` ``x`` -> ``z``."""
    from pdserve.backends.tensorflow.savedmodel import import_tf

    tf = import_tf()
    spec = [tf.TensorSpec([None, 4], tf.float32, name="x")]

    @tf.function(input_signature=spec)
    def double(x: object) -> dict[str, object]:
        return {"y": x * 2.0}

    @tf.function(input_signature=spec)
    def plus_one(x: object) -> dict[str, object]:
        return {"z": x + 1.0}

    module = tf.Module()
    module.double, module.plus_one = double, plus_one
    first = "serving_default" if default else "double"
    tf.saved_model.save(module, str(folder), signatures={first: double, "plus_one": plus_one})
    return folder


def write_conditional_savedmodel(folder: Path) -> Path:
    """A SavedModel at ``folder`` whose ``serving_default`` branches (``tf.cond``, which
    TensorFlow lowers to Switch/Merge): ``x`` FP32 ``[-1, 4]`` -> ``y = 2x`` where the
    batch sums above 0, else ``3x``."""
    from pdserve.backends.tensorflow.savedmodel import import_tf

    tf = import_tf()

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
    def branch(x: object) -> dict[str, object]:
        return {"y": tf.cond(tf.reduce_sum(x) > 0, lambda: x * 2.0, lambda: x * 3.0)}

    module = tf.Module()
    module.branch = branch
    tf.saved_model.save(module, str(folder), signatures={"serving_default": branch})
    return folder


def write_two_input_savedmodel(folder: Path) -> Path:
    """A SavedModel at ``folder`` whose ``serving_default`` takes ``minuend`` and
    ``subtrahend`` (FP32 ``[-1, 2]``, declared in that order, the reverse of their names'
    order) and gives ``difference`` and ``sum``."""
    from pdserve.backends.tensorflow.savedmodel import import_tf

    tf = import_tf()
    spec = [
        tf.TensorSpec([None, 2], tf.float32, name="minuend"),
        tf.TensorSpec([None, 2], tf.float32, name="subtrahend"),
    ]

    @tf.function(input_signature=spec)
    def f(minuend: object, subtrahend: object) -> dict[str, object]:
        return {"sum": minuend + subtrahend, "difference": minuend - subtrahend}

    module = tf.Module()
    module.f = f
    tf.saved_model.save(module, str(folder), signatures={"serving_default": f})
    return folder


def write_string_savedmodel(folder: Path) -> Path:
    """A SavedModel at ``folder`` whose ``serving_default`` takes ``text`` (BYTES
    ``[-1]``) and gives ``upper``, its upper case."""
    from pdserve.backends.tensorflow.savedmodel import import_tf

    tf = import_tf()

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
    def f(text: object) -> dict[str, object]:
        return {"upper": tf.strings.upper(text)}

    module = tf.Module()
    module.f = f
    tf.saved_model.save(module, str(folder), signatures={"serving_default": f})
    return folder


def write_variable_savedmodel(folder: Path, scale: float) -> Path:
    """A SavedModel at ``folder`` whose ``serving_default`` multiplies ``x`` (FP32
    ``[-1, 4]``) by a variable holding ``scale``: ``y``."""
    from pdserve.backends.tensorflow.savedmodel import import_tf

    tf = import_tf()
    module = tf.Module()
    module.scale = tf.Variable(scale)

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])
    def f(x: object) -> dict[str, object]:
        return {"y": x * module.scale}

    module.f = f
    tf.saved_model.save(module, str(folder), signatures={"serving_default": f})
    return folder
