"""What routing reads of one capability: its instances' `RouteEntry`s and the immutable
`CapabilitySnapshot` of them that `reach.registry.view` keeps, built whole once and then
derived from the last one as a few instances change."""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from reach.registry import HealthStatus, OperationDeclaration, declared_policy
from reach.registry.rows import ById, Rows

_versions = itertools.count(1)


@dataclass(frozen=True, slots=True)
class RouteEntry:
    """What routing and calling need of one instance."""

    instance_id: str
    capability: str
    protocol: str
    address: str
    max_message_bytes: int
    status: HealthStatus
    weight: int
    max_inflight: int | None
    joined_at: float
    declared: Mapping[str, OperationDeclaration]
    principal: str | None = None  # whose agent token registered it (None: auth off)
    # What discovery found of an instance registered by URL (empty for one that joined).
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def routable(self) -> bool:
        return self.status != "unhealthy"


class CapabilitySnapshot:
    """One capability's live instances at one moment (immutable; rebuilt when it changes).

    A few instances changed since the last one (a status change, a join, a leave): the next
    is derived from it (`changed`) by edits at the changed places, not rebuilt from every
    instance. Its tiers are `Rows` (`reach.registry.rows`): a derived snapshot copies only
    the chunks the changes fall in, and routing's flat tuple of a tier is made when a request
    first reads it, so a status change at 10,000 instances costs tens of microseconds and
    leaves no 10,000-entry container for the cyclic collector's young passes to walk."""

    __slots__ = (
        "_declared",
        "_degraded",
        "_entries",
        "_ids",
        "_limits",
        "_members",
        "_ok",
        "_routable",
        "by_id",
        "cache",
        "capability",
        "limited",
        "smallest",
        "version",
    )

    def __init__(self, capability: str, entries: Iterable[RouteEntry]) -> None:
        # Built whole: each pass is a comprehension or runs in C (10,000 instances ~1 ms).
        self.capability = capability
        self.version = next(_versions)
        whole = tuple(sorted(entries, key=_by_id))
        self._entries = Rows.of(whole)
        routable = tuple([e for e in whole if e.status != "unhealthy"])
        self._routable = _same(routable, self._entries)
        ok = tuple([e for e in routable if e.status == "ok"])
        self._ok = _same(ok, self._routable)
        self._degraded = Rows.of(tuple([e for e in routable if e.status == "degraded"]))
        self.by_id = ById(self._entries)
        self.smallest = min(routable, key=_by_size) if routable else None
        # Whether an instance declared a max_inflight (routing then reads in-flight counts).
        self._limits = len(routable) - list(map(_inflight_cap, routable)).count(None)
        self.limited = self._limits > 0
        self._members: tuple[tuple[str, int], ...] | None = None
        self._ids: frozenset[str] | None = None
        self._declared: dict[str, OperationDeclaration | None] = {}
        self.cache: dict[str, Any] = {}

    @property
    def entries(self) -> tuple[RouteEntry, ...]:
        """Every instance, sorted by id."""
        return self._entries.flat()

    @property
    def routable(self) -> tuple[RouteEntry, ...]:
        """The instances not unhealthy, sorted by id."""
        return self._routable.flat()

    @property
    def ok(self) -> tuple[RouteEntry, ...]:
        return self._ok.flat()

    @property
    def degraded(self) -> tuple[RouteEntry, ...]:
        return self._degraded.flat()

    @property
    def size(self) -> int:
        """How many instances (of every status): `len(entries)` without making the tuple."""
        return self._entries.size

    @property
    def routable_size(self) -> int:
        return self._routable.size

    @property
    def members(self) -> tuple[tuple[str, int], ...]:
        """The routable instances and their weights: what a hash ring is built from."""
        if self._members is None:
            self._members = tuple((e.instance_id, e.weight) for e in self._routable)
        return self._members

    @property
    def ids(self) -> frozenset[str]:
        """The routable instances' ids, built once a snapshot (every call's outcome names
        them: `reach.policy.breaker`)."""
        if self._ids is None:
            self._ids = frozenset(e.instance_id for e in self._routable)
        return self._ids

    def changed(self, current: Mapping[str, RouteEntry | None]) -> CapabilitySnapshot:
        """The snapshot once the instances in `current` are as it says (None: gone); equal to
        one built from every instance."""
        new = object.__new__(CapabilitySnapshot)
        new.capability = self.capability
        new.version = next(_versions)
        new._entries = self._entries.edited(current, _always)
        new._routable = _tier(self._routable, self._entries, new._entries, current, _routable)
        new._ok = _tier(self._ok, self._routable, new._routable, current, _ok)
        new._degraded = self._degraded.edited(current, _degraded)
        new.by_id = ById(new._entries)
        smallest = self.smallest
        recount = False
        for instance_id, entry in current.items():
            if smallest is not None and smallest.instance_id == instance_id:
                recount = True  # the smallest itself changed: look again
            elif (
                entry is not None
                and entry.routable
                and not recount
                and (
                    smallest is None
                    or (entry.max_message_bytes, instance_id)
                    < (smallest.max_message_bytes, smallest.instance_id)
                )
            ):
                smallest = entry
        if recount:
            smallest = min(new._routable, key=_by_size) if new._routable.size else None
        new.smallest = smallest
        limits = self._limits
        for instance_id, entry in current.items():
            limits -= _limits(self._entries.find(instance_id))
            limits += _limits(entry)
        new._limits = limits
        new.limited = limits > 0
        new._members = None
        new._ids = None
        new._declared = {}
        new.cache = {}
        return new

    def declared(self, operation: str) -> OperationDeclaration | None:
        """What the routable instances together declare for `operation` (cached)."""
        try:
            return self._declared[operation]
        except KeyError:
            found = self._declared[operation] = declared_policy(self._routable, operation)
            return found


def _same(tier: tuple[RouteEntry, ...], whole: Rows) -> Rows:
    """`whole` itself when the tier (a part of it, in its order) holds all of it: in the usual
    case (every instance ok) one set of rows serves as entries, routable and ok."""
    return whole if len(tier) == whole.size else Rows.of(tier)


def _tier(
    tier: Rows,
    whole: Rows,
    new_whole: Rows,
    current: Mapping[str, RouteEntry | None],
    belongs: Callable[[RouteEntry], bool],
) -> Rows:
    """`Rows.edited` for a tier of `whole` (now `new_whole`): the new whole itself when the
    tier was all of it and every changed instance still belongs (or is gone), else edited."""
    if tier is whole and all(e is None or belongs(e) for e in current.values()):
        return new_whole
    edited = tier.edited(current, belongs)
    return new_whole if edited.size == new_whole.size else edited


def _limits(entry: RouteEntry | None) -> int:
    """1 for a routable instance that declared a max_inflight."""
    return int(entry is not None and entry.routable and entry.max_inflight is not None)


def _always(entry: RouteEntry) -> bool:
    return True


def _routable(entry: RouteEntry) -> bool:
    return entry.routable


def _ok(entry: RouteEntry) -> bool:
    return entry.status == "ok"


def _degraded(entry: RouteEntry) -> bool:
    return entry.status == "degraded"


_by_id: Callable[[RouteEntry], str] = operator.attrgetter("instance_id")
_by_size: Callable[[RouteEntry], int] = operator.attrgetter("max_message_bytes")
_inflight_cap: Callable[[RouteEntry], int | None] = operator.attrgetter("max_inflight")


__all__ = ["CapabilitySnapshot", "RouteEntry"]
