"""What routing reads of one capability: its instances' `RouteEntry`s and the immutable
`CapabilitySnapshot` of them that `reach.registry.view` keeps, built whole once and then
derived from the last one as a few instances change."""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from reach.registry import HealthStatus, OperationDeclaration, declared_policy

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
    instance, so a status change at 10,000 instances costs tens of microseconds, not
    milliseconds."""

    __slots__ = (
        "_declared",
        "_limits",
        "_members",
        "by_id",
        "cache",
        "capability",
        "degraded",
        "entries",
        "limited",
        "ok",
        "routable",
        "smallest",
        "version",
    )

    def __init__(self, capability: str, entries: Iterable[RouteEntry]) -> None:
        # Built whole: each pass is a comprehension or runs in C (10,000 instances ~1 ms).
        self.capability = capability
        self.version = next(_versions)
        self.entries: tuple[RouteEntry, ...] = tuple(sorted(entries, key=_by_id))
        self.by_id: dict[str, RouteEntry] = dict(
            zip(map(_by_id, self.entries), self.entries, strict=True)
        )
        self.routable = _same(
            tuple([e for e in self.entries if e.status != "unhealthy"]), self.entries
        )
        self.ok = _same(tuple([e for e in self.routable if e.status == "ok"]), self.routable)
        self.degraded = tuple([e for e in self.routable if e.status == "degraded"])
        self.smallest = min(self.routable, key=_by_size) if self.routable else None
        # Whether an instance declared a max_inflight (routing then reads in-flight counts).
        self._limits = len(self.routable) - list(map(_inflight_cap, self.routable)).count(None)
        self.limited = self._limits > 0
        self._members: tuple[tuple[str, int], ...] | None = None
        self._declared: dict[str, OperationDeclaration | None] = {}
        self.cache: dict[str, Any] = {}

    @property
    def members(self) -> tuple[tuple[str, int], ...]:
        """The routable instances and their weights: what a hash ring is built from."""
        if self._members is None:
            self._members = tuple((e.instance_id, e.weight) for e in self.routable)
        return self._members

    def changed(self, current: Mapping[str, RouteEntry | None]) -> CapabilitySnapshot:
        """The snapshot once the instances in `current` are as it says (None: gone); equal to
        one built from every instance."""
        new = object.__new__(CapabilitySnapshot)
        new.capability = self.capability
        new.version = next(_versions)
        new.entries = _edited(self.entries, current, _always)
        new.routable = _tier(self.routable, self.entries, new.entries, current, _routable)
        new.ok = _tier(self.ok, self.routable, new.routable, current, _ok)
        new.degraded = _edited(self.degraded, current, _degraded)
        by_id = dict(self.by_id)
        smallest = self.smallest
        recount = False
        for instance_id, entry in current.items():
            if entry is None:
                by_id.pop(instance_id, None)
            else:
                by_id[instance_id] = entry
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
        new.by_id = by_id
        if recount:
            smallest = min(new.routable, key=_by_size) if new.routable else None
        new.smallest = smallest
        limits = self._limits
        for instance_id, entry in current.items():
            limits -= _limits(self.by_id.get(instance_id))
            limits += _limits(entry)
        new._limits = limits
        new.limited = limits > 0
        new._members = None
        new._declared = {}
        new.cache = {}
        return new

    def declared(self, operation: str) -> OperationDeclaration | None:
        """What the routable instances together declare for `operation` (cached)."""
        try:
            return self._declared[operation]
        except KeyError:
            found = self._declared[operation] = declared_policy(self.routable, operation)
            return found


def _edited(
    tier: tuple[RouteEntry, ...],
    current: Mapping[str, RouteEntry | None],
    belongs: Callable[[RouteEntry], bool],
) -> tuple[RouteEntry, ...]:
    """A tier (sorted by id) with the changed instances put in, replaced or taken out."""
    out: list[RouteEntry] | None = None
    for instance_id, entry in current.items():
        held = out if out is not None else tier
        i = bisect.bisect_left(held, instance_id, key=_by_id)
        present = i < len(held) and held[i].instance_id == instance_id
        keep = entry is not None and belongs(entry)
        if not present and not keep:
            continue
        if out is None:
            out = list(tier)
        if keep:
            assert entry is not None
            if present:
                out[i] = entry
            else:
                out.insert(i, entry)
        else:
            del out[i]
    return tier if out is None else tuple(out)


def _same(tier: tuple[RouteEntry, ...], whole: tuple[RouteEntry, ...]) -> tuple[RouteEntry, ...]:
    """`whole` itself when the tier (a part of it, in its order) holds all of it: in the usual
    case (every instance ok) one tuple serves as entries, routable and ok. Each tuple of
    10,000 entries is walked by every collection of the cyclic collector while it is young,
    and a snapshot is made at each status change, so three of them were most of what the
    collector's young passes walked."""
    return whole if len(tier) == len(whole) else tier


def _tier(
    tier: tuple[RouteEntry, ...],
    whole: tuple[RouteEntry, ...],
    new_whole: tuple[RouteEntry, ...],
    current: Mapping[str, RouteEntry | None],
    belongs: Callable[[RouteEntry], bool],
) -> tuple[RouteEntry, ...]:
    """`_edited` for a tier of `whole` (now `new_whole`): the new whole itself when the tier was
    all of it and every changed instance still belongs (or is gone), else edited."""
    if tier is whole and all(e is None or belongs(e) for e in current.values()):
        return new_whole
    return _same(_edited(tier, current, belongs), new_whole)


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
