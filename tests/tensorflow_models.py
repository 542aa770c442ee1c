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


def write_keyed_savedmodel(folder: Path) -> Path:
    """A TF1 SavedModel at ``folder`` whose ``serving_default`` SignatureDef keys are not
    Python names: ``x:0`` and ``a/b`` (FP32 ``[-1, 2]``) and ``2d`` (INT32 ``[-1, 2]``)
    give ``o:0 = x:0 - a/b`` and ``o/1 = 3 * 2d``."""
    from pdserve.backends.tensorflow.savedmodel import import_tf

    tf = import_tf()
    v1 = tf.compat.v1
    graph = tf.Graph()
    with graph.as_default(), v1.Session(graph=graph) as session:
        pa = v1.placeholder(tf.float32, [None, 2], name="pa")
        pb = v1.placeholder(tf.float32, [None, 2], name="pb")
        pc = v1.placeholder(tf.int32, [None, 2], name="pc")
        signature = v1.saved_model.signature_def_utils.predict_signature_def(
            inputs={"x:0": pa, "a/b": pb, "2d": pc}, outputs={"o:0": pa - pb, "o/1": pc * 3}
        )
        builder = v1.saved_model.Builder(str(folder))
        builder.add_meta_graph_and_variables(
            session, ["serve"], signature_def_map={"serving_default": signature}
        )
        builder.save()
    return folder


def write_dashed_savedmodel(folder: Path) -> Path:
    """A SavedModel at ``folder`` whose ``serving_default`` inputs are named ``zeta-in``,
    ``alpha`` and ``z.in`` (FP32 ``[-1, 2]``; TensorFlow makes its arguments' names
    ``zeta_in`` and ``z_in``): ``out/a = zeta-in - alpha``, ``out-b = 2 alpha - z.in``."""
    from pdserve.backends.tensorflow.savedmodel import import_tf

    tf = import_tf()
    spec = [
        tf.TensorSpec([None, 2], tf.float32, name="zeta-in"),
        tf.TensorSpec([None, 2], tf.float32, name="alpha"),
        tf.TensorSpec([None, 2], tf.float32, name="z.in"),
    ]

    @tf.function(input_signature=spec)
    def f(x: object, y: object, z: object) -> dict[str, object]:
        return {"out/a": x - y, "out-b": y * 2.0 - z}

    module = tf.Module()
    module.f = f
    tf.saved_model.save(module, str(folder), signatures={"serving_default": f})
    return folder
