"""The rate limiter on its own: parsing, limits as Triton computes them, allocation order."""

from __future__ import annotations

import asyncio

import pytest
from google.protobuf import text_format

from pdserve import config as cfgmod
from pdserve.scheduling import rate_limiter
from pdserve.scheduling.rate_limiter import (
    EVERY_DEVICE,
    GLOBAL,
    RateLimiter,
    ResourceGrant,
    instance_plan,
    parse_resource,
)


class Inst:
    """A model instance as the limiter sees one: a name, an identity."""

    def __init__(self, name: str) -> None:
        self.name = name


def cfg_of(text: str, name: str = "m") -> cfgmod.ModelConfig:
    cfg = text_format.Parse(text, cfgmod.ModelConfig())
    cfg.name = name
    return cfg


def group(resources: str, count: int = 1, priority: int = 0, extra: str = "") -> str:
    return (
        f"instance_group [ {{ count: {count} kind: KIND_CPU {extra} "
        f"rate_limiter {{ resources [ {resources} ] priority: {priority} }} }} ]"
    )


def test_parse_resource_as_tritonserver() -> None:
    assert parse_resource("R1:10") == ResourceGrant("R1", 10, None)
    assert parse_resource("R2:5:1") == ResourceGrant("R2", 5, 1)
    assert [str(parse_resource(t)) for t in ("R1:10", "R2:5:1")] == ["R1:10", "R2:5:1"]
    for bad in ("R1", "R1:", ":3", "R1:x", "R1:1:2:3", "R1:-1", "R1:2:gpu"):
        with pytest.raises(ValueError, match="option format is '<resource_name>:<count>:<device>'"):
            parse_resource(bad)


def test_instance_plan_follows_the_backends_order() -> None:
    cfg = cfg_of(
        "instance_group [ { count: 2 kind: KIND_CPU }, { count: 1 kind: KIND_GPU gpus: [ 1, 3 ] } ]"
    )
    assert instance_plan(cfg) == [(0, 0), (0, 0), (1, 1), (1, 3)]


def test_default_limits_are_the_most_any_one_instance_needs() -> None:
    """Triton's documented example: A [R1:4 R2:4], B [R2:5 R3:10 R4:5], C [R1:1 R3:7 R4:2]."""
    limiter = RateLimiter()
    keep = []
    for name, res in (
        ("a", '{name: "R1" count: 4}, {name: "R2" count: 4}'),
        ("b", '{name: "R2" count: 5}, {name: "R3" count: 10}, {name: "R4" count: 5}'),
        ("c", '{name: "R1" count: 1}, {name: "R3" count: 7}, {name: "R4" count: 2}'),
    ):
        inst = Inst(name)
        limiter.register(cfg_of(group(res), name), [inst])
        keep.append(inst)  # a freed instance is forgotten
    assert limiter.limits == {(0, "R1"): 4, (0, "R2"): 5, (0, "R3"): 10, (0, "R4"): 5}


def test_explicit_resources_per_device_and_global() -> None:
    """--rate-limit-resource=R1:10 R2:5:0 R2:8:1 R3:2, R3 global: Triton's example."""
    grants = [parse_resource(t) for t in ("R1:10", "R2:5:0", "R2:8:1", "R3:2")]
    limiter = RateLimiter(grants)
    assert limiter.explicit == {EVERY_DEVICE: {"R1": 10, "R3": 2}, 0: {"R2": 5}, 1: {"R2": 8}}
    res = '{name: "R1" count: 1}, {name: "R2" count: 1}, {name: "R3" count: 1 global: true}'
    cfg = cfg_of(group(res, extra="kind: KIND_GPU gpus: [ 0, 1 ]").replace("kind: KIND_CPU ", ""))
    insts = [Inst("g0"), Inst("g1")]
    limiter.register(cfg, insts)
    assert limiter.limits == {
        (0, "R1"): 10,
        (1, "R1"): 10,
        (0, "R2"): 5,
        (1, "R2"): 8,
        (GLOBAL, "R3"): 2,
    }


def test_a_model_needing_more_than_granted_is_refused_before_loading() -> None:
    limiter = RateLimiter([parse_resource("R:1")])
    cfg = cfg_of(group('{name: "R" count: 4}'))
    with pytest.raises(cfgmod.ConfigError) as info:
        limiter.check_config(cfg, "m/config.pbtxt")
    assert info.value.field == "instance_group[0].rate_limiter.resources[0]"
    assert info.value.message == (
        'Resource count for "R" is limited to 1 which will prevent scheduling of one or more '
        "model instances, the minimum required count is 4 (--rate-limit-resource)"
    )
    other = cfg_of(group('{name: "S" count: 1}'))
    with pytest.raises(cfgmod.ConfigError, match='"S" is limited to 0'):
        limiter.check_config(other, "m/config.pbtxt")  # once any is given, others have none


