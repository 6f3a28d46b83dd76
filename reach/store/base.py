"""The store interface: grouped expiring records, and counters.

Why this shape rather than plain keys and sets: every registry race we have seen came from a
read in Python followed by a write in another round trip (a sweep pruning an instance that
re-joined in between, a heartbeat recreating what a leave deleted). So each registry step is
one store operation, atomic in both backends (a Lua script in Redis; no await inside a memory
operation), and the registry's logic stays written once over them:

- a *record* is a few named string fields with a TTL, belonging to one *group*;
- `put_record` replaces a record (moving it between groups), `update_record` changes some
  fields of a record that exists and never recreates one, `delete_record` removes it;
- a group's member index is pruned only of members whose record is gone (or now belongs to
  another group), re-checked at the moment of removal (`scan_group`);
- a group is *known* until `group_ttl_s` after the last put or update touching it, then
  `expire()` forgets its name.

Records and groups are generic (the registry's are instances and capabilities) so the policy
counters can use the same primitives later.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    from reach.store.redis import RedisLink

GROUP_FIELD = "_group"
"""Where a record keeps its group; reserved, not a caller field."""


@dataclass(frozen=True, slots=True)
class Record:
    # Slots: one allocation a record, where an instance dict's values were a second one (the
    # memory store makes a record anew at every heartbeat).
    group: str
    fields: dict[str, str]


@dataclass(frozen=True)
class GroupScan:
    """A group's live members, and the members just pruned because their record expired."""

    live: dict[str, Record] = field(default_factory=dict)
    evicted: list[str] = field(default_factory=list)


Listener = Callable[[str | None], None]
"""Called with each message on a channel, and with None when messages may have been missed
(a subscription that just (re)connected): the listener then reads whole what it keeps."""


class Subscription(ABC):
    @abstractmethod
    async def aclose(self) -> None: ...


def check_fields(fields: Mapping[str, str]) -> None:
    if GROUP_FIELD in fields:
        raise ValueError(f"record field name {GROUP_FIELD!r} is reserved for the store")


class Store(ABC):
    """Grouped expiring records and counters; every method is one atomic step."""

    backend: ClassVar[Literal["memory", "redis"]]
    """Which backend holds the data: `memory` (this process) or `redis` (shared)."""

    def shared_redis(self) -> RedisLink | None:
        """The Redis this store lives in, for state that must be shared as widely as the
        store is (policy counters, in-flight counts); None: the store is this process's
        alone, and so is that state. The one place a backend is told apart from another."""
        return None

    @abstractmethod
    async def put_record(
        self,
        record_id: str,
        group: str,
        fields: Mapping[str, str],
        *,
        ttl_s: float,
        group_ttl_s: float,
    ) -> Record | None:
        """Replace the record, move it to `group`'s index (out of its old group's), touch
        `group`. Returns the record it replaced, if any."""

    @abstractmethod
    async def update_record(
        self,
        record_id: str,
        fields: Mapping[str, str],
        *,
        ttl_s: float,
        group_ttl_s: float,
    ) -> Record | None:
        """If the record exists: set these fields (others untouched), refresh its TTL, re-add
        it to its group's index and touch the group. Returns the record as it was before, or
        None when there is none (and nothing is written)."""

    async def update_records(
        self,
        updates: Sequence[tuple[str, Mapping[str, str]]],
        *,
        ttl_s: float,
        group_ttl_s: float,
    ) -> list[Record | None]:
        """`update_record` for each `(record_id, fields)`, in one round trip where the backend
        has round trips (each update is still atomic on its own, not the batch)."""
        return [
            await self.update_record(i, fields, ttl_s=ttl_s, group_ttl_s=group_ttl_s)
            for i, fields in updates
        ]

    @abstractmethod
    async def delete_record(self, record_id: str) -> Record | None:
        """Remove the record and its index entry; returns what was removed."""

    @abstractmethod
    async def get_records(self, record_ids: Sequence[str]) -> list[Record | None]: ...

    @abstractmethod
    async def scan_group(self, group: str) -> GroupScan:
        """The group's live records; members without one are removed from the index."""

    async def prune_group(self, group: str) -> list[str]:
        """Remove from the group's index the members whose record is gone, and return those
        (what `scan_group` prunes, without reading the live records)."""
        return (await self.scan_group(group)).evicted

    async def prune_group_soonest(self, group: str) -> tuple[list[str], float | None]:
        """`prune_group`, and the seconds before the first of the group's live records can
        expire (inf: it has none that can; None: not known). Heartbeats only push a record's
        expiry back, so no member there now is gone sooner. This store does not know: None."""
        return await self.prune_group(group), None

    @abstractmethod
    async def group_known(self, group: str) -> bool: ...

    @abstractmethod
    async def groups(self) -> list[str]:
        """Known groups, in no particular order."""

    @abstractmethod
    async def expire(self) -> list[str]:
        """Forget the groups past their TTL (with their indexes) and drop whatever else has
        expired; returns the groups forgotten."""

    @abstractmethod
    async def incr(self, key: str, ttl_s: float | None = None) -> int:
        """Add one to a counter; with `ttl_s`, the counter is dropped after that long unused."""

    @abstractmethod
    async def publish(self, channel: str, message: str) -> None:
        """Send `message` to every subscriber of `channel` (at most once; none is kept)."""

    @abstractmethod
    async def subscribe(self, channel: str, listener: Listener) -> Subscription:
        """Call `listener` (in this event loop) with each message published on `channel`, and
        with None first and after every reconnection."""

    @abstractmethod
    async def hash_set(self, key: str, field: str, value: str) -> None:
        """Set one field of a long-lived hash (no TTL): small shared documents, e.g. tokens."""

    @abstractmethod
    async def hash_all(self, key: str) -> dict[str, str]:
        """Every field of a long-lived hash (empty when there is none)."""

    @abstractmethod
    async def hash_delete(self, key: str, field: str) -> str | None:
        """Remove one field of a long-lived hash; returns the value it held (None: none)."""

    async def ping(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
