"""Queue policies and priority levels of the dynamic batcher.

:class:`PriorityLevels` reads Triton's ``ModelDynamicBatching`` / ``ModelQueuePolicy``
(model_config.proto; docs/protocol/extension_schedule_policy.md) into one
:class:`QueuePolicy` per priority level: queue bound, timeout and timeout action.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.core.errors import InferError

if TYPE_CHECKING:
    from tritonclient.grpc import model_config_pb2

#: ``ModelQueuePolicy.TimeoutAction`` values (model_config.proto).
REJECT = 0
DELAY = 1


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """One level's queue policy.

    Attributes:
        timeout_ns: default queue timeout in ns (0: none).
        delay: True for ``timeout_action: DELAY``, False for ``REJECT``.
        allow_override: a request's ``timeout`` parameter may shorten the timeout.
        max_queue_size: requests allowed to wait at this level (0: unbounded).
    """

    timeout_ns: int = 0
    delay: bool = False
    allow_override: bool = False
    max_queue_size: int = 0

    @classmethod
    def from_proto(cls, p: model_config_pb2.ModelQueuePolicy) -> QueuePolicy:
        """From a ``ModelQueuePolicy`` message."""
        return cls(
            timeout_ns=int(p.default_timeout_microseconds) * 1000,
            delay=p.timeout_action == DELAY,
            allow_override=bool(p.allow_timeout_override),
            max_queue_size=int(p.max_queue_size),
        )

    def timeout_for(self, parameters: dict[str, Any]) -> int:
        """Queue timeout in ns for a request with these ``parameters`` (0: none).

        Raises:
            InferError(INVALID_ARG): ``timeout`` is not a non-negative integer.
        """
        if not self.allow_override:
            return self.timeout_ns
        value = parameters.get("timeout")
        if value is None:
            return self.timeout_ns
        us = _uint_param("timeout", value)
        if us == 0:
            return self.timeout_ns
        ns = us * 1000
        if self.timeout_ns == 0 or ns < self.timeout_ns:
            return ns
        return self.timeout_ns


def _uint_param(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, str) and value.isdigit():
            return int(value)
        raise InferError(f"request parameter '{name}' must be an unsigned integer, got {value!r}")
    if value < 0:
        raise InferError(f"request parameter '{name}' must be an unsigned integer, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class PriorityLevels:
    """Priority levels of one model and their queue policies.

    Follows Triton's ``ModelDynamicBatching`` / ``ModelQueuePolicy`` messages
    (model_config.proto) and the schedule-policy protocol extension
    (docs/protocol/extension_schedule_policy.md):

    - ``priority_levels`` N (0: one level) and ``default_priority_level``; a request's
      ``priority`` parameter picks a level, 1 being the highest; 0, a missing
      parameter, or a value above N means the default level.
    - ``default_queue_policy`` applies to every level without an entry in
      ``priority_queue_policy``.
    - ``max_queue_size``: requests queued at that level (0: unbounded); a request that
      does not fit is rejected at once.
    - ``default_timeout_microseconds`` (0: none) with ``timeout_action`` ``REJECT``
      (the request fails) or ``DELAY`` (it is moved behind the requests of its level
      that have not timed out); ``allow_timeout_override`` lets a request's
      ``timeout`` parameter (µs) *shorten* the default (any value, when the default
      is 0 = no timeout).

    Attributes:
        count: number of levels (>= 1; config ``priority_levels`` 0 means 1).
        default: the default level (1-based).
        policies: policy of level ``i + 1`` at index ``i``.
    """

    count: int
    default: int
    policies: tuple[QueuePolicy, ...]

    @classmethod
    def from_config(cls, db: model_config_pb2.ModelDynamicBatching) -> PriorityLevels:
        """From a ``ModelDynamicBatching`` message."""
        count = max(1, int(db.priority_levels))
        default = int(db.default_priority_level) if db.priority_levels else 1
        if not 1 <= default <= count:
            default = 1
        base = QueuePolicy.from_proto(db.default_queue_policy)
        policies = tuple(
            QueuePolicy.from_proto(db.priority_queue_policy[level])
            if level in db.priority_queue_policy
            else base
            for level in range(1, count + 1)
        )
        return cls(count, default, policies)

    def level_for(self, parameters: dict[str, Any]) -> int:
        """0-based level index of a request (Triton: 0 or > levels -> default).

        Raises:
            InferError(INVALID_ARG): ``priority`` is not a non-negative integer.
        """
        value = parameters.get("priority")
        if value is None or self.count == 1:
            return self.default - 1
        p = _uint_param("priority", value)
        if p == 0 or p > self.count:
            return self.default - 1
        return p - 1
