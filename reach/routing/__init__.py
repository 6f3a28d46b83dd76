"""Routing: which instance of a capability takes a request (R5, R12, R17, R21, R22).

`Router.route` runs on the local registry view (`reach.registry.view`) and this process's
in-flight counts (`reach.routing.inflight`), with no store round trip. Per capability it uses
the strategy configured (`routing:` defaults, `capabilities.<name>.routing`), looked up among
the plug-ins of the entry-point group `agent_reach.routing` (round robin by default).

Every strategy gets the same load-aware bypass first (R17): an instance at its max_inflight is
never chosen (until it drains), a `degraded` one only when no `ok` one is left, an `unhealthy`
one never (R21). A retry avoids the instances this request already tried, and routing avoids
ejected outliers, each only while another instance is left. A consistent-hash request without
a key is routed by the fallback strategy, and its route says so.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any

import xxhash

from reach.config import ConfigError, ReachSettings, RoutingSettings
from reach.errors import NoInstance
from reach.registry.view import CapabilitySnapshot, RouteEntry
from reach.routing.inflight import InflightTracker, Loads
from reach.routing.strategies import BUILT_IN, PickContext, Strategy

ENTRY_POINT_GROUP = "agent_reach.routing"

log = logging.getLogger("reach.routing")

_NOTHING: frozenset[str] = frozenset()


def available() -> dict[str, type[Strategy]]:
    """Every strategy this process can use: the built-in ones and the installed plug-ins."""
    found: dict[str, type[Strategy]] = dict(BUILT_IN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILT_IN and ep.value.startswith("reach.routing."):
            continue
        try:
            cls = ep.load()
        except Exception as exc:
            log.warning("routing plug-in %s (%s) could not be loaded: %r", ep.name, ep.value, exc)
            continue
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            log.warning("routing plug-in %s (%s) is not a Strategy; ignored", ep.name, ep.value)
            continue
        found[ep.name] = cls
    return found


def check_routing(settings: ReachSettings) -> None:
    """Start-up check: every strategy named in the configuration exists (and a fallback
    needs no key)."""
    known = available()
    names = ", ".join(sorted(known))
    sections: list[tuple[str, RoutingSettings]] = [("routing", settings.routing)]
    sections += [
        (f"capabilities.{name}.routing", cap.routing)
        for name, cap in settings.capabilities.items()
        if cap.routing is not None
    ]
    for where, section in sections:
        for field_name in ("strategy", "fallback"):
            chosen = getattr(section, field_name)
            if chosen is None:
                continue
            if chosen not in known:
                raise ConfigError(
                    f"reach.{where}.{field_name}: unknown routing strategy {chosen!r}; "
                    f"known: {names}"
                )
            try:  # a plug-in may refuse settings it cannot work with: say so now
                known[chosen](
                    settings.routing.merged(None if section is settings.routing else section)
                )
            except Exception as exc:
                raise ConfigError(
                    f"reach.{where}.{field_name}: strategy {chosen!r} refused these settings: {exc}"
                ) from exc
            if field_name == "fallback" and known[chosen].uses_key:
                raise ConfigError(
                    f"reach.{where}.fallback: {chosen!r} needs a key itself; a fallback routes "
                    "requests that have none (round_robin, least_request, ...)"
                )


def hash_key(
    settings: RoutingSettings, payload: Mapping[str, Any], routing_key: str | None
) -> str | None:
    """What consistent hashing hashes for a request: the payload field named by `hash_on`
    (`payload.user_id`), else the caller's routing_key; None when the strategy hashes nothing
    or the request carries no key."""
    strategy = settings.strategy or "round_robin"
    if strategy != "consistent_hash" and not settings.hash_on:
        return None
    path = (settings.hash_on or "routing_key").split(".")
    if path[0] == "payload":
        value: Any = payload
        for part in path[1:]:
            value = value.get(part) if isinstance(value, Mapping) else None
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 5.0 is 5, as JSON means it
        if isinstance(value, str) and value:
            return _bounded(value)
        if value is not None and not isinstance(value, str):
            return _bounded(json.dumps(value, sort_keys=True, separators=(",", ":")))
    return routing_key or None


MAX_KEY_CHARS = 256  # as a routing_key; a longer payload field is hashed to fit


def _bounded(key: str) -> str:
    """The key as it is, or a digest of it when long: it travels in the workflow's input
    and every routing step, so a large payload field must not be copied there."""
    if len(key) <= MAX_KEY_CHARS:
        return key
    return "xxh3-128:" + xxhash.xxh3_128_hexdigest(key.encode("utf-8", "surrogatepass"))


@dataclass(slots=True)
class Route:
    """Where a request goes, and why."""

    entry: RouteEntry
    strategy: str
    note: str | None = None
    skipped: list[str] = field(default_factory=list)  # ejected instances passed over
    bypassed: list[str] = field(default_factory=list)  # instances at their max_inflight


class _Capability:
    """What the router keeps per capability: its settings and strategy instances."""

    __slots__ = ("fallback", "settings", "strategy", "uses_loads")

    def __init__(self, settings: RoutingSettings, known: Mapping[str, type[Strategy]]) -> None:
        self.settings = settings
        self.strategy = known[settings.strategy or "round_robin"](settings)
        self.fallback = known[settings.fallback or "round_robin"](settings)
        self.uses_loads = (
            self.strategy.uses_loads or self.fallback.uses_loads or bool(settings.max_inflight)
        )


class Router:
    def __init__(
        self,
        settings_for: Callable[[str], RoutingSettings],
        inflight: InflightTracker | None = None,
        strategies: Mapping[str, type[Strategy]] | None = None,
    ) -> None:
        self._settings_for = settings_for
        self.inflight = inflight or InflightTracker()
        self._known = dict(strategies) if strategies is not None else available()
        self._capabilities: dict[str, _Capability] = {}

    @classmethod
    def from_settings(
        cls, settings: ReachSettings, inflight: InflightTracker | None = None
    ) -> Router:
        check_routing(settings)
        return cls(settings.routing_for, inflight)

    def reconfigure(self, settings_for: Callable[[str], RoutingSettings]) -> None:
        """Routing settings changed (a reload): each capability's strategy is built again from
        them at its next route; in-flight counts are kept."""
        self._settings_for = settings_for
        self._capabilities = {}

    def _capability(self, capability: str) -> _Capability:
        cap = self._capabilities.get(capability)
        if cap is None:
            cap = self._capabilities[capability] = _Capability(
                self._settings_for(capability), self._known
            )
        return cap

    def reads_loads(self, snapshot: CapabilitySnapshot) -> bool:
        """Whether routing this snapshot reads in-flight counts."""
        return self._capability(snapshot.capability).uses_loads or snapshot.limited

    def route(
        self,
        snapshot: CapabilitySnapshot,
        *,
        exclude: Collection[str] = _NOTHING,
        ejected: Collection[str] = _NOTHING,
        key: str | None = None,
        reserve: str | None = None,
    ) -> Route:
        """Choose an instance of `snapshot`; `reserve` counts the pick as in flight here until
        the call under that key begins. Raises NoInstance when none can take it."""
        capability = snapshot.capability
        cap = self._capability(capability)
        uses_loads = cap.uses_loads or snapshot.limited
        loads = self.inflight.loads(capability) if uses_loads else _NO_LOADS
        strategy, note = cap.strategy, None
        if strategy.uses_key and key is None:
            strategy = cap.fallback
            hash_on = cap.settings.hash_on or "routing_key"
            note = f"no hash key ({hash_on}): routed by {strategy.name}"
        exclude = set(exclude) & snapshot.by_id.keys() if exclude else _NOTHING
        ejected = set(ejected) & snapshot.by_id.keys() if ejected else _NOTHING
        # An instance at its max_inflight is found when a strategy meets it (one lookup),
        # never by a scan of every busy instance.
        full = _Full(self._limits(cap, snapshot), cap.settings.max_inflight, loads)
        # Most avoided first, then less: a retry prefers a fresh instance to an ejected one,
        # and an ejected one to the one it just tried; a full instance is never chosen.
        levels: list[frozenset[str]] = []
        for avoid in (exclude | ejected, exclude, ejected, _NOTHING):
            if avoid not in levels:
                levels.append(frozenset(avoid))
        ctx = PickContext(
            tier="ok",
            key=key,
            loads=loads if strategy.uses_loads else _NO_LOADS,
            latency=self.inflight.latency(capability) if strategy.uses_loads else None,
        )
        if ctx.latency is not None and len(ctx.latency) > 2 * snapshot.size + 16:
            ctx.latency.forget(snapshot.by_id)  # instances that left are not remembered
        for avoid in levels:
            ctx.blocked = _Blocked(avoid, full)
            for tier_name, tier in (("ok", snapshot.ok), ("degraded", snapshot.degraded)):
                ctx.tier = tier_name
                entry = strategy.pick(snapshot, tier, ctx)
                if entry is None:
                    continue
                if tier_name == "degraded" and snapshot.ok:
                    note = _join(note, "no ok instance could take it: routed to a degraded one")
                elif tier_name == "degraded":
                    note = _join(note, "every instance is degraded")
                if reserve is not None and uses_loads:
                    self.inflight.reserve(capability, entry.instance_id, reserve)
                return Route(
                    entry=entry,
                    strategy=strategy.name,
                    note=note,
                    skipped=sorted(ejected - {entry.instance_id}),
                    bypassed=sorted(full.met),
                )
        if full.met:
            raise NoInstance(
                f"every routable instance of capability {capability!r} is at its max_inflight "
                f"({len(full.met)} of {snapshot.routable_size}); try again when they drain",
                retry_after_s=1,
            )
        raise NoInstance(f"capability {capability!r} has no healthy instance")

    @staticmethod
    def _limits(cap: _Capability, snapshot: CapabilitySnapshot) -> Mapping[str, int]:
        """The routable instances that declared a max_inflight of their own, with it (per
        snapshot; only routable ones are picked, and most snapshots have none to look for)."""
        found = snapshot.cache.get("router:limits")
        if found is None:
            found = snapshot.cache["router:limits"] = (
                {e.instance_id: e.max_inflight for e in snapshot.routable if e.max_inflight}
                if snapshot.limited
                else {}
            )
        assert isinstance(found, dict)
        return found


class _Full:
    """Whether an instance is at its max_inflight (the smaller of its own and the
    configured one), remembering the ones met for the route's record."""

    __slots__ = ("configured", "limits", "loads", "met")

    def __init__(self, limits: Mapping[str, int], configured: int | None, loads: Loads) -> None:
        self.limits = limits
        self.configured = configured
        self.loads = loads
        self.met: set[str] = set()

    def __call__(self, instance_id: str) -> bool:
        limit = self.limits.get(instance_id)
        if self.configured is not None and (limit is None or self.configured < limit):
            limit = self.configured
        if limit is None or self.loads.get(instance_id, 0) < limit:
            return False
        self.met.add(instance_id)
        return True


class _Blocked:
    """What a strategy must pass over: the instances this level avoids, and the full ones."""

    __slots__ = ("avoid", "full")

    def __init__(self, avoid: frozenset[str], full: _Full) -> None:
        self.avoid = avoid
        self.full = full

    def __contains__(self, instance_id: object) -> bool:
        return instance_id in self.avoid or self.full(str(instance_id))


_NO_LOADS = Loads({}, {}, 0)


def _join(a: str | None, b: str) -> str:
    return f"{a}; {b}" if a else b


__all__ = [
    "ENTRY_POINT_GROUP",
    "Route",
    "Router",
    "Strategy",
    "available",
    "check_routing",
    "hash_key",
]
