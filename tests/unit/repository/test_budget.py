"""The model memory budget's rule (:mod:`pdserve.repository.budget`): LRU over idle,
unpinned models; refusals when nothing more may leave."""

from __future__ import annotations

import mmap

import pytest

from pdserve.core.procmem import format_size, parse_size
from pdserve.repository.budget import BudgetExceeded, MemoryBudget

MIB = 1024**2


def used(budget: MemoryBudget, *names: str) -> None:
    """Use ``names`` in this order (the last one is the most recently used)."""
    for n in names:
        budget.touch(n)


def test_no_budget_never_evicts() -> None:
    b = MemoryBudget()
    assert b.plan("x", 10**12, {"a": 10**12}) == []


def test_fits_without_eviction() -> None:
    b = MemoryBudget(100 * MIB)
    assert b.plan("c", 30 * MIB, {"a": 30 * MIB, "b": 40 * MIB}) == []


def test_evicts_least_recently_used_first_and_only_as_many_as_needed() -> None:
    b = MemoryBudget(100 * MIB)
    used(b, "a", "b", "c")  # a is the least recently used
    loaded = {"a": 30 * MIB, "b": 30 * MIB, "c": 30 * MIB}
    assert b.plan("d", 20 * MIB, loaded) == ["a"]
    assert b.plan("d", 50 * MIB, loaded) == ["a", "b"]
    used(b, "a")  # now b is the oldest
    assert b.plan("d", 20 * MIB, loaded) == ["b"]


def test_pinned_held_and_busy_models_never_leave() -> None:
    b = MemoryBudget(100 * MIB, pinned=frozenset({"a"}))
    used(b, "a", "b", "c", "d")
    loaded = {"a": 25 * MIB, "b": 25 * MIB, "c": 25 * MIB, "d": 25 * MIB}
    b.hold("b")  # a request arrived for b (queued or waiting for a load)
    assert b.plan("e", 20 * MIB, loaded, busy={"c"}) == ["d"]
    with pytest.raises(BudgetExceeded):  # only d may leave
        b.plan("e", 45 * MIB, loaded, busy={"c"})
    b.release("b")  # answered: b is free to go again, and the most recently used
    assert b.plan("e", 45 * MIB, loaded, busy={"c"}) == ["d", "b"]
    assert b.holds == {}


def test_a_hold_is_counted_per_request() -> None:
    b = MemoryBudget(10)
    b.hold("a")
    b.hold("a")
    b.release("a")
    assert not b.evictable("a", ())
    b.release("a")
    assert b.evictable("a", ())


def test_release_of_a_never_used_name_leaves_nothing() -> None:
    b = MemoryBudget(10)
    b.hold("typo")
    b.release("typo")
    assert b.holds == {} and b.last_used == {}


def test_model_alone_larger_than_the_budget() -> None:
    b = MemoryBudget(10 * MIB)
    with pytest.raises(BudgetExceeded) as e:
        b.plan("big", 11 * MIB, {})
    assert e.value.alone
    assert "more than the whole --model-memory-budget of 10.0 MiB" in str(e.value)


def test_not_enough_evictable_memory_is_refused_without_evicting() -> None:
    b = MemoryBudget(100 * MIB, pinned=frozenset({"a"}))
    used(b, "a", "b")
    with pytest.raises(BudgetExceeded) as e:
        b.plan("c", 50 * MIB, {"a": 60 * MIB, "b": 30 * MIB}, busy={"b"})
    assert not e.value.alone
    assert e.value.held == 90 * MIB
    assert "retry later" in str(e.value)


def test_reload_does_not_count_its_own_size() -> None:
    b = MemoryBudget(100 * MIB)
    used(b, "a", "b")
    assert b.plan("b", 70 * MIB, {"a": 30 * MIB, "b": 70 * MIB}) == []


def test_overrun_found_after_measuring_is_resolved() -> None:
    b = MemoryBudget(100 * MIB)
    used(b, "a", "new")
    # "new" measured 80 MiB at load; "a" must go
    assert b.plan("new", 80 * MIB, {"a": 30 * MIB, "new": 80 * MIB}) == ["a"]


