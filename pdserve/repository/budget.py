"""The model memory budget: which loaded models to unload (LRU) so that a load fits.

``--model-memory-budget`` bounds the summed ``memory_bytes`` of the loaded model versions
(:mod:`pdserve.repository.memory`). A load that would go over it first evicts the least
recently used *evictable* models: not pinned (``--pin-model``), idle (nothing in flight,
queued or holding the model: :meth:`MemoryBudget.hold`), and not a step of a loaded
ensemble. If that cannot make room the load is refused with :class:`BudgetExceeded`:
``alone=True`` when the model by itself exceeds the budget (INVALID_ARG), else
``alone=False`` (UNAVAILABLE, retry later). This module is pure bookkeeping (no I/O, no
event loop); the model manager loads and unloads.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

from pdserve.core.procmem import format_size


class BudgetExceeded(Exception):
    """No set of evictable models frees enough memory for a load.

    Attributes:
        name: the model being loaded.
        need: its size in bytes.
        budget: the budget in bytes.
        held: bytes held by models that may not be evicted now (pinned or busy).
        alone: the model alone is larger than the budget.
    """

    def __init__(self, name: str, need: int, budget: int, held: int) -> None:
        self.name = name
        self.need = need
        self.budget = budget
        self.held = held
        self.alone = need > budget
        if self.alone:
            msg = (
                f"model '{name}' needs {format_size(need)} ({need} bytes), more than the whole "
                f"--model-memory-budget of {format_size(budget)} ({budget} bytes)"
            )
        else:
            msg = (
                f"model '{name}' needs {format_size(need)} but only "
                f"{format_size(max(0, budget - held))} of the --model-memory-budget of "
                f"{format_size(budget)} can be freed: the rest is held by pinned models or "
                "models serving requests; retry later"
            )
        super().__init__(msg)


@dataclass
class ModelCounters:
    """Per-model lifecycle counters (kept across unloads, for metrics).

    Attributes:
        loads: successful loads (any cause: start, repository API, on demand, poll).
        evictions: unloads made by the budget to make room.
        misses: requests that found the model not loaded and waited for an
            on-demand load.
    """

    loads: int = 0
    evictions: int = 0
    misses: int = 0


@dataclass
class MemoryBudget:
    """LRU bookkeeping and the eviction rule of the model memory budget.

    Args:
        budget_bytes: the budget; None: no budget (nothing is ever evicted, but
            sizes, use and counters are still kept).
        pinned: model names that are never evicted.
    """

    budget_bytes: int | None = None
    pinned: frozenset[str] = frozenset()
    #: model name -> requests holding it (arrived, not yet answered).
    holds: dict[str, int] = field(default_factory=dict)
    #: model name -> last use tick (a request arrived or finished); higher is newer.
    last_used: dict[str, int] = field(default_factory=dict)
    #: model name -> bytes its versions took when last loaded (the estimate for the
    #: next load of that model).
    known_size: dict[str, int] = field(default_factory=dict)
    counters: dict[str, ModelCounters] = field(default_factory=dict)
    _tick: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    # -- use ---------------------------------------------------------------------

    def touch(self, name: str) -> None:
        """``name`` was just used (most recently used from now)."""
        self.last_used[name] = next(self._tick)

    def hold(self, name: str) -> None:
        """A request for ``name`` arrived: it may not be evicted until :meth:`release`
        (the caller :meth:`touch` es it once the model is found)."""
        self.holds[name] = self.holds.get(name, 0) + 1

    def release(self, name: str) -> None:
        """The request that held ``name`` was answered (a used model is touched;
        names never used, such as typos, leave nothing behind)."""
        left = self.holds.get(name, 0) - 1
        if left > 0:
            self.holds[name] = left
        else:
            self.holds.pop(name, None)
        if name in self.last_used:
            self.touch(name)

    def counter(self, name: str) -> ModelCounters:
        """The counters of ``name`` (created on first use)."""
        c = self.counters.get(name)
        if c is None:
            c = self.counters[name] = ModelCounters()
        return c

    # -- the rule ----------------------------------------------------------------

    def evictable(self, name: str, busy: Collection[str]) -> bool:
        """True when ``name`` may be evicted now: not pinned, not held, not in ``busy``
        (requests in flight or queued, or a step of a loaded ensemble)."""
        return name not in self.pinned and not self.holds.get(name) and name not in busy

    def plan(
        self,
        name: str,
        need: int,
        loaded: Mapping[str, int],
        busy: Collection[str] = (),
        used_by: Mapping[str, Collection[str]] | None = None,
    ) -> list[str]:
        """The models to evict, least recently used first, so that ``need`` bytes for
        ``name`` fit beside what stays loaded.

        Args:
            name: the model being loaded (never evicted for itself; its current size,
                if it is loaded, is not counted: a reload replaces it).
            need: bytes the load will take (a measured or remembered size; 0 when
                unknown yet: then only an existing overrun is resolved).
            loaded: model name -> bytes of every loaded model.
            busy: names that may not be evicted now besides pinned and held ones
                (requests in flight or queued).
            used_by: model name -> the loaded ensembles with a step that uses it; such
                a model is evicted only after all of those ensembles are.

        Returns:
            names to evict, in order (empty when it fits, or without a budget).

        Raises:
            BudgetExceeded: the model alone exceeds the budget, or evicting every
                evictable model is still not enough (then nothing is to be evicted).
        """
        budget = self.budget_bytes
        if budget is None:
            return []
        if need > budget:
            raise BudgetExceeded(name, need, budget, 0)
        others = {n: b for n, b in loaded.items() if n != name}
        used = sum(others.values())
        users = used_by or {}
        chosen: list[str] = []
        while used + need > budget:
            gone = set(chosen)
            candidates = [
                n
                for n in others
                if n not in gone
                and self.evictable(n, busy)
                and all(e in gone or e == name for e in users.get(n, ()))
            ]
            if not candidates:
                held = sum(b for n, b in others.items() if n not in gone)
                raise BudgetExceeded(name, need, budget, held)
            pick = min(candidates, key=lambda n: self.last_used.get(n, 0))
            chosen.append(pick)
            used -= others[pick]
        return chosen
