"""Which GPUs this process can see, without importing a CUDA library.

Triton refuses a ``KIND_GPU`` instance group whose GPU does not exist (the model
fails to load: "instance group ... specifies invalid or unsupported gpu id").
This module is the one place that answers "which GPUs are there": the model
manager resolves ``KIND_AUTO`` with :func:`visible_gpus`, and every backend checks
a ``KIND_GPU`` group with :func:`check_gpu_ids`. Nothing here imports a CUDA
library, so asking costs a directory listing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

#: One entry per GPU the loaded NVIDIA kernel driver manages (Linux).
NVIDIA_GPUS_DIR = Path("/proc/driver/nvidia/gpus")


def visible_gpu_count(
    environ: Mapping[str, str] | None = None, gpus_dir: Path | None = None
) -> int:
    """The number of CUDA GPUs a model instance of this process could use.

    The driver's GPUs (``/proc/driver/nvidia/gpus/*``; none without the NVIDIA
    kernel driver), restricted by ``CUDA_VISIBLE_DEVICES`` as CUDA does: unset means
    all of them; empty, or a list whose first entry is invalid (``-1``,
    ``NoDevFiles``), means none; otherwise the valid entries before the first
    invalid one, at most as many as the driver has.

    Args:
        environ: the environment to read (default ``os.environ``).
        gpus_dir: the driver's GPU list (default :data:`NVIDIA_GPUS_DIR`; a
            parameter for tests).

    Returns:
        a count >= 0; GPU ids 0 .. count - 1 are usable.
    """
    env = os.environ if environ is None else environ
    if gpus_dir is None:
        gpus_dir = NVIDIA_GPUS_DIR
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


def visible_gpus(
    environ: Mapping[str, str] | None = None, gpus_dir: Path | None = None
) -> list[int]:
    """The CUDA device ids a model instance of this process could use.

    ``[0, 1, ..., visible_gpu_count() - 1]``: CUDA numbers the visible GPUs from 0
    whatever ``CUDA_VISIBLE_DEVICES`` lists. ``KIND_AUTO`` instance groups become
    ``KIND_GPU`` on these (Triton's ``NormalizeInstanceGroup``) for a backend that
    can use them (:meth:`pdserve.backends.base.Backend.usable_gpus`).

    Args:
        environ / gpus_dir: as for :func:`visible_gpu_count`.

    Returns:
        the ids, ascending; empty on a machine (or process) without a visible GPU.
    """
    return list(range(visible_gpu_count(environ, gpus_dir)))


def check_gpu_ids(group: str, gpus: Sequence[int], visible: int | None = None) -> None:
    """Refuse a ``KIND_GPU`` instance group that names a GPU this process cannot see.

    Triton fails such a model's load too ("instance group ... specifies invalid or
    unsupported gpu id").

    Args:
        group: the instance group's name, for the message.
        gpus: the CUDA device ids the group asks for.
        visible: the number of visible GPUs (default :func:`visible_gpu_count`).

    Raises:
        RuntimeError: an id is not in ``0 .. visible - 1``; the message names the
            group, the missing ids and how many GPUs the process sees.
    """
    count = visible_gpu_count() if visible is None else visible
    missing = [d for d in gpus if not 0 <= d < count]
    if missing:
        raise RuntimeError(
            f"instance group '{group}' asks for KIND_GPU on GPU "
            f"{', '.join(map(str, missing))}, but this process sees "
            f"{count} GPU(s) (NVIDIA driver and CUDA_VISIBLE_DEVICES); "
            "use KIND_CPU"
        )


def cuda_visible_devices_for(device_id: int, environ: Mapping[str, str] | None = None) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` value under which a child process sees only GPU
    ``device_id`` (an id as this process numbers its visible GPUs).

    A python-backend ``KIND_GPU`` instance's worker gets it, so that its model sees
    only its own GPU (as ``cuda:0`` inside the worker).

    Args:
        device_id: ``0 .. visible_gpu_count() - 1``.
        environ: the environment to read (default ``os.environ``).

    Returns:
        ``str(device_id)`` when this process's ``CUDA_VISIBLE_DEVICES`` is unset (all of
        the driver's GPUs, in its order), else the ``device_id``-th entry of that list
        (``"3"``, ``"GPU-<uuid>"``, ``"MIG-<uuid>"``).

    Raises:
        ValueError: ``device_id`` is not one of the listed, valid entries.
    """
    env = os.environ if environ is None else environ
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        if device_id < 0:
            raise ValueError(f"GPU id {device_id} is negative")
        return str(device_id)
    entries: list[str] = []
    for entry in visible.split(","):
        entry = entry.strip()
        if entry.isdigit() or entry.startswith(("GPU-", "MIG-")):
            entries.append(entry)
        else:
            break  # CUDA ignores the list from the first invalid entry on
    if not 0 <= device_id < len(entries):
        raise ValueError(
            f"GPU id {device_id} is not among the {len(entries)} GPU(s) of "
            f"CUDA_VISIBLE_DEVICES={visible!r}"
        )
    return entries[device_id]
