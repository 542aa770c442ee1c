"""How the ensembles of a repository step into each other, for ``pdserve check``:
circular dependencies (reported with Triton's message) and the order in which
ensembles are checked (an ensemble after the ensembles it steps into)."""

from __future__ import annotations

from collections import deque

from pdserve.repository import layout

#: ensemble -> ``(step index, cycle)`` for each of its steps that leads back to it.
Cycles = dict[str, list[tuple[int, list[str]]]]


def ensemble_cycles(steps: dict[str, list[str]]) -> Cycles:
    """Circular dependencies between ensembles (A steps into B, which steps into A).

    Args:
        steps: ensemble name -> the model name of each of its steps, in order.

    Returns:
        ensemble -> ``(step index, cycle)`` for each of its steps that leads back to
        it, ``cycle`` the shortest path of ensemble names from it back to it
        (``[A, B, A]``). Every ensemble of a cycle is in the map, each with its own
        steps: Triton's ``CircularDependencyCheck`` marks every node of the cycle.
    """
    found: Cycles = {}
    for start, models in steps.items():
        for index, first in enumerate(models):
            if first not in steps:
                continue
            # breadth first from the step's ensemble until ``start`` is reached
            parent: dict[str, str | None] = {first: None}
            queue = deque([first])
            while queue and start not in parent:
                node = queue.popleft()
                for nxt in steps[node]:
                    if nxt in steps and nxt not in parent:
                        parent[nxt] = node
                        queue.append(nxt)
            if start not in parent:
                continue
            chain: list[str] = []
            at: str | None = start
            while at is not None:
                chain.append(at)
                at = parent[at]
            found.setdefault(start, []).append((index, [start, *chain[::-1]]))
    return found


def ensemble_order(
    ensembles: list[layout.ModelDir], steps: dict[str, list[str]], cycles: Cycles
) -> list[layout.ModelDir]:
    """Ensembles whose steps are ensembles come after those; a step into a cycle
    (reported as such, never validated) does not order."""
    names = {m.name for m in ensembles}
    inner = {n: set(models) & names for n, models in steps.items()}
    for name, found in cycles.items():
        inner[name] -= {cycle[1] for _, cycle in found}
    done: set[str] = set()
    order: list[layout.ModelDir] = []
    todo = list(ensembles)
    while todo:
        ready = [m for m in todo if not inner[m.name] - done] or todo[:1]
        for m in ready:
            todo.remove(m)
            done.add(m.name)
            order.append(m)
    return order