def test_steps_of_a_loaded_ensemble_leave_after_it() -> None:
    b = MemoryBudget(100 * MIB)
    used(b, "step", "other", "ens")  # step is the oldest, but ens uses it
    loaded = {"step": 60 * MIB, "ens": 0, "other": 30 * MIB}
    users = {"step": ["ens"]}
    assert b.plan("x", 30 * MIB, loaded, used_by=users) == ["other"]
    assert b.plan("x", 60 * MIB, loaded, used_by=users) == ["other", "ens", "step"]
    with pytest.raises(BudgetExceeded):
        b.plan("x", 60 * MIB, loaded, busy={"ens"}, used_by=users)


def test_counters() -> None:
    b = MemoryBudget()
    b.counter("a").misses += 2
    assert b.counter("a").misses == 2 and b.counter("a").loads == 0


@pytest.mark.parametrize(
    ("text", "size"),
    [("2GiB", 2 * 1024**3), ("512MiB", 512 * MIB), ("1.5GB", 1_500_000_000), ("4096", 4096)],
)
def test_parse_size(text: str, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("bad", ["", "lots", "0", "-1GiB", "2XB"])
def test_parse_size_refuses(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_size() -> None:
    assert format_size(3 * MIB) == "3.0 MiB"
    assert format_size(17) == "17 B"


# -- where the sizes show: statistics and metrics ---------------------------------------


def test_stats_memory_usage_is_tritons_shape() -> None:
    from pdserve.core.stats import ModelStats

    s = ModelStats("m", "1")
    assert s.as_dict()["memory_usage"] == []
    assert "memory_bytes" not in s.as_dict()
    s.memory_bytes, s.memory_source, s.gpu_memory_bytes = 5 * MIB, "worker_rss", 3 * MIB
    d = s.as_dict()
    assert d["memory_usage"] == [
        {"type": "CPU", "id": 0, "byte_size": 5 * MIB},
        {"type": "GPU", "id": 0, "byte_size": 3 * MIB},
    ]
    assert (d["memory_bytes"], d["memory_source"]) == (5 * MIB, "worker_rss")


def test_memory_metric_families() -> None:
    from pdserve.core.stats import ModelStats
    from pdserve.observability.metrics import memory_families
    from pdserve.repository.budget import ModelCounters

    a, b = ModelStats("a", "1"), ModelStats("b", "2")
    a.memory_bytes, a.memory_source = 1024, "rss_delta"  # b: not measured
    report = {
        "budget_bytes": 4096,
        "used_bytes": 1024,
        "models": {"a": ModelCounters(loads=2, evictions=1, misses=3)},
    }
    text = "".join(f.render() for f in memory_families([a, b], report))
    assert 'pdserve_model_memory_bytes{model="a",version="1",source="rss_delta"} 1024\n' in text
    assert 'model="b"' not in text
    assert 'pdserve_model_loads_total{model="a"} 2\n' in text
    assert 'pdserve_model_evictions_total{model="a"} 1\n' in text
    assert 'pdserve_model_load_misses_total{model="a"} 3\n' in text
    assert "pdserve_model_memory_used_bytes 1024\n" in text
    assert "pdserve_model_memory_budget_bytes 4096\n" in text
    assert "# TYPE pdserve_model_loads_total counter\n" in text
    report["budget_bytes"] = None
    text = "".join(f.render() for f in memory_families([a], report))
    assert "pdserve_model_memory_budget_bytes" not in text


def test_own_rss_follows_an_allocation() -> None:
    from pdserve.core.procmem import own_rss

    # An anonymous mapping always gets fresh pages; a bytearray may reuse heap pages
    # that an earlier test freed but malloc kept resident (CI saw +14 MiB for 32).
    before = own_rss()
    assert before is not None and before > MIB
    block = mmap.mmap(-1, 32 * MIB)
    for i in range(0, 32 * MIB, mmap.PAGESIZE):
        block[i] = 1
    after = own_rss()
    block.close()
    assert after is not None and after - before >= 30 * MIB
