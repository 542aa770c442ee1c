"""Opening a TensorFlow SavedModel and choosing its signature, as Triton's tensorflow
backend does.

``TF_GRAPH_TAG`` names the MetaGraph tag (default ``serve``); ``TF_SIGNATURE_DEF`` the
signature (default ``serving_default``; when that default is absent and none was
named, the first signature that is not ``__saved_model_init_op`` /
``__saved_model_train_op``, with a warning). The signature's input and output keys
are the tensor names the configuration uses. TensorFlow is imported here, on first
use (seconds), never at server start.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve import config as cfgmod
from pdserve.backends.onnxruntime.autocomplete import TensorInfo
from pdserve.backends.tensorflow.direct import SINGLE_THREADED, DirectCall
from pdserve.config import ModelConfig
from pdserve.core import datatypes

log = logging.getLogger("pdserve.tensorflow")

DEFAULT_TAG = "serve"
DEFAULT_SIGNATURE = "serving_default"
_NOT_SERVING = ("__saved_model_init_op", "__saved_model_train_op")


def import_tf() -> Any:
    """``import tensorflow`` (its C++ start-up logging kept to errors, unless the
    environment sets ``TF_CPP_MIN_LOG_LEVEL``)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow

    return tensorflow


@dataclass
class Signature:
    """A loaded SavedModel's chosen signature: the callable and its tensors."""

    key: str
    function: Any
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    #: keeps the loaded object (and its variables) alive as long as the function
    loaded: Any

    def __post_init__(self) -> None:
        fn = self.function
        flat = flat_inputs(fn) if hasattr(fn, "_call_flat") else None
        #: the signature's input keys in the order of its flat arguments (None: call it
        #: by keywords)
        self._flat = [key for key, _ in flat] if flat is not None else None
        self._captured = fn.captured_inputs if flat is not None else []
        #: the graph function in one execute (None: the flat or keyword call)
        self._direct = DirectCall.of(fn, flat) if flat is not None else None

    def run(self, arrays: dict[str, Any], single_threaded: bool = False) -> dict[str, Any]:
        """Run the signature on ``arrays`` (numpy, every input by name, checked against
        the configuration) on the current device: its output tensors by name. With
        ``single_threaded``, on TensorFlow's single-threaded function executor.

        Raises:
            KeyError: an input missing from ``arrays``.
            tensorflow.errors.OpError: TensorFlow's error running the graph (a graph
                the single-threaded executor cannot run raises one naming it).
        """
        if self._direct is not None:
            return self._direct(arrays, single_threaded)
        tf = import_tf()
        tensors = {n: tf.constant(a) for n, a in arrays.items()}
        if not single_threaded:
            return self(tensors)
        with tf.experimental.function_executor_type(SINGLE_THREADED):
            return self(tensors)

    def __call__(self, tensors: dict[str, Any]) -> dict[str, Any]:
        """Run the signature on ``tensors`` (every input, by name): its outputs by name.

        The flat call skips matching the keywords against the structured signature on
        every call, which costs a small model as much as its kernels; the inputs were
        checked against the configuration (and it against the signature) before.

        Raises:
            KeyError: an input missing from ``tensors``.
            tensorflow.errors.OpError: TensorFlow's error running the graph.
        """
        if self._flat is None:
            return dict(self.function(**tensors))
        return dict(self.function._call_flat([tensors[n] for n in self._flat], self._captured))


def flat_inputs(function: Any) -> list[tuple[str, Any]] | None:
    """A loaded signature's inputs in the order of its flat arguments: ``(key,
    TensorSpec)``, the key as the SignatureDef names it (``x:0``, ``2d``, ``zeta-in``:
    the function's own argument names are those made into Python names); None when the
    function does not say (then it is called by keywords)."""
    params = getattr(getattr(function, "function_type", None), "parameters", None)
    keywords = getattr(function, "_arg_keywords", None)
    if not params or not keywords or len(keywords) != len(params):
        return None
    return [(k, p.type_constraint) for k, p in zip(keywords, params.values(), strict=True)]


def _first_line(error: BaseException) -> str:
    lines = [ln.strip() for ln in str(error).strip().splitlines() if ln.strip()]
    return lines[0] if lines else type(error).__name__


def _tensors(specs: dict[str, Any], where: str) -> list[TensorInfo]:
    out: list[TensorInfo] = []
    for name, spec in specs.items():
        dtype = spec.dtype
        if dtype.name == "string":
            v2 = "BYTES"
        else:
            try:
                v2 = datatypes.numpy_to_v2(dtype.as_numpy_dtype)
            except Exception:
                raise RuntimeError(
                    f"{where}: signature tensor '{name}' has type {dtype.name}, which has no "
                    "V2 datatype"
                ) from None
        shape = None if spec.shape.rank is None else list(spec.shape.as_list())
        out.append((name, v2, shape))
    return out


def load_signature(
    cfg: ModelConfig, path: Path, model: str, device: str | None = None
) -> Signature:
    """Load the SavedModel folder ``path`` and pick its signature.

    Args:
        cfg: the configuration (``TF_GRAPH_TAG``, ``TF_SIGNATURE_DEF``).
        path: ``<version>/model.savedmodel``.
        model: the model name, for messages.
        device: a TensorFlow device (``/GPU:0``) to load onto, or None.

    Raises:
        RuntimeError: TensorFlow cannot load the folder, or the signature does not
            exist; the message names the model, the folder and TensorFlow's error.
    """
    tf = import_tf()
    tag = cfgmod.get_parameter(cfg, "TF_GRAPH_TAG") or DEFAULT_TAG
    named = cfgmod.get_parameter(cfg, "TF_SIGNATURE_DEF") or ""
    try:
        if device:
            with tf.device(device):
                loaded = tf.saved_model.load(str(path), tags=[tag])
        else:
            loaded = tf.saved_model.load(str(path), tags=[tag])
    except Exception as e:
        raise RuntimeError(
            f"model '{model}': TensorFlow cannot load the SavedModel {path} (tag '{tag}'): "
            f"{type(e).__name__}: {_first_line(e)}"
        ) from e
    signatures = dict(getattr(loaded, "signatures", {}) or {})
    key = named or DEFAULT_SIGNATURE
    if key not in signatures and not named:
        others = [k for k in signatures if k not in _NOT_SERVING]
        if others:
            log.warning(
                "%s: unable to find serving signature '%s'; using signature '%s'",
                model,
                DEFAULT_SIGNATURE,
                others[0],
            )
            key = others[0]
    if key not in signatures:
        raise RuntimeError(
            f"model '{model}': unable to load model '{model}', expected '{key}' signature in "
            f"{path} (it has {', '.join(repr(k) for k in signatures) or 'none'}; choose one "
            "with the TF_SIGNATURE_DEF parameter)"
        )
    fn = signatures[key]
    where = f"model '{model}' ({path}, signature '{key}')"
    flat = flat_inputs(fn)
    kwargs = dict(flat) if flat is not None else fn.structured_input_signature[1]
    outputs = fn.structured_outputs
    if not isinstance(outputs, dict):
        raise RuntimeError(f"{where}: the signature's outputs are not named (a dict)")
    return Signature(key, fn, _tensors(kwargs, where), _tensors(outputs, where), loaded)
