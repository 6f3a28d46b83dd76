"""Registry: capability -> instances + health (R2, R5, R8, R21).

Written once over `reach.store.Store`; the store backend (memory or Redis) decides where the
records live. Each step (join, heartbeat, leave, listing) is one atomic store operation, so
several gateways can race without losing a re-joined instance or resurrecting one that left.
An instance record's TTL is `heartbeat_timeout`: every heartbeat refreshes it (and repairs the
instance's place in its capability's index), silence lets it expire. The index is pruned (and
the eviction logged) the next time anyone lists the capability, or on the gateway's sweep.

An agent may declare, per operation, whether it is idempotent and its timeout
(`OperationDeclaration`, in `JoinRequest.operations` beside plain names); `declared_policy` is
what the routable instances of a capability declare together. Configuration decides first
(`reach.policy`): a declaration only fills in what configuration left open.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Sequence
from typing import cast

from reach.config import RegistrySettings, TransportSettings
from reach.errors import (
    Forbidden,
    InstanceReplaced,
    RateLimited,
    ReachError,
    Unavailable,
    UnknownInstance,
)
from reach.registry._beats import (
    MAX_HEARTBEAT_BATCH,
    BeatEntry,
    BeatOutcome,
    beat_of,
    check_batch,
    health_fields,
    kept,
    refusals,
)
from reach.registry._records import (
    HEALTH,
    HEALTH_FIELDS,
    JOIN,
    Beat,
    fields_of,
    parse_whole,
    status_of,
)
from reach.registry.models import (
    Ack,
    Declares,
    Discovery,
    HealthReport,
    HealthStatus,
    InstanceRecord,
    JoinRequest,
    LabelKey,
    LabelValue,
    OperationDeclaration,
    OperationEntry,
    declared_policy,
)
from reach.registry.sweeps import SweepPlan
from reach.store import Record, Store

log = logging.getLogger("reach.registry")
heartbeat_log = logging.getLogger("reach.heartbeat")

MIN_HEARTBEAT_INTERVAL_S = 0.1


CHANGES_CHANNEL = "registry"
"""Where every join, leave, health status change and eviction is announced, as
`<capability>\t<instance_id>`: registry views re-read that record (`reach.registry.view`)."""

ChangeListener = Callable[[str, str], None]


def _rejoin_note(previous: Record | None, capability: str) -> str:
    if previous is None:
        return ""
    if previous.group != capability:
        return f" (re-join, moved from {previous.group})"
    return " (re-join)"


class Registry:
    """Instances are store records grouped by capability: a record's TTL is the heartbeat
    timeout, its two fields are the join part and the health part (a heartbeat writes only
    the latter, so it cannot undo a concurrent re-join). A capability is known until
    `capability_retention_s` after its last join or heartbeat."""

    def __init__(
        self,
        store: Store,
        settings: RegistrySettings,
        transport: TransportSettings | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.max_message_bytes = (transport or TransportSettings()).max_message_bytes
        # Never forget a capability before its last instance record has expired.
        self._retention_s = max(settings.capability_retention_s, settings.heartbeat_timeout)
        self._listeners: list[ChangeListener] = []
        self._evict_listeners: list[ChangeListener] = []
        # A new capability's admission, by (capability, principal), and when it began: the Joins
        # that race to create it share that one check rather than each counting as a creation,
        # also those that found the capability unknown before the first Join wrote it (a minute).
        self._admitting: dict[tuple[str, str | None], tuple[asyncio.Future[None], float]] = {}

    def on_change(self, listener: ChangeListener) -> None:
        """Call `listener(capability, instance_id)` after each change made through this
        registry, before the change is announced to other processes (read-your-writes)."""
        self._listeners.append(listener)

    def on_evicted(self, listener: ChangeListener) -> None:
        """Call `listener(capability, instance_id)` for each eviction this process makes."""
        self._evict_listeners.append(listener)

    async def _announce(self, capability: str, instance_id: str) -> None:
        for listener in self._listeners:
            listener(capability, instance_id)
        try:
            await self.store.publish(CHANGES_CHANNEL, f"{capability}\t{instance_id}")
        except ReachError as exc:
            # The change itself is stored; other views catch up at their next resync.
            log.warning("could not announce %s/%s: %s", capability, instance_id, exc)

    def negotiate(self, join: JoinRequest) -> Ack:
        timeout = self.settings.heartbeat_timeout
        proposed = join.heartbeat_interval or self.settings.heartbeat_interval
        # At least two heartbeats must fit in one timeout, or one lost packet evicts.
        interval = max(MIN_HEARTBEAT_INTERVAL_S, min(proposed, timeout / 2))
        size = min(join.max_message_bytes or self.max_message_bytes, self.max_message_bytes)
        return Ack(
            session=secrets.token_hex(8),
            instance_id=join.instance_id,
            capability=join.capability,
            heartbeat_interval=interval,
            heartbeat_timeout=timeout,
            max_message_bytes=size,
            async_callback=join.async_callback,
        )

    async def join(
        self,
        join: JoinRequest,
        principal: str | None = None,
        *,
        admin: bool = False,
        claim: Callable[[InstanceRecord], None] | None = None,
        discovery: Discovery | None = None,
        joined_at: float | None = None,
    ) -> Ack:
        """Register (or re-register) an instance under a new session (`Ack.session`).

        `discovery`: an instance registered by URL, as its connector found it (its details,
        version and ETag are kept in the record); `joined_at`: when it first joined, for one
        whose discovery changed (it did not restart: requests pinned to it stay pinned).

        Who may join under an instance_id that is registered (`docs/security.md`, ownership):
        - held by a principal: only that principal (or an `admin`); anyone else is refused
          (403), also when the other Join lands in between;
        - held by nobody (joined with auth off, or by an admin): a `principal` claims it only
          if `claim(record)` returns (it raises Forbidden to refuse, and audits the claim).
        """
        if principal is not None or not admin:
            existing = await self.get(join.instance_id)
            self._check_owner(existing, principal or "", admin=admin)
            unowned = existing is not None and existing.principal is None
            if unowned and principal is not None and claim is not None:
                assert existing is not None
                claim(existing)
        now = time.time()
        if not await self.store.group_known(join.capability):
            await self._admit_once(join.capability, principal, now)
        ack = self.negotiate(join)
        record = InstanceRecord(
            instance_id=join.instance_id,
            capability=join.capability,
            protocol=join.protocol,
            address=join.service_address,
            operations=join.operation_names,
            declared=join.declarations,
            max_message_bytes=ack.max_message_bytes,
            async_callback=ack.async_callback,
            heartbeat_interval=ack.heartbeat_interval,
            labels=join.labels,
            weight=join.weight,
            max_inflight=join.max_inflight,
            joined_at=joined_at or now,
            last_seen=now,
            principal=principal,
            session=ack.session,
        )
        if discovery is not None:
            record.registered_by_url = True
            record.details = discovery.details
            record.discovery_version = discovery.version
            record.discovery_etag = discovery.etag
        previous = await self.store.put_record(
            join.instance_id,
            join.capability,
            fields_of(record),
            ttl_s=self.settings.heartbeat_timeout,
            group_ttl_s=self._retention_s,
        )
        before = self._parse(previous) if not admin else None
        if (
            previous is not None
            and before is not None
            and before.principal not in (None, principal)
        ):
            # Another principal's Join landed between the check and this write: put it back.
            await self.store.put_record(
                join.instance_id,
                previous.group,
                previous.fields,
                ttl_s=self.settings.heartbeat_timeout,
                group_ttl_s=self._retention_s,
            )
            self._check_owner(before, principal or "")
        log.info(
            "joined capability=%s instance=%s protocol=%s address=%s%s",
            join.capability,
            join.instance_id,
            join.protocol,
            join.service_address,
            _rejoin_note(previous, join.capability),
        )
        # The handshake's negotiation is routine: sampled, apart (the join itself is above).
        heartbeat_log.info(
            "handshake instance=%s proposed heartbeat_interval=%s max_message_bytes=%s -> "
            "heartbeat_interval=%.2fs heartbeat_timeout=%.1fs max_message_bytes=%d",
            join.instance_id,
            join.heartbeat_interval,
            join.max_message_bytes,
            ack.heartbeat_interval,
            ack.heartbeat_timeout,
            ack.max_message_bytes,
        )
        if previous is not None and previous.group != join.capability:
            await self._announce(previous.group, join.instance_id)
        await self._announce(join.capability, join.instance_id)
        return ack

    async def _admit_once(self, capability: str, principal: str | None, now: float) -> None:
        key = (capability, principal)
        pending, since = self._admitting.get(key, (None, now))
        if pending is None or now - since > 60:
            self._admitting = {k: v for k, v in self._admitting.items() if now - v[1] <= 60}
            pending = asyncio.ensure_future(self._admit_new_capability(capability, principal, now))
            self._admitting[key] = (pending, now)
        try:  # shielded: one waiting Join that is cancelled does not cancel the others' check
            await asyncio.shield(pending)
        except Exception:
            self._admitting.pop(key, None)  # a refusal is not kept: the next Join is checked
            raise

    async def _admit_new_capability(
        self, capability: str, principal: str | None, now: float
    ) -> None:
        """A Join that would create a capability: within `max_capabilities` (each is kept
        `capability_retention_s` and is a metrics label), and within its principal's
        `new_capabilities_per_minute`. Gateways sharing a store may pass the cap by the
        Joins racing at its edge."""
        held = len(await self.store.groups())
        most = self.settings.max_capabilities
        if held >= most:
            raise Unavailable(
                f"the registry holds {held} capabilities, its most (registry.max_capabilities "
                f"= {most}); {capability!r} is not created. A capability is forgotten "
                f"{self._retention_s:.0f}s after its last join or heartbeat",
                retry_after_s=60,
            )
        per_minute = self.settings.new_capabilities_per_minute
        window = int(now // 60)
        made = await self.store.incr(f"new-capabilities:{principal or '-'}:{window}", ttl_s=120)
        if made > per_minute:
            raise RateLimited(
                f"{principal or 'this caller'} created {per_minute} capabilities this minute "
                f"(registry.new_capabilities_per_minute); {capability!r} is not created",
                retry_after_s=max(1, 60 * (window + 1) - int(now)),
            )

    @staticmethod
    def _check_owner(record: InstanceRecord | None, principal: str, admin: bool = False) -> None:
        if admin or record is None or record.principal is None:
            return
        if record.principal != principal:
            raise Forbidden(
                f"instance_id {record.instance_id!r} is held by another principal; "
                "choose another instance_id"
            )

    async def owned(self, instance_id: str, principal: str) -> InstanceRecord | None:
        """The instance's record if `principal` may act for it (None: not registered);
        Forbidden when another principal registered it."""
        record = await self.get(instance_id)
        if record is not None and record.principal != principal:
            raise Forbidden(f"instance {instance_id!r} was registered by another principal")
        return record

    async def heartbeat(
        self,
        instance_id: str,
        report: HealthReport,
        session: str | None = None,
        principal: str | None = None,
    ) -> Beat:
        """Refresh an instance's record. A heartbeat naming the `session` of an earlier Join
        whose instance_id another process has joined since is refused (409 instance_replaced)
        and refreshes nothing: that record lives only as long as its own process heartbeats.
        `principal` (an agent token's name): refused (403) unless it registered the instance.
        Only the record's health part is written, and only its small brief field is read (the
        join part is never parsed on this path)."""
        outcome = (await self.heartbeats([BeatEntry(instance_id, report, session)], principal))[0]
        if isinstance(outcome, ReachError):
            raise outcome
        return outcome

    async def heartbeats(
        self, entries: Sequence[BeatEntry], principal: str | None = None
    ) -> list[BeatOutcome]:
        """Many heartbeats at once, each answered on its own (`heartbeat`'s refusals, entry by
        entry): one store read when a session or `principal` is to be checked, and one store
        write for the whole batch. A store failure fails the batch (`Unavailable`)."""
        going: Sequence[int] | None = None  # the entries not refused (None: every one)
        outcomes: list[BeatOutcome | None] = [None] * len(entries)
        if principal is not None or any(entry.session is not None for entry in entries):
            stored = await self.store.get_records([entry.instance_id for entry in entries])
            for n, refused in enumerate(refusals(entries, stored, principal)):
                if refused is not None:
                    outcomes[n] = refused
                    if isinstance(refused, InstanceReplaced):
                        log.warning(
                            "heartbeat of instance=%s from a replaced session refused",
                            entries[n].instance_id,
                        )
            going = [n for n, outcome in enumerate(outcomes) if outcome is None]
        now = time.time()
        writing = entries if going is None else [entries[n] for n in going]
        previous = await self.store.update_records(
            [(entry.instance_id, health_fields(entry, now)) for entry in writing],
            ttl_s=self.settings.heartbeat_timeout,
            group_ttl_s=self._retention_s,
        )
        sampled = heartbeat_log.isEnabledFor(logging.INFO)
        # Each instance whose status changed, announced once for the batch however many of its
        # entries changed it (a batch flipping one instance 1000 times made 1000 announcements,
        # each a store round trip in turn and a refresh on every gateway listening).
        changed: dict[tuple[str, str], tuple[str, BeatEntry]] | None = None
        for n, entry, before in zip(
            range(len(entries)) if going is None else going, writing, previous, strict=True
        ):
            outcome, was = beat_of(entry, before)
            outcomes[n] = outcome
            if isinstance(outcome, ReachError):
                # Evicted (or never joined): the agent is told to join again.
                log.info(
                    "heartbeat from unknown instance=%s: asked to join again", entry.instance_id
                )
                continue
            if was != outcome.status:
                key = (outcome.capability, entry.instance_id)
                if changed is None:
                    changed = {}
                changed[key] = (changed[key][0] if key in changed else str(was), entry)
            if sampled:
                # Routine: the sampled heartbeat log (telemetry.heartbeat_log_sample).
                heartbeat_log.info(
                    "heartbeat instance=%s status=%s inflight=%d",
                    entry.instance_id,
                    outcome.status,
                    outcome.inflight,
                )
        for (capability, instance_id), (was, entry) in (changed or {}).items():
            log.info(
                "health instance=%s capability=%s %s -> %s checks=%s",
                instance_id,
                capability,
                was,
                entry.report.status,
                entry.report.checks,
            )
            await self._announce(capability, instance_id)
        return cast(list[BeatOutcome], outcomes)  # every one is set

    async def leave(self, instance_id: str) -> bool:
        previous = await self.store.delete_record(instance_id)
        if previous is None:
            return False
        log.info("left capability=%s instance=%s", previous.group, instance_id)
        await self._announce(previous.group, instance_id)
        return True

    async def get(self, instance_id: str) -> InstanceRecord | None:
        return self._parse((await self.store.get_records([instance_id]))[0])

    async def get_many(self, instance_ids: Sequence[str]) -> list[InstanceRecord | None]:
        return [self._parse(r) for r in await self.store.get_records(instance_ids)]

    async def known(self, capability: str) -> bool:
        return await self.store.group_known(capability)

    async def capabilities(self) -> list[str]:
        return sorted(await self.store.groups())

    async def instances(self, capability: str) -> list[InstanceRecord]:
        """Live instances of a capability (healthy or not), sorted by id; prunes the evicted."""
        live = await self.scan(capability)
        parsed = (self._parse(live[i]) for i in sorted(live))
        return [record for record in parsed if record is not None]

    async def scan(self, capability: str) -> dict[str, Record]:
        """The capability's live records as stored (unparsed: `parse`, `health_status`);
        prunes the evicted."""
        scan = await self.store.scan_group(capability)
        await self._evicted(capability, scan.evicted)
        return scan.live

    @staticmethod
    def fingerprint(stored: Record) -> tuple[int, str] | None:
        """What a record says beyond its heartbeat's time, cheaply: its join part and health
        status (None: unreadable). Equal fingerprints: nothing routing reads has changed."""
        try:
            # The status from the head of the health part (a resync fingerprints every record:
            # parsing each health part whole was most of its time).
            return hash(stored.fields[JOIN]), status_of(stored.fields[HEALTH])
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    def parse(self, stored: Record | None) -> InstanceRecord | None:
        return self._parse(stored)

    async def sweep(self, plan: SweepPlan | None = None) -> None:
        """Prune every capability's index (logging evictions), then forget the capabilities
        idle past their retention; with `plan` (the background sweep's), only its due steps."""
        sweeping = plan or SweepPlan()
        for capability in await sweeping.run(self.store, self.capabilities, self._evicted):
            log.info(
                "forgot capability=%s: no join or heartbeat for %.0fs",
                capability,
                self._retention_s,
            )

    async def _evicted(self, capability: str, instance_ids: Sequence[str]) -> None:
        """Log and announce the instances this process just pruned (only the one whose prune
        removed an instance sees it, so each eviction is logged once)."""
        for instance_id in instance_ids:
            log.warning(
                "evicted capability=%s instance=%s: no heartbeat for %.1fs",
                capability,
                instance_id,
                self.settings.heartbeat_timeout,
            )
            for listener in self._evict_listeners:
                listener(capability, instance_id)
            await self._announce(capability, instance_id)

    @staticmethod
    def _parse(stored: Record | None) -> InstanceRecord | None:
        if stored is None:
            return None
        try:
            return parse_whole(stored)
        except (KeyError, TypeError, ValueError):
            log.exception("unreadable instance record %s ignored", stored)
            return None


__all__ = [
    "CHANGES_CHANNEL",
    "HEALTH_FIELDS",
    "MAX_HEARTBEAT_BATCH",
    "MIN_HEARTBEAT_INTERVAL_S",
    "Ack",
    "Beat",
    "BeatEntry",
    "BeatOutcome",
    "Declares",
    "HealthReport",
    "HealthStatus",
    "InstanceRecord",
    "JoinRequest",
    "LabelKey",
    "LabelValue",
    "OperationDeclaration",
    "OperationEntry",
    "Registry",
    "UnknownInstance",
    "check_batch",
    "declared_policy",
    "kept",
]
