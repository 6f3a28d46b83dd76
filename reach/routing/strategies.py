"""The built-in routing strategies (R12, R17, R22), each a plug-in of the entry-point group
`agent_reach.routing` like any other.

A strategy instance serves one capability in one process. `pick` chooses among one *tier* of a
capability's snapshot (its `ok` instances, or its `degraded` ones) and must never return an
instance in `ctx.blocked` (tried already by this request, ejected, or at its max_inflight);
None means every instance of the tier is blocked. It runs synchronously, on data in memory:
no store round trip, microseconds at 10,000 instances (`bench/routing.py`).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from reach.config import RoutingSettings
from reach.registry.view import CapabilitySnapshot, RouteEntry
from reach.routing.algorithms import (
    EdfWeighted,
    HashRing,
    SmoothWeighted,
)
from reach.routing.inflight import Latency, Loads

SMOOTH_UP_TO = 64  # larger sets: EDF on a heap instead of nginx's scan
FULL_SCAN_UP_TO = 8  # least request: every instance compared; more: two random ones
SAMPLES = 8  # random draws before a strategy falls back to scanning the tier
TIE = 1.5  # least request: latencies within this factor of the fastest count as equal
BUILD_INLINE_UP_TO = 50_000  # ring points built on the event loop; more: in a thread
MAX_RING_POINTS = 200_000  # Envoy's maximum_ring_size, scaled to Python: ~0.2 s to build


def ring_vnodes(vnodes: int, total_weight: int) -> int:
    """Virtual nodes per unit of weight: as configured, fewer when the ring would pass
    MAX_RING_POINTS (10,000 instances of weight 1 get 20 each; bounded load evens out what
    fewer points leave uneven)."""
    return max(1, min(vnodes, MAX_RING_POINTS // max(1, total_weight)))


@dataclass(slots=True)
class PickContext:
    tier: str  # "ok" | "degraded"
    blocked: Container[str] = frozenset()
    key: str | None = None
    loads: Loads = field(default_factory=lambda: Loads({}, {}, 0))  # in flight, and the total
    latency: Latency | None = None  # each instance's recent latency (strategies that use loads)


class Strategy(ABC):
    """Chooses one instance of a tier; see the module docstring."""

    name: ClassVar[str]
    uses_key: ClassVar[bool] = False  # needs a hash key (else the fallback strategy routes)
    uses_loads: ClassVar[bool] = False  # reads in-flight counts

    def __init__(self, settings: RoutingSettings) -> None:
        self.settings = settings

    def weight(self, entry: RouteEntry) -> int:
        weights = self.settings.weights
        if weights is not None:
            return weights.get(entry.instance_id, entry.weight)
        return entry.weight

    @abstractmethod
    def pick(
        self, snapshot: CapabilitySnapshot, tier: Sequence[RouteEntry], ctx: PickContext
    ) -> RouteEntry | None: ...


class RoundRobin(Strategy):
    """Each instance in turn. The turn is this process's (from a random start), so processes
    never move in step and no store round trip is needed; together they spread evenly."""

    name = "round_robin"

    def __init__(self, settings: RoutingSettings) -> None:
        super().__init__(settings)
        self._next = random.randrange(1 << 30)

    def pick(
        self, snapshot: CapabilitySnapshot, tier: Sequence[RouteEntry], ctx: PickContext
    ) -> RouteEntry | None:
        n = len(tier)
        blocked = ctx.blocked
        for step in range(n):
            entry = tier[(self._next + step) % n]
            if entry.instance_id not in blocked:
                self._next += step + 1
                return entry
        return None


class WeightedRoundRobin(Strategy):
    """Each instance its weight's share, spread out (nginx's smooth schedule; EDF over many).
    The schedule lives as long as the snapshot; a blocked instance's turn passes on."""

    name = "weighted_round_robin"

    def __init__(self, settings: RoutingSettings) -> None:
        super().__init__(settings)
        self._schedules: dict[str, tuple[int, Any, dict[str, RouteEntry], dict[str, int]]] = {}

    def pick(
        self, snapshot: CapabilitySnapshot, tier: Sequence[RouteEntry], ctx: PickContext
    ) -> RouteEntry | None:
        if not tier:
            return None
        held = self._schedules.get(ctx.tier)
        if held is None or held[0] != snapshot.version:
            weights = {e.instance_id: self.weight(e) for e in tier}
            if held is not None and held[3] == weights:
                # A new snapshot (a health change elsewhere) with the same instances and
                # weights: the schedule goes on where it was.
                held = (snapshot.version, held[1], {e.instance_id: e for e in tier}, weights)
            else:
                schedule = (
                    SmoothWeighted(weights)
                    if len(weights) <= SMOOTH_UP_TO
                    else EdfWeighted(weights)
                )
                # Each process from its own point of the cycle, so they never move in step.
                for _ in range(random.randrange(min(sum(weights.values()), 1000))):
                    schedule.pick()
                held = (snapshot.version, schedule, {e.instance_id: e for e in tier}, weights)
            self._schedules[ctx.tier] = held
        _, schedule, entries, _ = held
        blocked = ctx.blocked
        for _ in range(len(entries)):
            instance_id = schedule.pick()
            if instance_id not in blocked:
                return entries[instance_id]
        return next((e for e in tier if e.instance_id not in blocked), None)


