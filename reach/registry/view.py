"""A local view of the registry in each gateway and worker, for routing without a store round
trip (R5, R12, R17, R21).

The store stays the truth; the view is what this process last read of it, kept fresh by:

- change events: every join, leave, health status change and eviction is announced on the
  store's `registry` channel (Redis pub/sub; in process for the memory store) as
  `<capability>\\t<instance_id>`. The view does not trust an event's order: it marks that
  record dirty and re-reads it, so whatever order events arrive in, the view ends at what the
  store holds. A change made through this process's own registry is marked before the call
  returns, and a capability with dirty records is re-read before it is routed
  (read-your-writes: a join answered here is routable here at once);
- a resync that re-reads everything every `resync_s`, and at once whenever the subscription
  (re)connects, for events missed while it was away;
- a sweep tick every `sweep_s` that prunes instances whose record expired and announces each
  eviction (only the process whose prune removed it announces it), going to the store only
  when a record can have expired since its last prune (`reach.registry.sweeps`).

What routing needs of an instance is kept in a slim `RouteEntry` (no checks, no labels), and
identical operation declarations are shared, so an instance costs a few hundred bytes here.
`CapabilitySnapshot` (`reach.registry.snapshot`) is an immutable picture of one capability,
replaced only when it changed, that precomputes what every request would otherwise scan for
(the routable tiers, the smallest negotiated message size, the declared policy per operation);
strategies cache their own structures on it (`cache`). A few instances changed: the next is
derived from the last one; many: built whole, at the end of a resync rather than on a request.

No step holds the event loop long at 10,000 instances: a resync lets it go every
`RESYNC_SLICE_S`, the memory store's scans every few hundred members, and a status change
costs a derived snapshot (tens of microseconds), not a rebuild.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from reach.errors import ReachError
from reach.registry import (
    CHANGES_CHANNEL,
    InstanceRecord,
    OperationDeclaration,
    Registry,
)
from reach.registry.snapshot import CapabilitySnapshot, RouteEntry
from reach.registry.sweeps import SweepPlan
from reach.store.base import Record, Subscription

log = logging.getLogger("reach.registry.view")

RESYNC_SLICE_S = 0.0003
"""How long a resync works before it lets the event loop go: short, since the views, sweeps
and requests of one process that are ready together all run before a timer is looked at (at
1 ms, three views' slices and a sweep held a 1 ms timer 5-7 ms at 10,000 instances)."""

BASE_EDITS = 64
"""Changed instances past which (and past an eighth of the capability) a snapshot is built
again whole rather than derived from the last one."""


class _Interned:
    """Identical values shared between entries: most instances of a capability declare the
    same operations and speak the same protocol."""

    def __init__(self) -> None:
        self._declared: dict[tuple[Any, ...], Mapping[str, OperationDeclaration]] = {}
        self._strings: dict[str, str] = {}

    def string(self, value: str) -> str:
        return self._strings.setdefault(value, value)

    def declared(
        self, declared: Mapping[str, OperationDeclaration]
    ) -> Mapping[str, OperationDeclaration]:
        if not declared:
            return _NONE_DECLARED
        key = tuple(sorted((n, d.idempotent, d.timeout_ms) for n, d in declared.items()))
        return self._declared.setdefault(key, dict(declared))

    def entry(self, record: InstanceRecord) -> RouteEntry:
        return RouteEntry(
            instance_id=record.instance_id,
            capability=self.string(record.capability),
            protocol=self.string(record.protocol),
            address=record.address,
            max_message_bytes=record.max_message_bytes,
            status=record.status,
            weight=record.weight,
            max_inflight=record.max_inflight,
            joined_at=record.joined_at,
            declared=self.declared(record.declared),
            principal=record.principal,
            details=record.details or _NO_DETAILS,
        )


_NONE_DECLARED: Mapping[str, OperationDeclaration] = {}
_NO_DETAILS: Mapping[str, Any] = {}


class RegistryView:
    """This process's picture of the registry; see the module docstring."""

    def __init__(
        self,
        registry: Registry,
        *,
        resync_s: float = 5.0,
        sweep_s: float | None = 1.0,
    ) -> None:
        self.registry = registry
        self.resync_s = resync_s
        self.sweep_s = sweep_s
        self._members: dict[str, dict[str, RouteEntry]] = {}
        self._where: dict[str, str] = {}  # instance id -> its capability here
        self._snapshots: dict[str, CapabilitySnapshot] = {}
        # A capability's last snapshot and the instances changed since, while it has none:
        # the next is derived from it (`CapabilitySnapshot.changed`) when few changed.
        self._bases: dict[str, tuple[CapabilitySnapshot, set[str]]] = {}
        self._dirty: dict[str, str] = {}  # instance id -> a capability it may concern
        self._dirty_caps: dict[str, int] = {}
        self._interned = _Interned()
        self._seen: dict[str, tuple[int, str]] = {}  # fingerprints of what was parsed
        self._lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._resync_due = True
        self._subscription: Subscription | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.last_resync: float = 0.0
        self._started = False
        self._removed: list[Callable[[str, str], None]] = []
        registry.on_change(self.changed)

    def on_removed(self, listener: Callable[[str, str], None]) -> None:
        """Call `listener(capability, instance_id)` when an instance leaves this view's picture
        of a capability (it left, was evicted, expired, or joined another capability), whichever
        process saw it go: what is kept per instance elsewhere can be dropped with it."""
        self._removed.append(listener)

    async def start(self) -> None:
        """Read the registry whole, then follow it (events, resyncs, sweeps). A store that is
        away does not stop the process: the view reads it whole once it answers (until then,
        routing reads the store and gets its 503)."""
        try:
            await self.resync()
        except ReachError as exc:
            log.warning("registry view starts empty: %s (read again when the store answers)", exc)
            self._resync_due = True
        self._started = True
        with contextlib.suppress(ReachError):
            self._subscription = await self.registry.store.subscribe(
                CHANGES_CHANNEL, self._on_message
            )
        self._tasks = [asyncio.create_task(self._follow(), name="registry view")]
        if self.sweep_s is not None:
            self._tasks.append(asyncio.create_task(self._sweep(), name="registry sweep"))

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._subscription is not None:
            await self._subscription.aclose()

    # -- reading ---------------------------------------------------------------------------

    async def snapshot(self, capability: str) -> CapabilitySnapshot | None:
        """The capability as this process sees it (None: no live instance here). Records
        changed since they were read are re-read first. A view that was not started follows
        nothing: it reads the capability from the store each time."""
        if not self._started:
            return await self.reload(capability)
        if capability in self._dirty_caps:
            await self._flush()
        return self.cached(capability)

    def settled(self, capability: str) -> bool:
        """Whether the view holds the capability with no record changed since it was read."""
        return self._started and capability not in self._dirty_caps

    def cached(self, capability: str) -> CapabilitySnapshot | None:
        """The snapshot as it is, without re-reading anything."""
        snap = self._snapshots.get(capability)
        if snap is not None:
            return snap
        members = self._members.get(capability)
        if not members:
            return None
        base = self._bases.pop(capability, None)
        if base is not None:
            snap = base[0].changed({i: members.get(i) for i in base[1]})
        else:
            snap = CapabilitySnapshot(capability, members.values())
        self._snapshots[capability] = snap
        return snap

    def _outdate(self, capability: str, instance_id: str) -> None:
        """The capability's snapshot no longer holds: `instance_id` changed in it."""
        snap = self._snapshots.pop(capability, None)
        if snap is not None:
            self._bases[capability] = (snap, {instance_id})
            return
        base = self._bases.get(capability)
        if base is not None:
            base[1].add(instance_id)
            if len(base[1]) > max(BASE_EDITS, base[0].size // 8):
                del self._bases[capability]  # so many changed: built again whole

    async def reload(self, capability: str) -> CapabilitySnapshot | None:
        """Read the capability from the store now (used when the view has nothing routable
        to offer: another process may have just seen a join this one has not heard of)."""
        async with self._lock:
            self._replace(capability, await self.registry.scan(capability))
        return self.cached(capability)

    async def known(self, capability: str) -> bool:
        """Whether any agent registered the capability (the view when it has instances; the
        store otherwise, which also remembers capabilities whose instances all left)."""
        if self._members.get(capability):
            return True
        return await self.registry.known(capability)

    # -- following ------------------------------------------------------------------------

    def changed(self, capability: str, instance_id: str) -> None:
        """The record of `instance_id` (of `capability`, or moving out of it) changed."""
        self._dirty[instance_id] = capability
        self._dirty_caps[capability] = self._dirty_caps.get(capability, 0) + 1
        known_as = self._where.get(instance_id)
        if known_as is not None and known_as != capability:
            self._dirty_caps[known_as] = self._dirty_caps.get(known_as, 0) + 1
        self._wake.set()

    def _on_message(self, message: str | None) -> None:
        if message is None:
            self._resync_due = True
            self._wake.set()
            return
        capability, sep, instance_id = message.partition("\t")
        if sep and capability and instance_id:
            self.changed(capability, instance_id)

    async def _follow(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.resync_s):
                    await self._wake.wait()
            self._wake.clear()
            try:
                if self._resync_due or time.monotonic() - self.last_resync >= self.resync_s:
                    await self.resync()
                if self._dirty:
                    await self._flush()
            except ReachError as exc:
                log.warning("registry view not refreshed: %s", exc)
                await asyncio.sleep(min(1.0, self.resync_s))
                self._wake.set()
            except Exception:
                log.exception("registry view refresh failed")
                await asyncio.sleep(min(1.0, self.resync_s))

    async def _sweep(self) -> None:
        assert self.sweep_s is not None
        # Each tick runs only the store steps due (reach/registry/sweeps.py).
        plan = SweepPlan(self.registry.settings.heartbeat_timeout)
        while True:
            await asyncio.sleep(self.sweep_s)
            try:
                await self.registry.sweep(plan)
            except ReachError as exc:
                log.warning("registry sweep skipped: %s", exc)
            except Exception:
                log.exception("registry sweep failed")

    async def _flush(self) -> None:
        """Re-read the dirty records (one pipelined read) and apply what the store says."""
        async with self._lock:
            if not self._dirty:
                return
            dirty, self._dirty = self._dirty, {}
            caps, self._dirty_caps = self._dirty_caps, {}
            try:
                records = await self.registry.get_many(list(dirty))
            except BaseException:
                # Not read: still dirty (a later flush or resync tries again).
                for instance_id, capability in dirty.items():
                    self._dirty.setdefault(instance_id, capability)
                for capability, n in caps.items():
                    self._dirty_caps[capability] = self._dirty_caps.get(capability, 0) + n
                raise
            for instance_id, record in zip(dirty, records, strict=True):
                self._seen.pop(instance_id, None)
                self._set(instance_id, record)

    async def resync(self) -> None:
        """Re-read every capability whole, then build the snapshots it left to be built whole
        (one capability at a time, the loop let go in between), so no request waits on one."""
        async with self._lock:
            self._resync_due = False
            capabilities = await self.registry.capabilities()
            for capability in capabilities:
                await self._replace_paged(capability, await self.registry.scan(capability))
            for capability in set(self._members) - set(capabilities):
                self._replace(capability, {})
            self.last_resync = time.monotonic()
        for capability in list(self._members):
            if capability not in self._snapshots and capability not in self._bases:
                self.cached(capability)
                await asyncio.sleep(0)

    # -- applying -------------------------------------------------------------------------

    def _set(self, instance_id: str, record: InstanceRecord | None) -> None:
        old_cap = self._where.get(instance_id)
        if old_cap is not None and (record is None or record.capability != old_cap):
            self._members[old_cap].pop(instance_id, None)
            self._outdate(old_cap, instance_id)
            del self._where[instance_id]
            self._seen.pop(instance_id, None)
            for listener in self._removed:
                try:
                    listener(old_cap, instance_id)
                except Exception:  # a listener's bug must not leave the view half-applied
                    log.exception("registry view: removal listener failed")
        if record is None:
            return
        entry = self._interned.entry(record)
        members = self._members.setdefault(record.capability, {})
        if members.get(instance_id) != entry:
            members[instance_id] = entry
            self._outdate(record.capability, instance_id)
        self._where[instance_id] = record.capability

    async def _replace_paged(self, capability: str, live: Mapping[str, Record]) -> None:
        """`_replace`, a slice of `RESYNC_SLICE_S` at a time with the loop let go in between: a
        resync of 10,000 instances would otherwise hold it for a hundred milliseconds and more.
        The clock is read after every record (a few records parsed whole can take a
        millisecond). Routing meanwhile reads each instance as it was or as it is, never a
        made-up one."""
        clock = time.perf_counter
        slice_ends = clock() + RESYNC_SLICE_S
        # A tuple of strings: the cyclic collector stops tracking it when it first sees it.
        for instance_id in tuple(self._members.get(capability, ())):
            if instance_id not in live:
                self._set(instance_id, None)
                if clock() >= slice_ends:
                    await asyncio.sleep(0)
                    slice_ends = clock() + RESYNC_SLICE_S
        for instance_id, stored in live.items():
            self._apply_one(capability, instance_id, stored)
            if clock() >= slice_ends:
                await asyncio.sleep(0)
                slice_ends = clock() + RESYNC_SLICE_S
        self._drop_if_empty(capability)

    def _replace(self, capability: str, live: Mapping[str, Record]) -> None:
        """Make the capability what the store holds: `live` records by id (unparsed). A
        record whose fingerprint is unchanged is not parsed again (a resync of 10,000
        instances parses only what changed)."""
        for instance_id in list(self._members.get(capability, ())):
            if instance_id not in live:
                self._set(instance_id, None)
        self._apply(capability, live)
        self._drop_if_empty(capability)

    def _apply(self, capability: str, live: Mapping[str, Record]) -> None:
        for instance_id, stored in live.items():
            self._apply_one(capability, instance_id, stored)

    def _apply_one(self, capability: str, instance_id: str, stored: Record) -> None:
        mark = Registry.fingerprint(stored)
        if (
            mark is not None
            and self._seen.get(instance_id) == mark
            and self._where.get(instance_id) == capability
        ):
            return
        record = self.registry.parse(stored)
        if record is None or record.capability != capability:
            return
        self._set(instance_id, record)
        if mark is not None:
            self._seen[instance_id] = mark

    def _drop_if_empty(self, capability: str) -> None:
        if not self._members.get(capability):
            self._members.pop(capability, None)
            self._snapshots.pop(capability, None)
            self._bases.pop(capability, None)


__all__ = ["CapabilitySnapshot", "RegistryView", "RouteEntry"]
