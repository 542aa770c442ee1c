"""Host policies: pin model instances to CPU cores (Triton's ``--host-policy``).

``--host-policy=<name>,<setting>=<value>`` (repeatable) gives a policy ``cpu-cores``
(``0-3,5``; single ids too, where Triton wants ``5-5``) or ``numa-node`` (that node's
CPUs; both: their intersection); a later value of a setting replaces an earlier one.
An instance group joins a policy through its ``host_policy`` field, or uses its
device's default name as in Triton (``cpu``, ``gpu_<id>``, ``model``), and the threads
that run the instance are pinned to the policy's cores.

Where pdserve differs from Triton: cores are checked when the server starts (a core
the process may not use, a missing NUMA node or an empty intersection is a
command-line error); memory is not bound to a NUMA node (Python has no portable
call); a group that names a policy that was not given fails its model's load, where
Triton would run it unpinned (its own default name is not an error).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2

#: The settings a host policy takes (Triton's).
SETTINGS = ("numa-node", "cpu-cores")

#: Where Linux lists the NUMA nodes and their CPUs.
NUMA_ROOT = Path("/sys/devices/system/node")

#: The highest CPU id :func:`parse_cpu_list` takes (Linux's ``NR_CPUS`` is at most
#: 8192); a larger one is an error rather than a range expanded into a huge set.
MAX_CPU_ID = 65535

#: Triton's wording for a malformed ``--host-policy`` option.
FORMAT = "'<policy name>,<setting>=<value>'"


class HostPolicyError(ValueError):
    """A host policy option is malformed or names cores this process cannot use."""


def parse_option(text: str) -> tuple[str, str, str]:
    """Split one ``--host-policy`` value into ``(policy name, setting, value)``.

    Args:
        text: ``<policy name>,<setting>=<value>``, e.g. ``cpu,cpu-cores=0-3``.

    Raises:
        HostPolicyError: not of that form (an empty part included), or a setting
            other than ``numa-node`` / ``cpu-cores`` (Triton's messages).
    """
    name, comma, rest = text.partition(",")
    setting, eq, value = rest.partition("=")
    name, setting, value = name.strip(), setting.strip(), value.strip()
    if not comma or not eq or not name or not setting or not value:
        raise HostPolicyError(f"--host-policy option format is {FORMAT}. Got {text}")
    if setting not in SETTINGS:
        raise HostPolicyError(
            f"Unsupported host policy setting '{setting}' is specified, supported settings "
            "are 'numa-node', 'cpu-cores'"
        )
    return name, setting, value


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPU ids of a list such as ``0-3,5`` (Linux ``cpulist`` syntax).

    Returns:
        the ids, each ``>= 0`` and ``<= MAX_CPU_ID``.

    Raises:
        HostPolicyError: an empty item, anything but ASCII digits (a negative id
            included), a range whose lower end is above its upper end, or an id
            above :data:`MAX_CPU_ID`.
    """
    cpus: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        lo_text, dash, hi_text = item.partition("-")
        lo_text, hi_text = lo_text.strip(), hi_text.strip()
        # plain ASCII digits only: int() would also take "+1", "1_0" and other scripts' digits
        if not _is_id(lo_text) or (dash and not _is_id(hi_text)):
            raise HostPolicyError(
                f"'cpu-cores' value '{text}': '{item}' is not a core id or a "
                "'<lower>-<upper>' range of core ids"
            )
        lo = int(lo_text)
        hi = int(hi_text) if dash else lo
        if hi < lo:
            raise HostPolicyError(
                f"'cpu-cores' value '{text}': '{item}' is not a valid range "
                "(ids are >= 0 and the lower end comes first)"
            )
        if hi > MAX_CPU_ID:  # checked before the range is expanded into a set
            raise HostPolicyError(
                f"'cpu-cores' value '{text}': '{item}' goes past {MAX_CPU_ID}, the "
                "highest core id accepted"
            )
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def _is_id(text: str) -> bool:
    return text.isascii() and text.isdigit()


def format_cpu_list(cpus: Iterable[int]) -> str:
    """The ``cpulist`` form of ``cpus``: ``{0, 1, 2, 5}`` -> ``"0-2,5"``."""
    ids = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)