class LeastRequest(Strategy):
    """The instance with the fewest requests in flight, shared by every process through the
    store, weighed by its recent latency (peak EWMA, Finagle's refinement) and its weight: the
    cost of an instance is (in flight + 1) x latency / weight. A stalled instance's calls end
    at the deadline and its count falls back to zero, but its latency stays high, so it is
    tried again only now and then. Exact over a few instances, the better of two random ones
    over many (Envoy's approach). Ties go round, not always to the first."""

    name = "least_request"
    uses_loads = True

    def __init__(self, settings: RoutingSettings) -> None:
        super().__init__(settings)
        self._turn = random.randrange(1 << 30)
        self._rng = random.Random()

    def _latencies(
        self, entries: Sequence[RouteEntry], ctx: PickContext, now: float
    ) -> list[float]:
        """Each entry's recent latency, with those within TIE of the fastest counted as the
        fastest: latencies wobble, and equals should share the traffic; a stalled instance
        (many times slower) keeps its own."""
        if ctx.latency is None:
            return [1.0] * len(entries)
        seen = [ctx.latency.of(e.instance_id, now) for e in entries]
        fastest = min(seen, default=1.0)
        return [fastest if lat < fastest * TIE else lat for lat in seen]

    def _costs(self, entries: Sequence[RouteEntry], ctx: PickContext) -> list[float]:
        latencies = self._latencies(entries, ctx, time.monotonic())
        return [
            (ctx.loads.get(e.instance_id, 0) + 1) * lat / self.weight(e)
            for e, lat in zip(entries, latencies, strict=True)
        ]

    def pick(
        self, snapshot: CapabilitySnapshot, tier: Sequence[RouteEntry], ctx: PickContext
    ) -> RouteEntry | None:
        n = len(tier)
        if n == 0:
            return None
        blocked = ctx.blocked
        if n > FULL_SCAN_UP_TO:
            draws: list[RouteEntry] = []
            for _ in range(SAMPLES):
                entry = tier[self._rng.randrange(n)]
                if entry not in draws and entry.instance_id not in blocked:
                    draws.append(entry)
                    if len(draws) == 2:
                        a, b = self._costs(draws, ctx)
                        return draws[1] if b < a else draws[0]
        open_ = [e for e in tier if e.instance_id not in blocked]
        if not open_:
            return None
        costs = self._costs(open_, ctx)
        best = min(costs)
        tied = [e for e, cost in zip(open_, costs, strict=True) if cost <= best]
        self._turn += 1
        return tied[self._turn % len(tied)]


