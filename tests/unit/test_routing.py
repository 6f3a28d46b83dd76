"""The router's decisions on a capability snapshot, in process (no store, no sockets)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reach.config import ConfigError, ReachSettings, RoutingSettings
from reach.errors import NoInstance
from reach.registry import HealthReport, JoinRequest, Registry
from reach.registry.view import CapabilitySnapshot, RegistryView, RouteEntry
from reach.routing import Router, available, check_routing, hash_key
from reach.routing.algorithms import HashRing
from reach.routing.inflight import InflightTracker
from reach.settings_checks import load_checked_settings
from reach.store import MemoryStore


def entry(name: str, **kw: Any) -> RouteEntry:
    values: dict[str, Any] = {
        "instance_id": name,
        "capability": "cap",
        "protocol": "http",
        "address": f"{name}:1",
        "max_message_bytes": 1 << 20,
        "status": "ok",
        "weight": 1,
        "max_inflight": None,
        "joined_at": 0.0,
        "declared": {},
    }
    return RouteEntry(**(values | kw))


def snapshot(*entries: RouteEntry) -> CapabilitySnapshot:
    return CapabilitySnapshot("cap", entries)


def router(inflight: InflightTracker | None = None, **kw: Any) -> Router:
    return Router(lambda _capability: RoutingSettings(**kw), inflight)


def picks(r: Router, snap: CapabilitySnapshot, n: int, **kw: Any) -> Counter[str]:
    return Counter(r.route(snap, **kw).entry.instance_id for _ in range(n))


def test_round_robin_takes_each_in_turn() -> None:
    snap = snapshot(entry("a"), entry("b"), entry("c"))
    assert picks(router(strategy="round_robin"), snap, 300) == {"a": 100, "b": 100, "c": 100}


def test_weighted_round_robin_gives_each_its_share_without_bursts() -> None:
    snap = snapshot(entry("a", weight=3), entry("b"))
    r = router(strategy="weighted_round_robin")
    order = [r.route(snap).entry.instance_id for _ in range(400)]
    assert Counter(order) == {"a": 300, "b": 100}
    assert "aaaa" not in "".join(order)  # smooth: never more than its share in a row
    # Configuration overrides what the instance sent at Join.
    r = router(strategy="weighted_round_robin", weights={"b": 3})
    assert picks(r, snap, 600) == {"a": 300, "b": 300}


def test_weighted_round_robin_over_many_instances_keeps_the_shares() -> None:
    entries = [entry(f"i{n:03d}", weight=1 + n % 3) for n in range(300)]
    snap = snapshot(*entries)
    got = picks(router(strategy="weighted_round_robin"), snap, 600 * 2)
    assert all(got[e.instance_id] == 2 * e.weight for e in entries)


def test_least_request_avoids_the_busy_instance() -> None:
    inflight = InflightTracker()
    snap = snapshot(entry("slow"), entry("b"), entry("c"))
    r = router(inflight, strategy="least_request")
    for _ in range(3):
        inflight.begin("cap", "slow")
    got = picks(r, snap, 40)
    assert got["slow"] == 0
    assert got["b"] == got["c"] == 20
    # Reservations count a pick until its call begins: a burst spreads out.
    burst = [r.route(snap, reserve=f"r{n}").entry.instance_id for n in range(6)]
    assert Counter(burst) == {"b": 3, "c": 3}


def test_least_request_compares_two_of_many() -> None:
    inflight = InflightTracker()
    snap = snapshot(*(entry(f"i{n:02d}") for n in range(50)))
    for n in range(25):
        for _ in range(5):
            inflight.begin("cap", f"i{n:02d}")
    got = picks(router(inflight, strategy="least_request"), snap, 2000)
    busy = sum(v for k, v in got.items() if int(k[1:]) < 25)
    # Two random choices: a busy one wins only when both draws are busy (~1/4).
    assert busy < 0.35 * 2000


def test_consistent_hash_keeps_a_key_on_its_instance_and_falls_back_without_one() -> None:
    snap = snapshot(*(entry(f"i{n}") for n in range(10)))
    r = router(strategy="consistent_hash")
    homes = {r.route(snap, key="user-7").entry.instance_id for _ in range(100)}
    assert len(homes) == 1
    route = r.route(snap)
    assert route.strategy == "round_robin"
    assert route.note == "no hash key (routing_key): routed by round_robin"


def test_consistent_hash_spills_a_hot_key_when_its_home_is_full() -> None:
    inflight = InflightTracker()
    snap = snapshot(*(entry(f"i{n}") for n in range(4)))
    r = router(inflight, strategy="consistent_hash", balance_factor=1.25)
    home = r.route(snap, key="hot").entry.instance_id
    seen = Counter()
    for _ in range(20):
        chosen = r.route(snap, key="hot").entry.instance_id
        inflight.begin("cap", chosen)
        seen[chosen] += 1
    assert seen[home] < 20
    assert len(seen) > 1
    assert max(inflight.counts("cap").values()) <= 7  # ceil(1.25 * 20 / 4)


def test_an_instance_at_max_inflight_gets_nothing_until_it_drains() -> None:
    inflight = InflightTracker()
    snap = snapshot(entry("a", max_inflight=1), entry("b"))
    r = router(inflight, strategy="round_robin")
    call = inflight.begin("cap", "a")
    routes = [r.route(snap) for _ in range(10)]
    assert {route.entry.instance_id for route in routes} == {"b"}
    # The record names the full instance whenever routing met it on its way.
    assert [route.bypassed for route in routes].count(["a"]) >= 5
    inflight.end(call)
    assert picks(r, snap, 10) == {"a": 5, "b": 5}
    # Configuration may lower it; the smaller of the two holds.
    r = router(inflight, strategy="round_robin", max_inflight=2)
    for _ in range(2):
        inflight.begin("cap", "b")
    inflight.begin("cap", "a")
    with pytest.raises(NoInstance, match="max_inflight") as err:
        r.route(snap)
    assert err.value.retryable
    assert err.value.retry_after_s == 1


def test_degraded_serves_only_when_no_ok_instance_is_left() -> None:
    r = router(strategy="round_robin")
    snap = snapshot(entry("a", status="degraded"), entry("b"))
    assert picks(r, snap, 10) == {"b": 10}
    route = r.route(snap, exclude=["b"])
    assert route.entry.instance_id == "a"
    assert route.note == "no ok instance could take it: routed to a degraded one"
    alone = snapshot(entry("a", status="degraded"), entry("b", status="unhealthy"))
    assert picks(r, alone, 5) == {"a": 5}
    with pytest.raises(NoInstance):
        r.route(snapshot(entry("b", status="unhealthy")))


def test_retries_and_ejections_are_avoided_while_another_is_left() -> None:
    r = router(strategy="least_request")
    snap = snapshot(entry("a"), entry("b"), entry("c"))
    route = r.route(snap, exclude=["a"], ejected=["b"])
    assert route.entry.instance_id == "c"
    assert route.skipped == ["b"]
    # An ejected instance before the one this request just tried.
    assert r.route(snap, exclude=["a", "c"], ejected=["b"]).entry.instance_id == "b"
    assert r.route(snap, exclude=["a", "b", "c"]).entry.instance_id in {"a", "b", "c"}


def test_hash_key_reads_the_configured_payload_field() -> None:
    ch = RoutingSettings(strategy="consistent_hash", hash_on="payload.user.id")
    assert hash_key(ch, {"user": {"id": "u1"}}, None) == "u1"
    assert hash_key(ch, {"user": {"id": 42}}, None) == "42"
    assert hash_key(ch, {"user": {}}, "rk") == "rk"  # missing: the routing_key
    assert hash_key(ch, {}, None) is None
    assert hash_key(RoutingSettings(strategy="consistent_hash"), {"x": 1}, "rk") == "rk"
    assert hash_key(RoutingSettings(strategy="round_robin"), {"x": 1}, "rk") is None


def test_strategies_are_plug_ins_and_an_unknown_one_stops_start_up(tmp_path: Any) -> None:
    assert {"round_robin", "weighted_round_robin", "least_request", "consistent_hash"} <= set(
        available()
    )
    bad = ReachSettings(capabilities={"x": {"routing": {"strategy": "fastest"}}})
    with pytest.raises(ConfigError, match=r"capabilities\.x\.routing\.strategy.*known: "):
        check_routing(bad)
    with pytest.raises(ConfigError, match="needs a key"):
        check_routing(ReachSettings(routing={"fallback": "consistent_hash"}))
    config = tmp_path / "reach.yaml"
    config.write_text("reach:\n  routing:\n    strategy: nearest\n")
    with pytest.raises(ConfigError, match=f"{config}.*'nearest'.*least_request"):
        load_checked_settings(config)


def test_capability_routing_overrides_the_defaults() -> None:
    settings = ReachSettings(
        routing={"strategy": "least_request", "vnodes": 200},
        capabilities={"kr": {"routing": {"strategy": "consistent_hash", "balance_factor": 2}}},
    )
    kr = settings.routing_for("kr")
    assert (kr.strategy, kr.vnodes, kr.balance_factor) == ("consistent_hash", 200, 2.0)
    assert settings.routing_for("other").strategy == "least_request"


@settings(max_examples=40, deadline=None)
@given(
    st.sets(st.text("abcdefghij0123456789", min_size=1, max_size=8), min_size=3, max_size=30),
    st.data(),
)
def test_removing_an_instance_moves_only_its_keys(names: set[str], data: st.DataObject) -> None:
    weights = {name: 1 for name in names}
    leaving = data.draw(st.sampled_from(sorted(names)))
    before = HashRing(weights)
    after = HashRing({k: v for k, v in weights.items() if k != leaving})
    keys = [f"k{n}" for n in range(2000)]
    for key in keys:
        if before.lookup(key) != leaving:
            assert after.lookup(key) == before.lookup(key)
    moved = sum(before.lookup(k) == leaving for k in keys) / len(keys)
    # About 1/N of the keys; 100 virtual nodes keep a share within a few times of fair.
    assert moved < 4.0 / len(names) + 0.02


@settings(max_examples=30, deadline=None)
@given(
    st.integers(2, 20),
    st.lists(st.integers(0, 50), min_size=1, max_size=300),
    st.sampled_from([1.0, 1.25, 2.0]),
)
def test_bounded_load_never_passes_the_bound(n: int, keys: list[int], factor: float) -> None:
    ring = HashRing({f"i{k}": 1 for k in range(n)})
    load: Counter[str] = Counter()
    for key in keys:
        chosen = ring.lookup_bounded(f"user-{key}", load, balance_factor=factor)
        total = sum(load.values()) + 1
        assert load[chosen] + 1 <= max(1, -(-factor * total // n))
        load[chosen] += 1


async def test_the_view_follows_joins_health_and_leaves_through_the_store() -> None:
    store = MemoryStore()
    registry = Registry(store, settings=ReachSettings().registry)
    view = RegistryView(registry, resync_s=60, sweep_s=60)
    await view.start()
    try:
        assert await view.snapshot("cap") is None
        await registry.join(
            JoinRequest(capability="cap", instance_id="a", service_address="a:1", weight=2)
        )
        snap = await view.snapshot("cap")
        assert snap is not None
        assert [e.weight for e in snap.entries] == [2]
        await registry.heartbeat("a", HealthReport(status="degraded"))
        snap = await view.snapshot("cap")
        assert snap is not None
        assert snap.degraded
        assert not snap.ok
        # A change made by another process arrives as an event: the view re-reads it.
        other = Registry(store, settings=ReachSettings().registry)
        await other.leave("a")
        await asyncio.sleep(0)
        assert await view.snapshot("cap") is None
        assert await view.known("cap")  # still known: 503 no_instance, not 404
    finally:
        await view.aclose()


def test_a_snapshot_holds_what_routing_needs_and_little_else() -> None:
    snap = snapshot(entry("a", max_message_bytes=10), entry("b", status="unhealthy"), entry("c"))
    assert [e.instance_id for e in snap.routable] == ["a", "c"]
    assert snap.smallest is not None
    assert snap.smallest.instance_id == "a"
    assert snap.declared("query") is None
    rng = random.Random(1)
    assert snapshot(*rng.sample(snap.entries, 3)).entries == snap.entries  # sorted by id


def test_least_request_remembers_a_stalled_instance_after_its_calls_end() -> None:
    inflight = InflightTracker()
    snap = snapshot(entry("stalled"), entry("b"), entry("c"))
    r = router(inflight, strategy="least_request")
    for name in ("b", "c", "b", "c"):
        inflight.end(inflight.begin("cap", name))  # quick answers
    stalled = inflight.begin("cap", "stalled")
    stalled.started -= 1.0  # it held the call a whole second, then timed out
    inflight.end(stalled, failed=True)
    # Nothing is in flight anywhere, yet the stalled one is not chosen while it is slow...
    assert picks(r, snap, 30)["stalled"] == 0
    # ...and is tried again once that is old news (its latency drifts back to typical).
    latency = inflight.latency("cap")
    assert latency.of("stalled", stalled.started + 120) == pytest.approx(latency.typical(), abs=0.1)


def test_a_long_payload_key_travels_as_a_digest_and_numbers_mean_what_json_means() -> None:
    ch = RoutingSettings(strategy="consistent_hash", hash_on="payload.doc")
    long = hash_key(ch, {"doc": "x" * 100_000}, None)
    assert long is not None
    assert long.startswith("xxh3-128:")
    assert len(long) < 64
    assert hash_key(ch, {"doc": 5.0}, None) == hash_key(ch, {"doc": 5}, None) == "5"
    assert hash_key(ch, {"doc": ""}, None) is None  # no key: the fallback routes it


def test_weighted_schedule_goes_on_across_health_changes_elsewhere() -> None:
    r = router(strategy="weighted_round_robin")
    entries = [entry(f"i{n}") for n in range(4)]
    other = entry("x", status="unhealthy")
    got: Counter[str] = Counter()
    for n in range(40):
        # Each request sees a new snapshot (an unrelated instance flaps), same ok tier.
        flapped = entry("x", status="unhealthy" if n % 2 else "degraded")
        snap = snapshot(*entries, flapped if n else other)
        got[r.route(snap).entry.instance_id] += 1
    assert got == {"i0": 10, "i1": 10, "i2": 10, "i3": 10}


def test_a_large_ring_keeps_its_size_bounded() -> None:
    from reach.routing.strategies import MAX_RING_POINTS, ring_vnodes

    assert ring_vnodes(100, 10) == 100
    assert ring_vnodes(100, 10_000) * 10_000 <= MAX_RING_POINTS
    assert ring_vnodes(100, 10_000_000) == 1


def test_latency_of_instances_that_left_is_forgotten() -> None:
    inflight = InflightTracker()
    for n in range(100):
        inflight.end(inflight.begin("cap", f"gone-{n}"))
    r = router(inflight, strategy="least_request")
    r.route(snapshot(entry("a"), entry("b")))
    assert len(inflight.latency("cap")) == 0


async def test_a_leave_or_an_eviction_drops_the_instances_latency_whoever_saw_it() -> None:
    clock = [0.0]
    store = MemoryStore(clock=lambda: clock[0])
    settings = ReachSettings().registry
    registry = Registry(store, settings=settings)
    view = RegistryView(registry, resync_s=60, sweep_s=None)
    inflight = InflightTracker()
    view.on_removed(inflight.forget)
    await view.start()
    try:
        for name in ("stays", "leaves", "evicted", "moves"):
            await registry.join(
                JoinRequest(capability="cap", instance_id=name, service_address="a:1")
            )
            inflight.end(inflight.begin("cap", name))
        assert await view.snapshot("cap") is not None
        assert len(inflight.latency("cap")) == 4
        # A leave through another process (an event), a move to another capability, and an
        # eviction found by this process's sweep: each drops its entry, nothing else does.
        await Registry(store, settings=settings).leave("leaves")
        await registry.join(
            JoinRequest(capability="other", instance_id="moves", service_address="a:1")
        )
        clock[0] = settings.heartbeat_timeout - 1
        for name in ("stays", "moves"):
            await registry.heartbeat(name, HealthReport())
        clock[0] = settings.heartbeat_timeout + 1
        await registry.sweep()
        snap = await view.snapshot("cap")
        assert snap is not None
        assert [e.instance_id for e in snap.entries] == ["stays"]
        assert len(inflight.latency("cap")) == 1
    finally:
        await view.aclose()


def test_a_ring_built_in_a_thread_is_not_kept_once_its_router_is_gone(monkeypatch: Any) -> None:
    """A large ring is built in a thread, and the router that asked may be gone once it is
    built: then nothing keeps it (the thread's future held it, ~1.8 MB at 10,000 instances)."""
    import gc
    import threading
    import weakref

    from reach.routing import strategies

    built: list[weakref.ref[HashRing]] = []
    started, release = threading.Event(), threading.Event()

    class Watched(HashRing):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            started.set()
            release.wait(30)
            super().__init__(*args, **kwargs)
            built.append(weakref.ref(self))

    monkeypatch.setattr(strategies, "HashRing", Watched)
    monkeypatch.setattr(strategies, "BUILD_INLINE_UP_TO", 0)  # every ring in a thread

    async def run() -> None:
        r = router(strategy="consistent_hash")
        snap = snapshot(*(entry(f"i{n}") for n in range(50)))
        assert r.route(snap, key="user-7").strategy == "consistent_hash"  # round robin meanwhile
        assert started.wait(30)
        future = snap.cache["ch:waiting"]
        del r, snap
        gc.collect()
        release.set()
        await future
        assert len(built) == 1
        assert built[0]() is None

    asyncio.run(run())