def numa_node_cpus(node: str, root: Path = NUMA_ROOT) -> frozenset[int]:
    """The CPUs of NUMA node ``node`` (from ``<root>/node<N>/cpulist``).

    Raises:
        HostPolicyError: ``node`` is not a non-negative integer, or no such node.
    """
    if not (node.isascii() and node.isdigit()):
        raise HostPolicyError(f"'numa-node' value '{node}' is not a NUMA node id (0, 1, ...)")
    path = root / f"node{int(node)}" / "cpulist"
    try:
        text = path.read_text().strip()
    except OSError:
        known = (
            sorted(p.name for p in root.glob("node[0-9]*") if p.name[4:].isdigit())
            if root.is_dir()
            else []
        )
        raise HostPolicyError(
            f"NUMA node {int(node)} does not exist (no {path}; nodes here: "
            f"{', '.join(known) or 'none'})"
        ) from None
    return parse_cpu_list(text) if text else frozenset()


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (its affinity mask)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return frozenset(range(os.cpu_count() or 1))


def resolve_policy(
    name: str,
    settings: Mapping[str, str],
    allowed: Collection[int] | None = None,
    numa_root: Path = NUMA_ROOT,
) -> frozenset[int]:
    """The cores one policy pins to.

    ``cpu-cores`` gives them; ``numa-node`` gives that node's CPUs (those this
    process may use); with both, their intersection.

    Args:
        name: the policy name (for messages).
        settings: setting -> value, as given on the command line.
        allowed: the CPUs this process may use (default: its affinity mask).

    Returns:
        a non-empty set of CPU ids.

    Raises:
        HostPolicyError: a bad value, a core outside ``allowed``, a NUMA node that
            does not exist or has none of ``allowed``, or an empty intersection.
    """
    allowed = frozenset(allowed if allowed is not None else allowed_cpus())
    where = f"host policy '{name}'"
    cores: frozenset[int] | None = None
    if "cpu-cores" in settings:
        try:
            cores = parse_cpu_list(settings["cpu-cores"])
        except HostPolicyError as e:
            raise HostPolicyError(f"{where}: {e}") from None
        outside = cores - allowed
        if outside:
            raise HostPolicyError(
                f"{where}: cpu-cores {format_cpu_list(outside)} not available to this "
                f"process (it may use {format_cpu_list(allowed)})"
            )
    if "numa-node" in settings:
        node = settings["numa-node"]
        try:
            node_cpus = numa_node_cpus(node, numa_root) & allowed
        except HostPolicyError as e:
            raise HostPolicyError(f"{where}: {e}") from None
        if not node_cpus:
            raise HostPolicyError(
                f"{where}: NUMA node {node} has none of the CPUs this process may use "
                f"({format_cpu_list(allowed)})"
            )
        if cores is not None:
            both = cores & node_cpus
            if not both:
                raise HostPolicyError(
                    f"{where}: cpu-cores {format_cpu_list(cores)} are not on NUMA node "
                    f"{node} (its CPUs: {format_cpu_list(node_cpus)})"
                )
            cores = both
        else:
            cores = node_cpus
    if not cores:
        raise HostPolicyError(f"{where} has no setting")
    return cores


def resolve_policies(
    options: Iterable[str],
    allowed: Collection[int] | None = None,
    numa_root: Path = NUMA_ROOT,
) -> dict[str, frozenset[int]]:
    """Resolve every ``--host-policy`` value to ``policy name -> cores``.

    Options with the same policy name merge (a later value of a setting wins),
    as in Triton.

    Raises:
        HostPolicyError: see :func:`parse_option` and :func:`resolve_policy`.
    """
    raw: dict[str, dict[str, str]] = {}
    for text in options:
        name, setting, value = parse_option(text)
        raw.setdefault(name, {})[setting] = value
    return {n: resolve_policy(n, s, allowed, numa_root) for n, s in raw.items()}


# -- instance groups --------------------------------------------------------------


def _kind_name(group: model_config_pb2.ModelInstanceGroup) -> str:
    from tritonclient.grpc import model_config_pb2 as mc

    return mc.ModelInstanceGroup.Kind.Name(group.kind)


