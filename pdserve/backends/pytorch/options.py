"""The PyTorch backend's configuration ``parameters`` (Triton's PyTorch-backend keys)
and the process-wide torch settings they make.

Per model (:class:`Options`): ``INFERENCE_MODE`` (default true; false: ``no_grad``),
``DISABLE_OPTIMIZED_EXECUTION``, ``ENABLE_CACHE_CLEANING`` (``empty_cache`` after each
GPU batch), ``ENABLE_WEIGHT_SHARING`` (instances on one device share one module), and
the configuration's pinned-memory switches. Process-wide, the first model that sets one
wins (:data:`SETTINGS`): ``INTRA_OP_THREAD_COUNT`` / ``INTER_OP_THREAD_COUNT``, the JIT
switches ``ENABLE_JIT_EXECUTOR`` / ``ENABLE_JIT_PROFILING`` / ``ENABLE_TENSOR_FUSER``,
and pdserve's ``ENABLE_TF32`` (default false, so GPU and CPU results agree).
``ENABLE_NVFUSER`` is ignored with a warning (torch 2.x has no NVFuser).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from types import ModuleType

from pdserve import config as cfgmod
from pdserve.config import ModelConfig

log = logging.getLogger("pdserve.pytorch")

#: Process-wide JIT switches: parameter -> ``torch._C`` setter.
JIT_SWITCHES: dict[str, str] = {
    "ENABLE_JIT_EXECUTOR": "_jit_set_profiling_executor",
    "ENABLE_JIT_PROFILING": "_jit_set_profiling_mode",
    "ENABLE_TENSOR_FUSER": "_jit_set_texpr_fuser_enabled",
}


def import_torch() -> ModuleType:
    """``torch``, imported with ``OMP_WAIT_POLICY=PASSIVE`` by default and its
    TorchScript deprecation warnings filtered."""
    if "torch" not in sys.modules:
        # torch's CPU kernels run on OpenMP (libgomp), whose threads spin at every
        # barrier by default; on cores shared with other instances a descheduled
        # spinner stalls every op. libgomp reads this once, when torch loads it; an
        # operator's own value wins.
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    global _WARNINGS_FILTERED
    if not _WARNINGS_FILTERED:
        # torch marks every torch.jit entry point deprecated; TorchScript is what
        # Triton's PyTorch backend serves, so the warning says nothing to an operator.
        warnings.filterwarnings(
            "ignore", message=r"`torch\.jit\.[\w.]+` is deprecated", category=DeprecationWarning
        )
        _WARNINGS_FILTERED = True
    return torch


_WARNINGS_FILTERED = False


def parse_flag(cfg: ModelConfig, key: str, default: bool) -> bool:
    """A boolean model parameter (``true``/``false``, also ``1``/``0``, ``yes``/``no``).

    Raises:
        ValueError: any other value; the message names the parameter.
    """
    raw = cfgmod.get_parameter(cfg, key)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise ValueError(f"parameter {key} must be 'true' or 'false', got '{raw}'")


def parse_count(cfg: ModelConfig, key: str) -> int | None:
    """A positive integer model parameter, or None when absent.

    Raises:
        ValueError: not a positive integer.
    """
    raw = cfgmod.get_parameter(cfg, key)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"parameter {key} must be a positive integer, got '{raw}'")
    return value


@dataclass(frozen=True)
class Options:
    """The per-model switches read from ``parameters``."""

    inference_mode: bool = True
    optimized_execution: bool = True
    cache_cleaning: bool = False
    weight_sharing: bool = False
    input_pinned: bool = True
    output_pinned: bool = True

    @classmethod
    def from_config(cls, cfg: ModelConfig) -> Options:
        """Read them; raises ValueError on a malformed parameter."""
        opt = cfg.optimization
        return cls(
            inference_mode=parse_flag(cfg, "INFERENCE_MODE", True),
            optimized_execution=not parse_flag(cfg, "DISABLE_OPTIMIZED_EXECUTION", False),
            cache_cleaning=parse_flag(cfg, "ENABLE_CACHE_CLEANING", False),
            weight_sharing=parse_flag(cfg, "ENABLE_WEIGHT_SHARING", False),
            input_pinned=not opt.HasField("input_pinned_memory") or opt.input_pinned_memory.enable,
            output_pinned=not opt.HasField("output_pinned_memory")
            or opt.output_pinned_memory.enable,
        )


class _ProcessSettings:
    """torch's process-wide settings: the first model that sets one wins."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        #: parameter -> (value, model that set it)
        self.applied: dict[str, tuple[int | bool, str]] = {}

    def apply(self, model: str, cfg: ModelConfig) -> None:
        """Apply the model's thread counts, JIT switches and TF32 choice.

        Raises:
            ValueError: a malformed value.
        """
        torch = import_torch()
        wanted: dict[str, int | bool] = {}
        for key in ("INTRA_OP_THREAD_COUNT", "INTER_OP_THREAD_COUNT"):
            count = parse_count(cfg, key)
            if count is not None:
                wanted[key] = count
        for key in JIT_SWITCHES:
            if cfgmod.get_parameter(cfg, key) is not None:
                wanted[key] = parse_flag(cfg, key, True)
        # TF32 convolutions (torch's default on Ampere and later GPUs) move a model's
        # outputs away from the CPU's: off unless a model asks (first model decides).
        tf32_given = cfgmod.get_parameter(cfg, "ENABLE_TF32") is not None
        if tf32_given or "ENABLE_TF32" not in self.applied:
            wanted["ENABLE_TF32"] = parse_flag(cfg, "ENABLE_TF32", False)
        if parse_flag(cfg, "ENABLE_NVFUSER", False):
            log.warning("%s: ENABLE_NVFUSER is ignored: torch 2.x has no NVFuser", model)
        with self._lock:
            for key, value in wanted.items():
                earlier = self.applied.get(key)
                if earlier is not None:
                    if earlier[0] != value:
                        log.warning(
                            "%s: %s=%s is ignored: it is process-wide and model '%s' set %s",
                            model,
                            key,
                            value,
                            earlier[1],
                            earlier[0],
                        )
                    continue
                try:
                    if key == "INTRA_OP_THREAD_COUNT":
                        torch.set_num_threads(value)
                    elif key == "INTER_OP_THREAD_COUNT":
                        torch.set_num_interop_threads(value)
                    elif key == "ENABLE_TF32":
                        torch.backends.cudnn.allow_tf32 = value
                        torch.backends.cuda.matmul.allow_tf32 = value
                    else:
                        setter = getattr(torch._C, JIT_SWITCHES[key], None)
                        if setter is None:
                            log.warning(
                                "%s: %s is ignored: this torch has no such switch", model, key
                            )
                            continue
                        setter(value)
                except RuntimeError as e:  # inter-op count after parallel work started
                    log.warning("%s: %s=%s could not be applied: %s", model, key, value, e)
                    continue
                self.applied[key] = (value, model)


SETTINGS = _ProcessSettings()
