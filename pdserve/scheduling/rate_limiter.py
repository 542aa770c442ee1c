"""Triton's rate limiter (``--rate-limit=execution_count``): a model instance runs a batch
only when the resources its instance group names are free.

``instance_group { rate_limiter { resources [ { name count global } ] priority } }`` says
what one execution of an instance of the group holds: ``count`` copies of each resource,
on the instance's device (CPU instances: device 0) or, with ``global``, of the one copy
the whole server shares. They are taken before the batch runs and given back after it.
Instances waiting for resources are served lowest ``executions x priority`` first (a
priority-2 instance gets half the chances of a priority-1 one), and only the first in
that order may take resources, as Triton's ``RateLimiter::AttemptAllocation`` does.
A resource has as many copies as ``--rate-limit-resource NAME:COUNT[:DEVICE]`` grants
or, with none given, as the most any one loaded instance needs. Off (the default), no
batch meets this module: :func:`pdserve.scheduling.base.run_batch` reads
:data:`active`, which is None.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tritonclient.grpc import model_config_pb2

from pdserve.config import ConfigError, ModelConfig

if TYPE_CHECKING:
    from pdserve.backends.base import ExecRequest, ModelInstance

log = logging.getLogger("pdserve.rate_limiter")

#: ``--rate-limit`` values (tritonserver's; case-insensitive on the command line).
MODES = ("off", "execution_count")
#: Device key of a global resource (one copy for the whole server).
GLOBAL = -1
#: Device key of a ``--rate-limit-resource`` given without a device: every device has it.
EVERY_DEVICE = -2

_FORMAT = "--rate-limit-resource option format is '<resource_name>:<count>:<device>' or "
_FORMAT += "'<resource_name>:<count>'"

#: (device key, resource name) -> copies
Counts = dict[tuple[int, str], int]


@dataclass(frozen=True)
class ResourceGrant:
    """One ``--rate-limit-resource``: ``count`` copies of ``name`` on ``device`` (None: on
    every device; a global resource takes the largest count given for its name)."""

    name: str
    count: int
    device: int | None = None

    def __str__(self) -> str:
        """As the flag is written: ``NAME:COUNT[:DEVICE]``."""
        tail = "" if self.device is None else f":{self.device}"
        return f"{self.name}:{self.count}{tail}"


def parse_resource(text: str) -> ResourceGrant:
    """Read ``NAME:COUNT`` or ``NAME:COUNT:DEVICE`` (tritonserver's syntax).

    Raises:
        ValueError: another shape, an empty name, or a count / device that is not a
            non-negative integer (the message quotes tritonserver's format).
    """
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[0]:
        raise ValueError(f"{_FORMAT}, got '{text}'")
    try:
        numbers = [int(p) for p in parts[1:]]
    except ValueError:
        raise ValueError(f"{_FORMAT}, got '{text}': count and device are integers") from None
    if any(n < 0 for n in numbers):
        raise ValueError(f"{_FORMAT}, got '{text}': count and device must be >= 0")
    return ResourceGrant(parts[0], numbers[0], numbers[1] if len(numbers) == 2 else None)


def instance_plan(cfg: ModelConfig) -> list[tuple[int, int]]:
    """``(group index, device)`` of each model instance, in the order the backends create
    them: group by group, device by device (a ``KIND_GPU`` group's ``gpus``; any other
    kind: device 0), ``count`` instances each."""
    group_pb = model_config_pb2.ModelInstanceGroup
    plan: list[tuple[int, int]] = []
    for gi, group in enumerate(cfg.instance_group):
        gpu = group.kind == group_pb.KIND_GPU
        devices = [int(g) for g in group.gpus] if gpu and len(group.gpus) else [0]
        for device in devices:
            plan.extend((gi, device) for _ in range(max(int(group.count), 1)))
    return plan


def group_needs(group: Any, device: int) -> Counts:
    """What one execution of an instance of ``group`` on ``device`` holds."""
    needs: Counts = {}
    for res in group.rate_limiter.resources:
        key = (GLOBAL if getattr(res, "global") else device, res.name)
        needs[key] = int(res.count)
    return needs


class Slot:
    """One registered model instance: what it needs, its priority, its executions."""

    __slots__ = ("exec_count", "limiter", "name", "needs", "priority")

    def __init__(self, limiter: RateLimiter, name: str, needs: Counts, priority: int) -> None:
        self.limiter = limiter
        self.name = name
        self.needs = needs
        self.priority = max(priority, 1)  # Triton: 0 counts as 1
        self.exec_count = 0


class RateLimiter:
    """The resources of one server and the model instances that wait for them (one
    event loop; no locking)."""

    def __init__(self, grants: Sequence[ResourceGrant] = ()) -> None:
        #: device key (or EVERY_DEVICE) -> resource -> copies granted on the command line
        self.explicit: dict[int, dict[str, int]] = {}
        for g in grants:
            device = EVERY_DEVICE if g.device is None else g.device
            self.explicit.setdefault(device, {})[g.name] = g.count
        #: id(model instance) -> its slot
        self._slots: dict[int, Slot] = {}
        self.limits: Counts = {}
        self.allocated: Counts = {}
        self._staged: list[list[Any]] = []
        self._seq = itertools.count()

    # -- registration ------------------------------------------------------------------

    def check_config(self, cfg: ModelConfig, where: str) -> None:
        """Refuse a configuration whose instances could never run: a resource the command
        line grants fewer copies of than one instance needs, or a name used both as a
        global and as a per-device resource (Triton's checks at instance registration).

        Raises:
            ConfigError: naming the first ``instance_group[i].rate_limiter.resources[j]``
                at fault, with Triton's message.
        """
        own = [group_needs(cfg.instance_group[gi], d) for gi, d in instance_plan(cfg)]
        problem = self._limits_for([*own, *(s.needs for s in self._slots.values())])[1]
        if problem is None:
            return
        name, message = problem
        for gi, group in enumerate(cfg.instance_group):
            for ri, res in enumerate(group.rate_limiter.resources):
                if res.name == name:
                    field = f"instance_group[{gi}].rate_limiter.resources[{ri}]"
                    raise ConfigError(where, field, message)
        raise ConfigError(where, "instance_group", message)

    def register(self, cfg: ModelConfig, instances: Sequence[ModelInstance]) -> None:
        """Take the model's instances into account; each is forgotten when it is freed.

        Raises:
            ConfigError: the limits no longer hold (a model loaded meanwhile conflicts).
        """
        plan = instance_plan(cfg)
        if len(plan) != len(instances):  # a backend that makes its own count: group 0's rule
            plan = [(0, 0)] * len(instances)
        for instance, (gi, device) in zip(instances, plan, strict=True):
            group = cfg.instance_group[gi] if len(cfg.instance_group) else None
            needs = group_needs(group, device) if group is not None else {}
            priority = int(group.rate_limiter.priority) if group is not None else 1
            key = id(instance)
            self._slots[key] = Slot(self, instance.name, needs, priority)
            weakref.finalize(instance, self._forget, key)
        limits, problem = self._limits_for(s.needs for s in self._slots.values())
        if problem is not None:
            for instance in instances:
                self._slots.pop(id(instance), None)
            raise ConfigError(cfg.name, "instance_group", problem[1])
        self.limits = limits
        log.debug("rate limiter resources: %s", self.limits)

    def _forget(self, key: int) -> None:
        """An instance is gone: stop counting what it needs."""
        if self._slots.pop(key, None) is not None:
            self.limits = self._limits_for(s.needs for s in self._slots.values())[0]

    def _limits_for(self, needs: Iterable[Counts]) -> tuple[Counts, tuple[str, str] | None]:
        """Copies of each resource for instances needing ``needs`` (Triton's
        ``UpdateResourceLimits``): the most any one needs, or what the command line grants
        when it grants anything. Returns the limits and the first problem, if any, as
        ``(resource name, message)``."""
        limits: Counts = {}
        for need in needs:
            for key, count in need.items():
                limits[key] = max(limits.get(key, 0), count)
        global_names = {name for device, name in limits if device == GLOBAL}
        for device, name in limits:
            if device != GLOBAL and name in global_names:
                return limits, (
                    name,
                    f'Resource "{name}" is present as both global and device-specific '
                    "resource in the model configuration.",
                )
        if not self.explicit:
            return limits, None
        for (device, name), required in sorted(limits.items()):
            if device == GLOBAL:
                given = [c.get(name, 0) for c in self.explicit.values()]
            else:
                given = [self.explicit.get(k, {}).get(name, 0) for k in (device, EVERY_DEVICE)]
            count = max(given, default=0)
            if count < required:
                return limits, (
                    name,
                    f'Resource count for "{name}" is limited to {count} which will prevent '
                    "scheduling of one or more model instances, the minimum required count "
                    f"is {required} (--rate-limit-resource)",
                )
            limits[(device, name)] = count
        return limits, None

    # -- execution ---------------------------------------------------------------------

    def slot(self, instance: ModelInstance) -> Slot | None:
        """The registered slot of ``instance`` (None: not rate limited)."""
        return self._slots.get(id(instance))

    async def acquire(self, slot: Slot, batch: list[ExecRequest]) -> None:
        """Wait until ``slot`` holds its resources; the wait counts as each request's queue
        time. Cancelled while waiting: nothing is held."""
        if not self._staged and self._fits(slot):
            self._take(slot)
            return
        start = time.monotonic_ns()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._staged, [slot.exec_count * slot.priority, next(self._seq), slot, fut])
        self._attempt()  # it may be first in line now
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._give_back(slot)  # allocated, then cancelled before it ran
            self._attempt()
            raise
        waited = time.monotonic_ns() - start
        for r in batch:
            r.queue_ns += waited

    def release(self, slot: Slot) -> None:
        """``slot``'s execution ended: give its resources back, count the execution, and
        let the first waiter in priority order take what it needs."""
        slot.exec_count += 1
        self._give_back(slot)

    def _give_back(self, slot: Slot) -> None:
        for key, count in slot.needs.items():
            self.allocated[key] -= count
        self._attempt()

    def _fits(self, slot: Slot) -> bool:
        return all(
            self.allocated.get(key, 0) + count <= self.limits.get(key, count)
            for key, count in slot.needs.items()
        )

    def _take(self, slot: Slot) -> None:
        for key, count in slot.needs.items():
            self.allocated[key] = self.allocated.get(key, 0) + count

    def _attempt(self) -> None:
        """Allocate to staged instances in priority order while the first one fits."""
        staged = self._staged
        while staged:
            slot, fut = staged[0][2], staged[0][3]
            if fut.done():  # its waiter was cancelled
                heapq.heappop(staged)
                continue
            if not self._fits(slot):
                return
            heapq.heappop(staged)
            self._take(slot)
            fut.set_result(None)


#: The server's rate limiter; None while ``--rate-limit=off`` (the default).
active: RateLimiter | None = None

#: models already warned about rate_limiter settings that --rate-limit=off ignores
_warned: set[str] = set()


def configure(mode: str, grants: Sequence[ResourceGrant] = ()) -> None:
    """Set the server's rate limiter (the CLI calls it once, before loading models).

    Raises:
        ValueError: ``mode`` is not one of :data:`MODES`.
    """
    global active
    if mode not in MODES:
        raise ValueError(f"--rate-limit must be one of {', '.join(MODES)}, got '{mode}'")
    active = RateLimiter(grants) if mode == "execution_count" else None


def check_config(cfg: ModelConfig, where: str) -> None:
    """:meth:`RateLimiter.check_config` on the server's limiter (nothing while off)."""
    if active is not None:
        active.check_config(cfg, where)


def register(cfg: ModelConfig, instances: Sequence[ModelInstance]) -> None:
    """Register a loaded model version's instances with the server's limiter; while off,
    warn once per model that its ``rate_limiter`` settings are ignored."""
    if active is not None:
        if instances:
            active.register(cfg, instances)
        return
    if cfg.name not in _warned and any(g.HasField("rate_limiter") for g in cfg.instance_group):
        _warned.add(cfg.name)
        log.warning(
            "model '%s': instance_group rate_limiter is ignored: --rate-limit is off "
            "(use --rate-limit=execution_count)",
            cfg.name,
        )