def test_a_name_both_global_and_per_device_is_refused() -> None:
    limiter = RateLimiter()
    keep = Inst("a")
    limiter.register(cfg_of(group('{name: "R" count: 1 global: true}'), "a"), [keep])
    with pytest.raises(cfgmod.ConfigError, match='"R" is present as both global and device'):
        limiter.check_config(cfg_of(group('{name: "R" count: 1}'), "b"), "b/config.pbtxt")


def test_an_instance_that_is_freed_is_forgotten() -> None:
    limiter = RateLimiter()
    inst = Inst("a")
    limiter.register(cfg_of(group('{name: "R" count: 3}'), "a"), [inst])
    assert limiter.limits == {(0, "R"): 3}
    del inst
    assert limiter.limits == {}


def test_resources_are_held_during_execution_and_priority_orders_waiters() -> None:
    """Count 1 shared by three instances: one at a time; a waiter with the lowest
    executions x priority goes first."""

    async def scenario() -> list[str]:
        limiter = RateLimiter([parse_resource("R:1")])
        a, b, c = Inst("a"), Inst("b"), Inst("c")
        limiter.register(cfg_of(group('{name: "R" count: 1}', priority=1), "a"), [a])
        limiter.register(cfg_of(group('{name: "R" count: 1}', priority=1), "b"), [b])
        limiter.register(cfg_of(group('{name: "R" count: 1}', priority=4), "c"), [c])
        slots = {i.name: limiter.slot(i) for i in (a, b, c)}
        assert all(slots.values())
        order: list[str] = []
        running: list[str] = []

        async def run(name: str) -> None:
            slot = slots[name]
            assert slot is not None
            await limiter.acquire(slot, [])
            running.append(name)
            assert len(running) == 1, running
            order.append(name)
            await asyncio.sleep(0.01)
            running.remove(name)
            limiter.release(slot)

        # a and c have run once each (a: 1 x 1, c: 1 x 4); b never (0)
        for name in ("a", "c"):
            slot = slots[name]
            assert slot is not None
            slot.exec_count = 1
        first = asyncio.create_task(run("a"))
        await asyncio.sleep(0)
        waiters = [asyncio.create_task(run(n)) for n in ("c", "a", "b")]
        await asyncio.gather(first, *waiters)
        assert limiter.allocated == {(0, "R"): 0}
        return order

    assert asyncio.run(scenario()) == ["a", "b", "a", "c"]


def test_a_cancelled_waiter_holds_nothing() -> None:
    async def scenario() -> None:
        limiter = RateLimiter()
        a, b = Inst("a"), Inst("b")
        limiter.register(cfg_of(group('{name: "R" count: 1}'), "a"), [a])
        limiter.register(cfg_of(group('{name: "R" count: 1}'), "b"), [b])
        sa, sb = limiter.slot(a), limiter.slot(b)
        assert sa is not None and sb is not None
        await limiter.acquire(sa, [])
        waiter = asyncio.create_task(limiter.acquire(sb, []))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        limiter.release(sa)
        assert limiter.allocated == {(0, "R"): 0}
        await asyncio.wait_for(limiter.acquire(sb, []), 1)  # free again
        limiter.release(sb)

    asyncio.run(scenario())


def test_configure_and_the_off_warning(caplog: pytest.LogCaptureFixture) -> None:
    try:
        rate_limiter.configure("execution_count", [parse_resource("R:2")])
        assert rate_limiter.active is not None and rate_limiter.active.explicit
        rate_limiter.configure("off")
        assert rate_limiter.active is None
        with pytest.raises(ValueError, match="--rate-limit must be one of off, execution_count"):
            rate_limiter.configure("fast")
        cfg = cfg_of(group('{name: "R" count: 1}'), "warned_model")
        rate_limiter.check_config(cfg, "x")  # off: nothing to check
        rate_limiter.register(cfg, [Inst("i")])
        rate_limiter.register(cfg, [Inst("i")])
        lines = [r.getMessage() for r in caplog.records if "warned_model" in r.getMessage()]
        assert lines == [
            "model 'warned_model': instance_group rate_limiter is ignored: --rate-limit is off "
            "(use --rate-limit=execution_count)"
        ]
    finally:
        rate_limiter.configure("off")
