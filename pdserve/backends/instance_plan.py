"""Where each model instance of ``instance_group`` runs, for the in-process framework
backends (OpenVINO, TensorFlow): one :class:`InstancePlan` per instance, in order.

As Triton does: ``count`` instances per group (per listed GPU for ``KIND_GPU``, GPU 0
when none is listed), ``KIND_AUTO`` is ``KIND_GPU`` where the backend can use a GPU
and ``KIND_CPU`` otherwise, and each instance is pinned to its host policy's cores.
A ``KIND_GPU`` group the backend cannot serve here fails the load with the backend's
reason (which names the group and what to do).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pdserve.backends.base import ModelSpec
from pdserve.backends.host_policy import instance_cores


@dataclass(frozen=True)
class InstancePlan:
    """One instance: its kind (``KIND_CPU`` / ``KIND_GPU``), GPU id (None on the CPU)
    and host policy cores (None: not pinned)."""

    kind: str
    gpu: int | None
    cores: frozenset[int] | None


def instance_plans(
    spec: ModelSpec,
    backend: str,
    usable_gpus: list[int],
    gpu_problem: Callable[[str, list[int]], str | None],
) -> list[InstancePlan]:
    """The instances of ``spec.config.instance_group`` (one CPU instance without one).

    Args:
        spec: the model version.
        backend: the backend's name, for messages.
        usable_gpus: the GPU ids the backend can use here (``KIND_AUTO`` -> GPU when
            not empty).
        gpu_problem: ``(group name, gpu ids)`` -> why those GPUs cannot be used, or None.

    Raises:
        RuntimeError: ``gpu_problem``'s reason for a ``KIND_GPU`` group, or a kind the
            backend does not run (``KIND_MODEL``).
    """
    from tritonclient.grpc import model_config_pb2 as mc

    plans: list[InstancePlan] = []
    for group in list(spec.config.instance_group) or [None]:
        count = group.count if group is not None and group.count > 0 else 1
        kind = mc.ModelInstanceGroup.Kind.Name(group.kind) if group is not None else "KIND_CPU"
        gname = group.name if group is not None and group.name else spec.name
        if kind == "KIND_AUTO":
            kind = "KIND_GPU" if usable_gpus else "KIND_CPU"
        if kind == "KIND_GPU":
            gpus = (list(group.gpus) if group is not None else []) or [0]
            problem = gpu_problem(gname, gpus)
            if problem:
                raise RuntimeError(f"model '{spec.name}': {problem}")
            for gpu in gpus:
                cores = instance_cores(spec.host_policies, group, gpu)
                plans.extend(InstancePlan("KIND_GPU", gpu, cores) for _ in range(count))
        elif kind == "KIND_CPU":
            cores = instance_cores(spec.host_policies, group, 0)
            plans.extend(InstancePlan("KIND_CPU", None, cores) for _ in range(count))
        else:
            raise RuntimeError(
                f"model '{spec.name}': instance_group '{gname}' kind {kind} is not supported "
                f"by the {backend} backend (use KIND_CPU or KIND_GPU)"
            )
    return plans
