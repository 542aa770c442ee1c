"""The ``parameters`` of an OpenVINO model, read as Triton's openvino backend reads them.

Device properties (handed to ``Core.compile_model``): ``PERFORMANCE_HINT``
(``LATENCY`` / ``THROUGHPUT`` / ``CUMULATIVE_THROUGHPUT``), ``NUM_STREAMS`` (``AUTO``,
``NUMA`` or a number), ``INFERENCE_NUM_THREADS`` and ``COMPILATION_NUM_THREADS``
(non-negative numbers), ``HINT_BF16`` (``YES``: bf16 inference precision). Switches
(``YES`` in any case turns them on, anything else leaves them off, as in Triton):
``SKIP_OV_DYNAMIC_BATCHSIZE``, ``ENABLE_BATCH_PADDING``, ``RESHAPE_IO_LAYERS``. Also
``TARGET_DEVICE`` (the OpenVINO device, default ``CPU``) and ``CPU_EXTENSION_PATH`` (a
custom-layer library ``Core.add_extension`` loads). Values are case-insensitive. On the CPU
inference runs in f32 unless ``HINT_BF16`` asks for bf16 (:data:`CPU_PRECISION`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve import config as cfgmod
from pdserve.config import ModelConfig

#: The device properties Triton's backend passes on, in its order.
DEVICE_PARAMETERS = (
    "INFERENCE_NUM_THREADS",
    "COMPILATION_NUM_THREADS",
    "HINT_BF16",
    "NUM_STREAMS",
    "PERFORMANCE_HINT",
)
#: The switches (``YES`` turns them on).
SWITCHES = ("SKIP_OV_DYNAMIC_BATCHSIZE", "ENABLE_BATCH_PADDING", "RESHAPE_IO_LAYERS")
_HINTS = ("latency", "throughput", "cumulative_throughput")
#: The CPU plugin's precision unless ``HINT_BF16`` says otherwise. OpenVINO itself picks
#: bf16 on CPUs with AVX512_BF16 or AMX, which moves a model's outputs by far more than
#: float32 rounding; pdserve keeps a model's outputs the same on every CPU.
CPU_PRECISION = {"INFERENCE_PRECISION_HINT": "f32"}


def device_property(key: str, value: str) -> tuple[str, Any]:
    """One Triton parameter as an OpenVINO property ``(name, value)``.

    Raises:
        ValueError: a value Triton's backend refuses (its message).
    """
    v = value.strip().lower()
    if key in ("INFERENCE_NUM_THREADS", "COMPILATION_NUM_THREADS"):
        if not v.isdigit():
            raise ValueError(f"expected the parameter '{key}' to be a non-negative number, got {v}")
        return key, int(v)
    if key == "HINT_BF16":
        if v != "yes":
            raise ValueError(f"expected the parameter '{key}' to be YES, got {v}")
        return "INFERENCE_PRECISION_HINT", "bf16"
    if key == "NUM_STREAMS":
        if v in ("auto", "numa"):
            return key, v.upper()
        if not v.isdigit():
            raise ValueError(
                f"expected the parameter '{key}' to be either AUTO/NUMA/<int_value>, got {v}"
            )
        return key, int(v)
    if key == "PERFORMANCE_HINT":
        if v not in _HINTS:
            raise ValueError(
                f"expected the parameter '{key}' to be LATENCY/THROUGHPUT/"
                f"CUMULATIVE_THROUGHPUT, got {v}"
            )
        return key, v.upper()
    raise ValueError(f"the parameter '{key}' is not yet supported by openvino backend")


@dataclass
class Options:
    """A model's OpenVINO settings (:func:`Options.from_config`)."""

    properties: dict[str, Any] = field(default_factory=dict)
    skip_dynamic_batchsize: bool = False
    enable_batch_padding: bool = False
    reshape_io_layers: bool = False
    target_device: str = "CPU"
    cpu_extension_path: str = ""

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> Options:
        """Read the parameters of ``cfg``.

        Raises:
            ValueError: a malformed device property (Triton's message).
        """
        opts = cls()
        for key in DEVICE_PARAMETERS:
            value = cfgmod.get_parameter(cfg, key)
            if value:
                name, prop = device_property(key, value)
                opts.properties[name] = prop
        opts.skip_dynamic_batchsize = _switch(cfg, "SKIP_OV_DYNAMIC_BATCHSIZE")
        opts.enable_batch_padding = _switch(cfg, "ENABLE_BATCH_PADDING")
        opts.reshape_io_layers = _switch(cfg, "RESHAPE_IO_LAYERS")
        device = (cfgmod.get_parameter(cfg, "TARGET_DEVICE") or "").strip().upper()
        opts.target_device = device or "CPU"
        opts.cpu_extension_path = (cfgmod.get_parameter(cfg, "CPU_EXTENSION_PATH") or "").strip()
        return opts


def _switch(cfg: ModelConfig, key: str) -> bool:
    return (cfgmod.get_parameter(cfg, key) or "").strip().lower() == "yes"
