"""Which GPUs this process can see, without importing a CUDA library.

Triton refuses a ``KIND_GPU`` instance group whose GPU does not exist (the model
fails to load: "instance group ... specifies invalid or unsupported gpu id").
The ONNX Runtime backend learns it from its execution providers; the python
backend, whose ``model.py`` picks its own device, asks :func:`visible_gpu_count`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

#: One entry per GPU the loaded NVIDIA kernel driver manages (Linux).
NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")


def visible_gpu_count(
    environ: Mapping[str, str] | None = None, gpus_dir: Path = NVIDIA_GPUS_DIR
) -> int:
    """The number of CUDA GPUs a model instance of this process could use.

    The driver's GPUs (``/proc/driver/nvidia/gpus/*``; none without the NVIDIA
    kernel driver), restricted by ``CUDA_VISIBLE_DEVICES`` as CUDA does: unset means
    all of them; empty, or a list whose first entry is invalid (``-1``,
    ``NoDevFiles``), means none; otherwise the valid entries before the first
    invalid one, at most as many as the driver has.

    Args:
        environ: the environment to read (default ``os.environ``).
        gpus_dir: the driver's GPU list (a parameter for tests).

    Returns:
        a count >= 0; GPU ids 0 .. count - 1 are usable.
    """
    env = os.environ if environ is None else environ
    try:
        physical = sum(1 for _ in gpus_dir.iterdir())
    except OSError:
        physical = 0
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return physical
    count = 0
    for entry in visible.split(","):
        entry = entry.strip()
        if entry.isdigit() and int(entry) >= 0 or entry.startswith(("GPU-", "MIG-")):
            count += 1
        else:
            break  # CUDA ignores the list from the first invalid entry on
    return min(count, physical)