class ConsistentHash(Strategy):
    """The same key to the same instance (a ring of virtual nodes, xxh3), with bounded load:
    an instance already at `balance_factor` times the mean in-flight load passes the key on
    clockwise. The ring is built from the routable instances and kept while they (and their
    weights) stay the same, so a health change or a blocked instance moves only the keys it
    held, and only while it lasts."""

    name = "consistent_hash"
    uses_key = True
    uses_loads = True

    def __init__(self, settings: RoutingSettings) -> None:
        super().__init__(settings)
        self._ring: HashRing | None = None
        self._members: tuple[tuple[str, int], ...] = ()
        self._building: tuple[tuple[tuple[str, int], ...], asyncio.Future[None]] | None = None
        self._built: HashRing | None = None  # what the thread building a ring handed over
        self._meanwhile = RoundRobin(settings)

    def ring(self, snapshot: CapabilitySnapshot) -> HashRing | None:
        """The ring of the snapshot's routable instances. A small one is built at once; a
        large one (about 0.1 s per 100,000 points) in a thread while the ring it replaces
        keeps serving (an instance gone from it is skipped, which is where its keys go
        anyway; a new one gets keys once the ring is built). None: none built yet."""
        ring = snapshot.cache.get(self.name)
        if isinstance(ring, HashRing):
            return ring
        waiting = snapshot.cache.get("ch:waiting")
        if waiting is not None and not waiting.done():
            return self._ring  # checked already for this snapshot: its ring is not ready
        members = snapshot.cache.get("ch:members")
        if members is None:
            members = snapshot.cache["ch:members"] = tuple(
                (i, self._weight_of(i, w)) for i, w in snapshot.members
            )
            if self._ring is not None and members == self._members:
                snapshot.cache[self.name] = self._ring
                return self._ring
        vnodes = ring_vnodes(self.settings.vnodes or 100, sum(w for _, w in members))
        if vnodes * sum(w for _, w in members) <= BUILD_INLINE_UP_TO:
            return self._use(snapshot, members, HashRing(dict(members), vnodes))
        # One build at a time, for the latest membership (compared by value: a snapshot
        # rebuilt for a health change has the same members and keeps the build going).
        building = self._building
        if building is not None and building[0] is not members and building[0] == members:
            # The same members in a newer snapshot: adopt it (later checks are `is`, O(1)).
            building = self._building = (members, building[1])
        if building is None or building[0] is not members:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no event loop (a script): build here
                return self._use(snapshot, members, HashRing(dict(members), vnodes))
            if building is not None and not building[1].done():
                # A build for older members is still running; this one starts after it.
                snapshot.cache["ch:waiting"] = building[1]
                return self._ring
            self._built = None  # an older build's ring, never installed
            building = self._building = (
                members,
                loop.run_in_executor(None, _build_ring, weakref.ref(self), dict(members), vnodes),
            )
        future = building[1]
        snapshot.cache["ch:waiting"] = future
        if future.done():
            self._building = None  # a failed build is tried again at the next pick
            built, self._built = self._built, None
            if future.exception() is None and built is not None:
                return self._use(snapshot, members, built)
        return self._ring

    def _use(
        self, snapshot: CapabilitySnapshot, members: tuple[tuple[str, int], ...], ring: HashRing
    ) -> HashRing:
        self._ring, self._members = ring, members
        snapshot.cache[self.name] = ring
        return ring

    def _weight_of(self, instance_id: str, weight: int) -> int:
        weights = self.settings.weights
        return weights.get(instance_id, weight) if weights is not None else weight

    def pick(
        self, snapshot: CapabilitySnapshot, tier: Sequence[RouteEntry], ctx: PickContext
    ) -> RouteEntry | None:
        if not tier or ctx.key is None:
            return None
        loads, blocked = ctx.loads, ctx.blocked
        # Bounded load: at most balance_factor x the mean, this request included.
        factor = self.settings.balance_factor or 1.25
        capacity = max(1, math.ceil(factor * (loads.total + 1) / snapshot.routable_size))
        ring = self.ring(snapshot)
        if ring is None:  # the first ring of a large capability is being built
            return self._meanwhile.pick(snapshot, tier, ctx)
        first: RouteEntry | None = None
        for instance_id in ring.walk(ctx.key):
            entry = snapshot.by_id.get(instance_id)
            if entry is None or entry.status != ctx.tier or instance_id in blocked:
                continue
            if loads.get(instance_id, 0) + 1 <= capacity:
                return entry
            first = first or entry
        return first


def _build_ring(owner: weakref.ref[ConsistentHash], weights: dict[str, int], vnodes: int) -> None:
    """In a thread: build a ring and hand it to its strategy if that is still there. Not
    returned: the future would hold it until the event loop next ran, whether or not its router
    was still there (a 10,000-instance ring, ~1.8 MB, outlived the router that asked for it)."""
    ring = HashRing(weights, vnodes)
    strategy = owner()
    if strategy is not None:
        strategy._built = ring


BUILT_IN: dict[str, type[Strategy]] = {
    s.name: s for s in (RoundRobin, WeightedRoundRobin, LeastRequest, ConsistentHash)
}

__all__ = [
    "BUILT_IN",
    "ConsistentHash",
    "LeastRequest",
    "PickContext",
    "RoundRobin",
    "Strategy",
    "WeightedRoundRobin",
]
