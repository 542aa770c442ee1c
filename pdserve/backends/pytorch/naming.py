"""Which configured tensor is which argument and which output of a PyTorch model.

A TorchScript file carries no reliable input/output metadata, so the configuration
lists every tensor and they are matched by Triton's conventions (model_configuration.md,
"Special Conventions for PyTorch Backend"). Inputs, in this order of preference: one
``Dict[str, Tensor]`` argument keyed by name; every name an argument of ``forward``;
every name ``<name>__<index>`` (argument ``index``); else the configuration's order.
Outputs: every name ``<name>__<index>``: that element of what ``forward`` returns (a
tensor is element 0); else the configuration's order. Nothing here imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

_INDEXED = re.compile(r"^(.+)__(\d+)$")


def indexed_position(name: str) -> int | None:
    """The ``<index>`` of a ``<name>__<index>`` tensor name, or None."""
    m = _INDEXED.match(name)
    return int(m.group(2)) if m else None


@dataclass(frozen=True)
class InputPlan:
    """How a batch's inputs are handed to ``forward``.

    Attributes:
        as_dict: pass one ``Dict[str, Tensor]`` keyed by configured name.
        order: configured input names in argument order (positional call); the
            configured names when ``as_dict``.
        rule: which convention matched, for messages and logs (``dict``, ``argument
            names``, ``<name>__<index>``, ``configuration order``).
    """

    as_dict: bool
    order: tuple[str, ...]
    rule: str


def plan_inputs(
    names: Sequence[str], arguments: Sequence[str] | None, dict_argument: bool = False
) -> InputPlan:
    """Match configured input names to ``forward``'s arguments.

    Args:
        names: the configuration's input names, in its order.
        arguments: ``forward``'s argument names without ``self`` (None: unknown).
        dict_argument: ``forward`` takes a single ``Dict[str, Tensor]`` argument.

    Returns:
        the plan.

    Raises:
        ValueError: ``<name>__<index>`` indices that are not ``0 .. n-1`` exactly
            once, or a count that differs from ``forward``'s arguments (the message
            says which names and which arguments).
    """
    if dict_argument:
        return InputPlan(True, tuple(names), "dict")
    if arguments is not None and names and all(n in arguments for n in names):
        if len(names) != len(arguments):
            missing = [a for a in arguments if a not in names]
            raise ValueError(
                f"forward() takes {len(arguments)} input(s) ({', '.join(arguments)}); "
                f"the configuration names {len(names)}: missing {', '.join(missing)}"
            )
        by_name = sorted(names, key=list(arguments).index)
        return InputPlan(False, tuple(by_name), "argument names")
    positions = [indexed_position(n) for n in names]
    if names and all(p is not None for p in positions):
        order = _by_index("input", names, [p for p in positions if p is not None])
        rule = "<name>__<index>"
    else:
        order, rule = tuple(names), "configuration order"
    if arguments is not None and len(order) != len(arguments):
        raise ValueError(
            f"forward() takes {len(arguments)} input(s) ({', '.join(arguments) or 'none'}); "
            f"the configuration lists {len(order)} ({', '.join(names)}), matched by {rule}"
        )
    return InputPlan(False, order, rule)


def plan_outputs(names: Sequence[str]) -> tuple[dict[str, int], str]:
    """Which element of ``forward``'s result each configured output is.

    Returns:
        ``({output name: index}, rule)``; the rule is ``<name>__<index>`` or
        ``configuration order``.

    Raises:
        ValueError: ``<name>__<index>`` indices used twice.
    """
    positions = [indexed_position(n) for n in names]
    if names and all(p is not None for p in positions):
        seen: dict[int, str] = {}
        for n, p in zip(names, positions, strict=True):
            assert p is not None
            if p in seen:
                raise ValueError(f"outputs '{seen[p]}' and '{n}' both name result element {p}")
            seen[p] = n
        return {n: p for p, n in seen.items()}, "<name>__<index>"
    return {n: i for i, n in enumerate(names)}, "configuration order"


def _by_index(kind: str, names: Sequence[str], positions: Sequence[int]) -> tuple[str, ...]:
    """Names sorted by their ``__<index>``, which must be ``0 .. n-1`` exactly once."""
    if sorted(positions) != list(range(len(names))):
        raise ValueError(
            f"{kind} names {', '.join(names)} follow <name>__<index> but their indices "
            f"{sorted(positions)} are not 0..{len(names) - 1}, each once"
        )
    return tuple(n for _, n in sorted(zip(positions, names, strict=True)))
