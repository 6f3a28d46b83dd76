"""The liveness probe of instances registered by URL (A2A agents, MCP servers).

Such an instance does not heartbeat; each gateway probes it instead. Every heartbeat_interval
the prober reads the registrations (`Remote.registrations`) and their records, and for each
instance due (`reach.registry.by_url.probe_due`: not joined, or not heartbeaten for half an
interval by any gateway) asks its connector what it serves now (`Connector.discover`, with the
last discovery as `known`, so a protocol with ETags asks conditionally):

- it answers the same: a heartbeat (status ok, `checks.probe` says so), as an agent's own;
- it answers something else (another version): it joins again with the new operations and
  details, keeping its join time (it did not restart);
- it answers and has no record (it never joined, or its record expired): it joins again and is
  back in routing;
- it does not answer, or answers what cannot be joined: nothing is written, so the record goes
  stale and leaves routing after heartbeat_timeout, as a silent agent's does.

Rounds start every interval whatever the last one is doing: an instance whose probe is still
running (one that accepts connections and never answers, up to `probe_timeout`) is left out
of the rounds that start meanwhile, and the others are probed on time. One owner's probes (an
agent token's registrations, else one capability's) hold at most a quarter of a gateway's
probe slots, and instances whose last probe here succeeded go first: a few hundred
registrations that accept connections and never answer no longer keep every other instance
waiting for a slot until its record expires.

An instance that says what it serves changed (an MCP server's `notifications/tools/list_changed`
on a call's stream, read by this process's connector: `Connector.watch`) is probed again at
once, outside the rounds, at most every `PROMPT_EVERY_S` (a server repeating it is probed once
a second, not once a notification), and again after a probe that was already running.

The first failure after a success (and the first success after a failure) is logged and
audited (`probe_failed`, `probe_recovered`), once per transition in each gateway; every
outcome is counted (`reach_probes_total`). An instance whose id another process joined
under (a record not registered by URL) is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import connectors
from gateway_api.services.remote import Remote
from reach.config import ReachSettings
from reach.errors import ReachError, UnknownInstance
from reach.registry import MIN_HEARTBEAT_INTERVAL_S, HealthReport, InstanceRecord, Registry
from reach.registry.by_url import (
    Registration,
    changed,
    join_request,
    known_discovery,
    probe_due,
)
from reach.registry.models import Discovery

log = logging.getLogger("reach.prober")

MAX_PROBES_IN_FLIGHT = 32
"""Probes one gateway runs at once (the rest of a round wait their turn)."""

MAX_PROBES_PER_OWNER = MAX_PROBES_IN_FLIGHT // 4
"""Of those, what one owner's instances may hold (`owner_of`): 300 registrations that never
answer took an instance of another capability out of routing most of the time."""

PROMPT_EVERY_S = 1.0
"""An instance that says it changed is probed at once, at most this often."""

Clock = Callable[[], float]


def probe_interval(settings: ReachSettings) -> float:
    """Seconds between rounds: the heartbeat interval an agent is given (`Registry.negotiate`)."""
    registry = settings.registry
    return max(
        MIN_HEARTBEAT_INTERVAL_S,
        min(registry.heartbeat_interval, registry.heartbeat_timeout / 2),
    )


def owner_of(registration: Registration) -> str:
    """Whose probe slots an instance's probes take: the agent token's that registered it (all
    its capabilities'), else its capability's (an admin's, `reach.yaml`'s, open mode's)."""
    if registration.principal is not None:
        return f"principal:{registration.principal}"
    return f"capability:{registration.capability}"


def probe_timeout(settings: ReachSettings) -> float:
    """How long one probe waits: what leaves room for another before the record expires."""
    return min(10.0, max(0.5, settings.registry.heartbeat_timeout / 3))


class Prober:
    """The probe loop of one gateway (`start` in the app's lifespan, `aclose` at its end)."""

    def __init__(
        self, remote: Remote, settings: ReachSettings, *, clock: Clock = time.time
    ) -> None:
        self.remote = remote
        self.settings = settings
        self.interval_s = probe_interval(settings)
        self.timeout_s = probe_timeout(settings)
        self.clock = clock
        # instance_id -> why its last probe here failed (transitions are logged once).
        self.failing: dict[str, str] = {}
        self._slots = asyncio.Semaphore(MAX_PROBES_IN_FLIGHT)
        self._owner_slots: dict[str, asyncio.Semaphore] = {}
        self._task: asyncio.Task[None] | None = None
        # Probes still running: a slow instance's probe overlaps the next rounds, which start
        # on time for the others and leave it out until it ends.
        self.inflight: set[str] = set()
        self._rounds: set[asyncio.Task[dict[str, str]]] = set()
        # What the last round read, for the connectors' word that an instance changed.
        self._registrations: dict[str, Registration] = {}
        self._watched: set[int] = set()  # id() of the connectors told to `watch`
        self._soon: dict[str, asyncio.TimerHandle] = {}  # instance_id -> its prompt probe
        self._prompted: dict[str, float] = {}  # instance_id -> loop time of its last one
        self._prompts: set[asyncio.Task[None]] = set()

    @property
    def registry(self) -> Registry:
        return self.remote.agents.registry

    def start(self) -> None:
        """Register `reach.yaml`'s `agents:`, then probe every interval until `aclose`."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="reach-prober")

    async def aclose(self) -> None:
        for handle in self._soon.values():
            handle.cancel()
        self._soon.clear()
        tasks = [t for t in (self._task, *self._rounds, *self._prompts) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task = None
        self._rounds.clear()
        self._prompts.clear()

    # -- an instance's own word that it changed ----------------------------------------------

    def _watch(self, registrations: dict[str, Registration]) -> None:
        self._registrations = registrations
        for protocol in {r.protocol for r in registrations.values()}:
            try:
                connector = self.remote.connector(protocol)
            except ReachError:
                continue
            if id(connector) not in self._watched:
                self._watched.add(id(connector))
                connector.watch(self.changed)

    def _watch_all(self) -> None:
        """Watch every protocol whose instances are registered by URL (at start: an instance
        registered before the first round is watched too)."""
        for protocol in sorted(connectors.available()):
            try:
                if not self.remote.agents.connector_class(protocol).registered_by_url:
                    continue
                connector = self.remote.connector(protocol)
            except Exception:  # a plug-in that cannot load is the registration's to report
                continue
            if id(connector) not in self._watched:
                self._watched.add(id(connector))
                connector.watch(self.changed)

    def changed(self, address: str) -> None:
        """The instances at `address` changed what they serve: probe them soon (now, unless
        one was prompted less than `PROMPT_EVERY_S` ago)."""
        found = [r for r in self._registrations.values() if r.address == address]
        if not found:  # registered since the last round: read the registrations first
            task = asyncio.get_running_loop().create_task(self._changed_unknown(address))
            self._prompts.add(task)
            task.add_done_callback(self._prompts.discard)
        for registration in found:
            self._probe_soon(registration.instance_id)

    async def _changed_unknown(self, address: str) -> None:
        try:
            self._registrations = await self.remote.registrations()
        except ReachError:
            return
        for registration in self._registrations.values():
            if registration.address == address:
                self._probe_soon(registration.instance_id)

    def _probe_soon(self, instance_id: str) -> None:
        if instance_id in self._soon:
            return  # one is due already
        loop = asyncio.get_running_loop()
        last = self._prompted.get(instance_id)
        wait = 0.0 if last is None else max(0.0, last + PROMPT_EVERY_S - loop.time())
        self._soon[instance_id] = loop.call_later(wait, self._prompt, instance_id)

    def _prompt(self, instance_id: str) -> None:
        del self._soon[instance_id]
        loop = asyncio.get_running_loop()
        self._prompted[instance_id] = loop.time()
        task = loop.create_task(self._prompt_probe(instance_id))
        self._prompts.add(task)
        task.add_done_callback(self._prompts.discard)

    async def _prompt_probe(self, instance_id: str) -> None:
        if instance_id in self.inflight:  # it may have asked before the change: again after
            self._probe_soon(instance_id)
            return
        try:
            # Read again: the id may have been registered again since (another capability).
            self._registrations = await self.remote.registrations()
            registration = self._registrations.get(instance_id)
            if registration is None:
                return
            record = (await self.registry.get_many([instance_id]))[0]
        except ReachError as exc:
            log.warning("prompt probe of %s skipped: %s", instance_id, exc.message)
            return
        if record is not None and not record.registered_by_url:
            return
        outcome = await self._bounded(registration, record)
        log.info("instance=%s said its tools changed; probed at once: %s", instance_id, outcome)

    async def _run(self) -> None:
        self._watch_all()
        if self.settings.agents:
            joined = await self.remote.register_configured(self.settings.agents)
            log.info(
                "reach.yaml agents: %d of %d registered by URL joined at start",
                joined,
                len(self.settings.agents),
            )
        while True:
            await asyncio.sleep(self.interval_s)
            task = asyncio.get_running_loop().create_task(self._guarded_round())
            self._rounds.add(task)
            task.add_done_callback(self._rounds.discard)

    async def _guarded_round(self) -> dict[str, str]:
        try:
            return await self.round()
        except ReachError as exc:  # the store's trouble: the next round tries again
            log.warning("probe round skipped: %s", exc.message)
        except Exception:
            log.exception("probe round failed")
        return {}

    async def round(self) -> dict[str, str]:
        """Probe every registered instance that is due; instance_id -> outcome (`skipped`
        for one another gateway probed in the last half interval, `in_flight` for one whose
        last probe here has not ended, `taken` for an id another process joined under)."""
        registrations = await self.remote.registrations()
        self._watch(registrations)
        for gone in set(self.failing) - set(registrations):
            del self.failing[gone]
        for gone in set(self._prompted) - set(registrations):
            del self._prompted[gone]
        owners = {owner_of(r) for r in registrations.values()}
        for owner in set(self._owner_slots) - owners:
            if not self._owner_slots[owner].locked():
                del self._owner_slots[owner]
        if not registrations:
            return {}
        ids = sorted(registrations)
        records = await self.registry.get_many(ids)
        now = self.clock()
        outcomes: dict[str, str] = {}
        due: list[tuple[Registration, InstanceRecord | None]] = []
        for instance_id, record in zip(ids, records, strict=True):
            if instance_id in self.inflight:
                outcomes[instance_id] = "in_flight"
            elif record is not None and not record.registered_by_url:
                outcomes[instance_id] = "taken"  # another process joined under this id
            elif not probe_due(record, now, self.interval_s):
                outcomes[instance_id] = "skipped"
            else:
                due.append((registrations[instance_id], record))
        # Those that answered last time first: one that does not waits behind them for a slot.
        due.sort(key=lambda pair: pair[0].instance_id in self.failing)
        results = await asyncio.gather(*(self._bounded(reg, rec) for reg, rec in due))
        outcomes.update(zip((reg.instance_id for reg, _ in due), results, strict=True))
        return outcomes

    async def _bounded(self, registration: Registration, record: InstanceRecord | None) -> str:
        self.inflight.add(registration.instance_id)
        owner = owner_of(registration)
        mine = self._owner_slots.get(owner)
        if mine is None:
            mine = self._owner_slots[owner] = asyncio.Semaphore(MAX_PROBES_PER_OWNER)
        try:
            async with mine, self._slots:
                return await self.probe(registration, record)
        except Exception as exc:  # a connector's bug: this instance's probe, not the round
            if registration.instance_id not in self.failing:  # its traceback once, not a round
                log.exception("probe of %s failed unexpectedly", registration.instance_id)
            self._failed(registration, "internal", f"the probe raised {exc!r}"[:300])
            return "internal"
        finally:
            self.inflight.discard(registration.instance_id)

    async def probe(self, registration: Registration, record: InstanceRecord | None) -> str:
        """One probe of one instance: its outcome (ok, changed, joined, or an error type)."""
        known = known_discovery(record) if record is not None else None
        try:
            discovery = await self.remote.discover(registration, known, self.timeout_s)
            outcome = await self._apply(registration, record, discovery)
        except ReachError as exc:
            self._failed(registration, exc.type, exc.message)
            return exc.type
        self._succeeded(registration, outcome)
        return outcome

    async def _apply(
        self, registration: Registration, record: InstanceRecord | None, discovery: Discovery
    ) -> str:
        if record is not None and not changed(record, discovery):
            report = HealthReport(status="ok", checks={"probe": "ok"})
            try:
                await self.registry.heartbeat(registration.instance_id, report)
                return "ok"
            except UnknownInstance:  # expired since it was read: it joins again below
                record = None
        await self._join(registration, discovery, record)
        return "joined" if record is None else "changed"

    async def _join(
        self, registration: Registration, discovery: Discovery, record: InstanceRecord | None
    ) -> None:
        join = join_request(registration, discovery)
        await self.registry.join(
            join,
            registration.principal,
            discovery=discovery,
            joined_at=record.joined_at if record is not None else None,
        )
        if registration.instance_id not in await self.remote.registrations():
            # Removed while this probe ran: what it just joined leaves again.
            await self.registry.leave(registration.instance_id)
            return
        if record is not None:
            log.info(
                "instance=%s (%s at %s) serves another version: %s -> %s, %d operations",
                registration.instance_id,
                registration.protocol,
                registration.address,
                record.discovery_version,
                discovery.version,
                len(join.operations),
            )

    def _failed(self, registration: Registration, error_type: str, reason: str) -> None:
        self._count(registration, error_type)
        if registration.instance_id in self.failing:
            return
        self.failing[registration.instance_id] = reason
        log.warning(
            "probe of instance=%s (%s at %s) failed: %s; it leaves routing after %.1fs without "
            "a successful probe",
            registration.instance_id,
            registration.protocol,
            registration.address,
            reason,
            self.settings.registry.heartbeat_timeout,
        )
        self._audit("probe_failed", registration, error_type=error_type, reason=reason)

    def _succeeded(self, registration: Registration, outcome: str) -> None:
        self._count(registration, outcome)
        if self.failing.pop(registration.instance_id, None) is None:
            return
        log.info(
            "probe of instance=%s (%s at %s) succeeds again (%s)",
            registration.instance_id,
            registration.protocol,
            registration.address,
            outcome,
        )
        self._audit("probe_recovered", registration, outcome=outcome)

    def _count(self, registration: Registration, outcome: str) -> None:
        metrics = self.remote.agents.metrics
        if metrics is not None:
            metrics.probe(registration.capability, registration.protocol, outcome)

    def _audit(self, event: str, registration: Registration, **fields: str) -> None:
        guard = self.remote.agents.guard
        if guard is not None:
            guard.audit.record(
                event,
                capability=registration.capability,
                instance=registration.instance_id,
                protocol=registration.protocol,
                address=registration.address,
                **fields,
            )
