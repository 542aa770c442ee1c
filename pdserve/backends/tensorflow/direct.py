"""A SavedModel signature run in one eager execute of its graph function.

A loaded signature's own call (even its flat call) goes through several layers of
TensorFlow's Python before the one C++ execute that runs the graph: binding,
control-dependency and tape scopes, call options, output packing. For a small model
those layers cost as much as its kernels. :class:`DirectCall` does what they do for
an eager call outside any tape or distribution strategy, the execute itself, with the
call options (the function executor included) computed once. It uses TensorFlow's
private entry points (``_inference_function``, ``execute.quick_execute``,
``EagerTensor``) of the pinned ``tensorflow-cpu`` release: :meth:`DirectCall.of` gives
None where any is missing or the signature is not one it can run (string or resource
tensors), and the signature then takes its own flat call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger("pdserve.tensorflow")

#: TensorFlow's function executor that runs every kernel on the calling thread.
SINGLE_THREADED = "SINGLE_THREADED_EXECUTOR"


@dataclass
class DirectCall:
    """One signature's graph function, called in one eager execute.

    Attributes:
        name: the graph function's name.
        inputs: ``(input name, TensorFlow DataType enum)`` in the function's argument order.
        outputs: the output names in the order the function returns them.
        captured: the function's captured tensors (variables), passed after the inputs.
        attrs: the call's attributes for the default executor and the single-threaded one.
    """

    name: str
    inputs: list[tuple[str, int]]
    outputs: list[str]
    captured: list[Any]
    attrs: dict[bool, tuple[Any, ...]]

    @classmethod
    def of(cls, function: Any, inputs: list[tuple[str, Any]]) -> DirectCall | None:
        """The direct call of a loaded signature ``function`` whose flat arguments are
        ``inputs`` (``(key, TensorSpec)`` in order); None where it cannot be made (the
        reason is logged at debug level)."""
        try:
            return cls._make(function, inputs)
        except Exception as e:  # a TensorFlow without these internals: the flat call
            log.debug("no direct call for the signature: %s: %s", type(e).__name__, e)
            return None

    @classmethod
    def _make(cls, function: Any, inputs: list[tuple[str, Any]]) -> DirectCall | None:
        import tensorflow as tf
        from tensorflow.python.eager import context

        atomic = function._inference_function
        types = atomic.function_type
        specs = [spec for _, spec in inputs]
        arguments = len(atomic.cached_definition.signature.input_arg)
        if arguments != len(specs) + len(function.captured_inputs):  # as call_flat checks
            return None
        flat_out = list(types.flat_outputs)
        structured = function.structured_outputs  # a signature's: name -> TensorSpec
        names = sorted(structured)  # the order tf.nest flattens a dict in
        named = [(n, structured[n]) for n in names]
        dtypes = [s.dtype for s in specs] + [o.dtype for o in flat_out]
        if (
            len(named) != len(flat_out)
            or tf.nest.flatten(structured) != [s for _, s in named]
            or any(d in (tf.string, tf.resource, tf.variant) for d in dtypes)
            or any(o.dtype._handle_data for o in flat_out)
            or [s.dtype for _, s in named] != [o.dtype for o in flat_out]
        ):
            return None
        ctx = context.context()
        attrs = {}
        for single in (False, True):
            with tf.experimental.function_executor_type(SINGLE_THREADED if single else None):
                options = ctx.function_call_options.as_attrs()
            attrs[single] = tuple(a for kv in options.items() for a in kv)
        name = atomic.name.decode() if isinstance(atomic.name, bytes) else str(atomic.name)
        keys = [(key, spec.dtype.as_datatype_enum) for key, spec in inputs]
        return cls(name, keys, [p for p, _ in named], list(function.captured_inputs), attrs)

    def __call__(self, arrays: dict[str, np.ndarray], single_threaded: bool) -> dict[str, Any]:
        """Run the function on ``arrays`` (every input, by name, of the signature's
        dtypes) on the current device: its output tensors by name.

        Raises:
            KeyError: an input missing from ``arrays``.
            tensorflow.errors.OpError: TensorFlow's error running the graph.
        """
        from tensorflow.python.eager import context, execute
        from tensorflow.python.framework.ops import EagerTensor

        ctx = context.context()
        device = ctx.device_name
        flat = [EagerTensor(arrays[n], device, dtype) for n, dtype in self.inputs]
        out = execute.quick_execute(
            self.name, len(self.outputs), flat + self.captured, self.attrs[single_threaded], ctx
        )
        return dict(zip(self.outputs, out, strict=True))
