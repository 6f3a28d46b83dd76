"""The built-in routing strategies (R12, R17, R22), each a plug-in of the entry-point group
`agent_reach.routing` like any other.

A strategy instance serves one capability in one process. `pick` chooses among one *tier* of a
capability's snapshot (its `ok` instances, or its `degraded` ones) and must never return an
instance in `ctx.blocked` (tried already by this request, ejected, or at its max_inflight);
None means every instance of the tier is blocked. It runs synchronously, on data in memory:
no store round trip, microseconds at 10,000 instances (`bench/routing.py`).
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from reach.config import RoutingSettings
from reach.registry.view import CapabilitySnapshot, RouteEntry
from reach.routing.algorithms import (
    FULL_SCAN_UP_TO,
    EdfWeighted,
    HashRing,
    SmoothWeighted,
    bounded_capacity,
)

SMOOTH_UP_TO = 64  # larger sets: EDF on a heap instead of nginx's scan
SAMPLES = 8  # random draws before a strategy falls back to scanning the tier


@dataclass(slots=True)
class PickContext:
    tier: str  # "ok" | "degraded"
    blocked: Container[str] = frozenset()
    key: str | None = None
    loads: Mapping[str, int] = field(default_factory=dict)


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
        self._schedules: dict[str, tuple[int, Any, dict[str, RouteEntry]]] = {}

    def pick(
        self, snapshot: CapabilitySnapshot, tier: Sequence[RouteEntry], ctx: PickContext
    ) -> RouteEntry | None:
        if not tier:
            return None
        held = self._schedules.get(ctx.tier)
        if held is None or held[0] != snapshot.version:
            weights = {e.instance_id: self.weight(e) for e in tier}
            schedule = (
                SmoothWeighted(weights) if len(weights) <= SMOOTH_UP_TO else EdfWeighted(weights)
            )
            held = (snapshot.version, schedule, {e.instance_id: e for e in tier})
            self._schedules[ctx.tier] = held
        _, schedule, entries = held
        blocked = ctx.blocked
        for _ in range(len(entries)):
            instance_id = schedule.pick()
            if instance_id not in blocked:
                return entries[instance_id]
        return next((e for e in tier if e.instance_id not in blocked), None)


class LeastRequest(Strategy):
    """The instance with the fewest requests in flight (per unit of weight), shared by every
    process through the store: exact over a few instances, the better of two random ones over
    many (Envoy's approach). Ties go round, not always to the first."""

    name = "least_request"
    uses_loads = True

    def __init__(self, settings: RoutingSettings) -> None:
        super().__init__(settings)
        self._turn = random.randrange(1 << 30)
        self._rng = random.Random()

    def _better(self, a: RouteEntry, b: RouteEntry, loads: Mapping[str, int]) -> bool:
        """Whether `a` is less loaded than `b` for its weight (strictly)."""
        la, lb = loads.get(a.instance_id, 0) + 1, loads.get(b.instance_id, 0) + 1
        return la * self.weight(b) < lb * self.weight(a)

    def pick(
        self, snapshot: CapabilitySnapshot, tier: Sequence[RouteEntry], ctx: PickContext
    ) -> RouteEntry | None:
        n = len(tier)
        if n == 0:
            return None
        blocked, loads = ctx.blocked, ctx.loads
        if n > FULL_SCAN_UP_TO:
            draws: list[RouteEntry] = []
            for _ in range(SAMPLES):
                entry = tier[self._rng.randrange(n)]
                if entry.instance_id not in blocked and entry not in draws:
                    draws.append(entry)
                    if len(draws) == 2:
                        a, b = draws
                        return b if self._better(b, a, loads) else a
        tied: list[RouteEntry] = []
        for entry in tier:
            if entry.instance_id in blocked:
                continue
            if not tied or self._better(entry, tied[0], loads):
                tied = [entry]
            elif not self._better(tied[0], entry, loads):
                tied.append(entry)
        if not tied:
            return None
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

    def ring(self, snapshot: CapabilitySnapshot) -> HashRing:
        ring = snapshot.cache.get(self.name)
        if ring is None:
            members = tuple((i, self._weight_of(i, w)) for i, w in snapshot.members)
            if self._ring is None or members != self._members:
                self._ring = HashRing(dict(members), self.settings.vnodes or 100)
                self._members = members
            ring = snapshot.cache[self.name] = self._ring
        assert isinstance(ring, HashRing)
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
        capacity = bounded_capacity(
            loads, len(snapshot.routable), self.settings.balance_factor or 1.25, snapshot.by_id
        )
        first: RouteEntry | None = None
        for instance_id in self.ring(snapshot).walk(ctx.key):
            entry = snapshot.by_id.get(instance_id)
            if entry is None or entry.status != ctx.tier or instance_id in blocked:
                continue
            if loads.get(instance_id, 0) + 1 <= capacity:
                return entry
            first = first or entry
        return first


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
