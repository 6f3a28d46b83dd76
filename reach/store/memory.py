from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence

from reach.store.base import GroupScan, Listener, Record, Store, Subscription, check_fields


class _MemorySubscription(Subscription):
    def __init__(self, listeners: list[Listener], listener: Listener) -> None:
        self._listeners = listeners
        self._listener = listener

    async def aclose(self) -> None:
        if self._listener in self._listeners:
            self._listeners.remove(self._listener)


SCAN_PAGE = 200
"""Members a scan or prune of a group (or records an `expire`) checks before it lets the event
loop go (a group of 10,000 read at once held it for 4 ms and more; pages of 500, ~0.5 ms)."""

# What the cyclic collector walks here: one `Record` per record (its fields dict holds only
# strings, so CPython never tracks it) and the expiry times apart, in a dict of floats it does
# not track either. A (Record, expiry) pair per record was a second tracked object, made anew
# by every heartbeat. The scans' copies of a group's ids are tuples of strings, which the
# collector stops tracking the first time it looks at them (a list it walks every time).


class MemoryStore(Store):
    """One process only. Every method is atomic because none awaits: asyncio cannot switch
    tasks in the middle of one. The exceptions are the scans of a large group (`scan_group`,
    `prune_group`), which let the loop go every `SCAN_PAGE` members, as Redis's are not one
    step either: each member's check and removal still is one, so a member that re-joined in
    between is never pruned. Expired entries are dropped when read and by `expire()`, so
    memory stays bounded even for records nobody reads again."""

    backend = "memory"

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._records: dict[str, Record] = {}
        self._expires: dict[str, float] = {}  # by record id, the same keys as `_records`
        self._members: dict[str, set[str]] = {}
        self._group_expiry: dict[str, float] = {}
        self._counters: dict[str, tuple[int, float | None]] = {}
        self._channels: dict[str, list[Listener]] = {}
        self._hashes: dict[str, dict[str, str]] = {}

    def _live(self, record_id: str) -> Record | None:
        record = self._records.get(record_id)
        if record is None:
            return None
        if self._clock() >= self._expires[record_id]:
            self._drop(record_id)
            return None
        return record

    def _drop(self, record_id: str) -> None:
        del self._records[record_id]
        del self._expires[record_id]

    def _touch(self, record_id: str, group: str, group_ttl_s: float) -> None:
        self._members.setdefault(group, set()).add(record_id)
        self._group_expiry[group] = self._clock() + group_ttl_s

    def _unindex(self, group: str, record_id: str) -> bool:
        members = self._members.get(group)
        if members is None or record_id not in members:
            return False
        members.discard(record_id)
        if not members:
            del self._members[group]
        return True

    async def put_record(
        self,
        record_id: str,
        group: str,
        fields: Mapping[str, str],
        *,
        ttl_s: float,
        group_ttl_s: float,
    ) -> Record | None:
        check_fields(fields)
        previous = self._live(record_id)
        if previous is not None and previous.group != group:
            self._unindex(previous.group, record_id)
        self._records[record_id] = Record(group, dict(fields))
        self._expires[record_id] = self._clock() + ttl_s
        self._touch(record_id, group, group_ttl_s)
        return previous

    async def update_record(
        self,
        record_id: str,
        fields: Mapping[str, str],
        *,
        ttl_s: float,
        group_ttl_s: float,
    ) -> Record | None:
        check_fields(fields)
        return self._update(record_id, fields, self._clock(), ttl_s, group_ttl_s)

    async def update_records(
        self,
        updates: Sequence[tuple[str, Mapping[str, str]]],
        *,
        ttl_s: float,
        group_ttl_s: float,
    ) -> list[Record | None]:
        for _, fields in updates:
            check_fields(fields)
        now = self._clock()
        return [self._update(i, fields, now, ttl_s, group_ttl_s) for i, fields in updates]

    def _update(
        self,
        record_id: str,
        fields: Mapping[str, str],
        now: float,
        ttl_s: float,
        group_ttl_s: float,
    ) -> Record | None:
        previous = self._records.get(record_id)
        if previous is None:
            return None
        if now >= self._expires[record_id]:
            self._drop(record_id)
            return None
        group = previous.group
        self._records[record_id] = Record(group, {**previous.fields, **fields})
        self._expires[record_id] = now + ttl_s
        members = self._members.get(group)
        if members is None:
            members = self._members[group] = set()
        members.add(record_id)
        self._group_expiry[group] = now + group_ttl_s
        return previous

    async def delete_record(self, record_id: str) -> Record | None:
        previous = self._live(record_id)
        if previous is None:
            return None
        self._drop(record_id)
        self._unindex(previous.group, record_id)
        return previous

    async def get_records(self, record_ids: Sequence[str]) -> list[Record | None]:
        return [self._live(i) for i in record_ids]

    async def scan_group(self, group: str) -> GroupScan:
        scan = GroupScan()
        members = tuple(self._members.get(group, ()))
        for start in range(0, len(members), SCAN_PAGE):
            if start:
                await asyncio.sleep(0)
            for record_id in members[start : start + SCAN_PAGE]:
                record = self._live(record_id)
                if record is not None and record.group == group:
                    scan.live[record_id] = record
                    continue
                if self._unindex(group, record_id) and record is None:
                    scan.evicted.append(record_id)
        return scan

    async def prune_group(self, group: str) -> list[str]:
        evicted: list[str] = []
        members = tuple(self._members.get(group, ()))
        now = self._clock()
        for start in range(0, len(members), SCAN_PAGE):
            if start:
                await asyncio.sleep(0)
                now = self._clock()
            for record_id in members[start : start + SCAN_PAGE]:
                item = self._records.get(record_id)
                if item is not None and item.group == group and now < self._expires[record_id]:
                    continue
                record = self._live(record_id)
                if record is not None and record.group == group:
                    continue
                if self._unindex(group, record_id) and record is None:
                    evicted.append(record_id)
        return evicted

    async def group_known(self, group: str) -> bool:
        expires = self._group_expiry.get(group)
        return expires is not None and self._clock() < expires

    async def groups(self) -> list[str]:
        now = self._clock()
        return [g for g, expires in self._group_expiry.items() if now < expires]

    async def expire(self) -> list[str]:
        # Paged (every record is looked at: 10,000 at once held the loop ~3 ms); each record's
        # check and removal is one step, so one refreshed in between is not removed.
        ids = tuple(self._expires)
        for start in range(0, len(ids), 4 * SCAN_PAGE):
            if start:
                await asyncio.sleep(0)
            now = self._clock()
            for record_id in ids[start : start + 4 * SCAN_PAGE]:
                expires = self._expires.get(record_id)
                if expires is not None and now >= expires:
                    self._drop(record_id)
        now = self._clock()
        for key in [k for k, (_, expires) in self._counters.items() if _past(expires, now)]:
            del self._counters[key]
        forgotten = [g for g, expires in self._group_expiry.items() if now >= expires]
        for group in forgotten:
            del self._group_expiry[group]
            self._members.pop(group, None)
        return forgotten

    async def hash_set(self, key: str, field: str, value: str) -> None:
        self._hashes.setdefault(key, {})[field] = value

    async def hash_all(self, key: str) -> dict[str, str]:
        return dict(self._hashes.get(key, {}))

    async def hash_delete(self, key: str, field: str) -> str | None:
        return self._hashes.get(key, {}).pop(field, None)

    async def publish(self, channel: str, message: str) -> None:
        for listener in list(self._channels.get(channel, ())):
            listener(message)

    async def subscribe(self, channel: str, listener: Listener) -> Subscription:
        listeners = self._channels.setdefault(channel, [])
        listeners.append(listener)
        listener(None)
        return _MemorySubscription(listeners, listener)

    async def incr(self, key: str, ttl_s: float | None = None) -> int:
        now = self._clock()
        value, expires = self._counters.get(key, (0, None))
        if _past(expires, now):
            value = 0
        expires = now + ttl_s if ttl_s is not None else None
        self._counters[key] = (value + 1, expires)
        return value + 1


def _past(expires: float | None, now: float) -> bool:
    return expires is not None and now >= expires