def default_policy_name(kind: str, device_id: int = 0) -> str:
    """Triton's default policy name of an instance: ``cpu``, ``gpu_<id>`` or ``model``.

    Args:
        kind: ``KIND_CPU`` / ``KIND_GPU`` / ``KIND_MODEL`` (``KIND_AUTO`` is
            resolved before this; it counts as CPU).
        device_id: the GPU of a ``KIND_GPU`` instance.
    """
    if kind == "KIND_GPU":
        return f"gpu_{device_id}"
    if kind == "KIND_MODEL":
        return "model"
    return "cpu"


def policy_name(group: model_config_pb2.ModelInstanceGroup | None, device_id: int = 0) -> str:
    """The policy name of one instance of ``group`` (a ``ModelInstanceGroup``)."""
    if group is not None and group.host_policy:
        return group.host_policy
    kind = _kind_name(group) if group is not None else "KIND_CPU"
    return default_policy_name(kind, device_id)


def instance_cores(
    policies: Mapping[str, frozenset[int]],
    group: model_config_pb2.ModelInstanceGroup | None,
    device_id: int = 0,
) -> frozenset[int] | None:
    """The cores an instance of ``group`` on ``device_id`` is pinned to.

    Returns:
        the policy's cores, or None when its policy was not given (no pinning).
    """
    if not policies:
        return None
    return policies.get(policy_name(group, device_id))


def check_instance_groups(
    model: str, config: model_config_pb2.ModelConfig, policies: Mapping[str, frozenset[int]]
) -> None:
    """Refuse a model whose instance group names a host policy that was not given.

    A group naming the default policy of its own kind (``cpu`` on a CPU group,
    ``gpu_<id>`` on a GPU group, ``model``) is accepted: that is the policy it
    would have without the field.

    Raises:
        HostPolicyError: the message names the model, the group and the policy.
    """
    for group in config.instance_group:
        name = group.host_policy
        if not name or name in policies:
            continue
        kind = _kind_name(group)
        defaults = (
            # no gpus listed (none found here): the backends run it on GPU 0
            {default_policy_name(kind, g) for g in (group.gpus or [0])}
            if kind == "KIND_GPU"
            else {default_policy_name(kind)}
        )
        if name in defaults:
            continue
        given = ", ".join(sorted(policies)) or "none"
        raise HostPolicyError(
            f"model '{model}' instance group '{group.name}' names host policy '{name}', "
            f"which was not given (start pdserve with --host-policy {name},cpu-cores=... "
            f"or {name},numa-node=...; policies given: {given})"
        )


def pin(pid: int, cores: Collection[int]) -> None:
    """Pin thread or process ``pid`` to ``cores`` (0: the calling thread).

    Raises:
        ProcessLookupError: no such process (it already exited).
        HostPolicyError: the kernel refused: the message names the cores and the
            CPUs this process may use now (the cores were checked when the server
            started, but a container's cpuset can shrink while it runs, and a
            program may build :class:`pdserve.server.InferenceServer` with
            policies that never went through the command line).
    """
    try:
        os.sched_setaffinity(pid, cores)
    except ProcessLookupError:
        raise
    except OSError as e:
        raise HostPolicyError(
            f"cannot pin to host policy cpu-cores {format_cpu_list(cores)}: "
            f"{e.strerror or e} (this process may use cpu-cores "
            f"{format_cpu_list(allowed_cpus())} now)"
        ) from None


def pin_current_thread(cores: Collection[int]) -> None:
    """Pin the calling thread to ``cores`` (Linux: pid 0 is the calling thread).

    Raises:
        HostPolicyError: the kernel refused (e.g. the cores left this process's
            cpuset); see :func:`pin`.
    """
    pin(0, cores)


def name_current_thread(name: str) -> None:
    """Set the calling thread's kernel name (``comm``, 15 bytes) where Linux allows.

    ``top -H``, ``ps -L`` and ``/proc/<pid>/task/<tid>/status`` then show it; threads
    the named thread starts (ORT's pool threads) inherit it. Does nothing elsewhere.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, name.encode("utf-8", "replace")[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # pragma: no cover - not Linux / no prctl
        pass
