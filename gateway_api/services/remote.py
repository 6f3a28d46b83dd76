"""Instances registered by URL (A2A agents, MCP servers): registration and removal.

`POST /reach/agents` naming a protocol whose connector is `registered_by_url` comes here, and
so do the gRPC front's Join of one, `reach.yaml` `agents:` at start and `reach agents add`.
Who may is decided like a Join (an admin, or an agent token for the capability; a registration
another principal made is theirs). The connector checks the URL, the address guard vets every
address its host resolves to, the connector discovers what the instance serves, and the
instance joins (`Agents.join`) with the discovered operations (the registration's own
declarations over them, per name) and details. The registration is kept in the store
(`reach.registry.by_url`) until `DELETE /reach/agents/{id}`: the probe
(`gateway_api.prober`) joins the instance again whenever it answers after its record expired.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from pydantic import ValidationError

from connectors.base import Connector
from reach.config import UrlAgentSettings
from reach.errors import Forbidden, InvalidRequest, ReachError, Unavailable
from reach.registry.by_url import (
    MAX_REGISTRATIONS,
    REGISTRATIONS_KEY,
    Registered,
    Registration,
    UrlRegistration,
    instance_id_for,
    join_request,
    merged_operations,
)
from reach.registry.models import Discovery, OperationDeclaration
from reach.security.auth import may_serve
from reach.security.tokens import Principal
from reach.store import Store

if TYPE_CHECKING:
    from gateway_api.services.agents import Agents

log = logging.getLogger("reach.remote")

DISCOVER_TIMEOUT_S = 10.0
"""How long a registration waits for the instance to say what it serves."""

MAX_REGISTRATIONS_PER_PRINCIPAL = 1000
"""Most instances one agent token's principal registers by URL: every gateway probes each of
them every interval, so one token could otherwise take all `MAX_REGISTRATIONS` (nobody else
could register) and a gateway's CPU with their probes."""


class Remote:
    """Registration by URL for one gateway, over its `Agents` (connectors, guard, registry)."""

    def __init__(self, agents: Agents) -> None:
        self.agents = agents
        # Connectors built here when the gateway lends no ConnectorSet (a bare gateway, tests).
        self._own: dict[str, Connector] = {}
        self._unreadable: set[str] = set()
        # instance_id -> (the stored JSON, what it parsed to): unchanged ones are not parsed again.
        self._parsed: dict[str, tuple[str, Registration]] = {}

    @property
    def store(self) -> Store:
        return self.agents.registry.store

    def connector(self, protocol: str) -> Connector:
        """The live connector of `protocol` (the gateway's, so discovery shares its pools)."""
        if self.agents.connections is not None:
            return self.agents.connections.get(protocol)
        found = self._own.get(protocol)
        if found is None:
            settings = self.agents.live.settings
            cls = self.agents.connector_class(protocol)
            found = self._own[protocol] = cls(settings.transport, security=settings.security)
        return found

    async def aclose(self) -> None:
        own, self._own = self._own, {}
        for connector in own.values():
            await connector.aclose()

    async def discover(
        self, registration: Registration, known: Discovery | None, timeout_s: float
    ) -> Discovery:
        """What the instance serves now, or the Reach error that says why not (503 when it
        does not answer in time)."""
        connector = self.connector(registration.protocol)
        try:
            async with asyncio.timeout(timeout_s):
                return await connector.discover(registration.address, known)
        except TimeoutError:
            raise Unavailable(
                f"{registration.protocol} instance at {registration.address} did not say what "
                f"it serves within {timeout_s:g}s"
            ) from None

    # -- registering ----------------------------------------------------------------------

    async def register(self, body: UrlRegistration, principal: Principal | None) -> Registered:
        """Register the instance at `body.service_address`, discovered and joined; a refusal
        is audited (`register_refused`) and nothing is kept."""
        try:
            return await self._register(body, principal, source="api")
        except ReachError as exc:
            self._audit_refusal(exc, principal, body)
            raise

    async def register_configured(self, agents: list[UrlAgentSettings]) -> int:
        """`reach.yaml` `agents:` (at start): each registered as an admin would. One whose
        instance does not answer (or answers what cannot be joined) is kept all the same, and
        joins once a probe reaches it. Returns how many joined now."""
        joined = 0
        for entry in agents:
            try:
                body = UrlRegistration(
                    capability=entry.capability,
                    protocol=entry.protocol,
                    service_address=entry.url,
                    instance_id=entry.instance_id,
                    operations=[
                        OperationDeclaration(**op.model_dump(exclude_none=True))
                        for op in entry.operations
                    ],
                )
                await self._register(body, None, source="config")
                joined += 1
            except (ReachError, ValidationError) as exc:
                log.warning(
                    "reach.yaml agents: %s %s (capability %s) not joined at start: %s",
                    entry.protocol,
                    entry.url,
                    entry.capability,
                    exc.message if isinstance(exc, ReachError) else exc,
                )
        return joined

    async def _register(
        self, body: UrlRegistration, principal: Principal | None, *, source: str
    ) -> Registered:
        may_serve(principal, body.capability)
        cls = self.agents.connector_class(body.protocol)
        if not cls.registered_by_url:
            raise InvalidRequest(
                f"protocol {body.protocol!r}: its instances join themselves (an instance_id, "
                "their operations); only A2A agents, MCP servers and other protocols "
                "registered by URL are registered by a URL"
            )
        address = cls.check_address(body.service_address)
        await self.agents.vet_address(cls, address)
        registrations = await self.registrations()
        instance_id = body.instance_id or instance_id_for(body.protocol, address)
        held = registrations.get(instance_id)
        self._may_change(held, instance_id, principal)
        if held is None and len(registrations) >= MAX_REGISTRATIONS:
            raise Unavailable(
                f"{len(registrations)} instances are registered by URL, the most a gateway "
                "probes; remove some (reach agents remove ID) first",
                retry_after_s=60,
            )
        owner = principal.name if principal is not None and principal.kind == "agent" else None
        if held is None and owner is not None:
            mine = sum(1 for r in registrations.values() if r.principal == owner)
            if mine >= MAX_REGISTRATIONS_PER_PRINCIPAL:
                raise Unavailable(
                    f"principal {owner!r} has registered {mine} instances by URL, the most one "
                    "agent token's principal may; remove some (reach agents remove ID) first",
                    retry_after_s=60,
                )
        registration = Registration(
            instance_id=instance_id,
            capability=body.capability,
            protocol=body.protocol,
            address=address,
            operations=body.operations,
            labels=body.labels,
            weight=body.weight,
            max_inflight=body.max_inflight,
            principal=owner,
            source="config" if source == "config" else "api",
            registered_at=time.time(),
        )
        try:
            discovery = await self.discover(registration, None, DISCOVER_TIMEOUT_S)
        except ReachError:
            if source == "config":
                await self._keep(registration)
            raise
        return await self.joined(registration, discovery, principal)

    async def joined(
        self,
        registration: Registration,
        discovery: Discovery,
        principal: Principal | None = None,
    ) -> Registered:
        """Join what discovery found and keep the registration."""
        join = join_request(registration, discovery)
        ack = await self.agents.join(join, principal, discovery=discovery)
        await self._keep(registration)
        if self.agents.guard is not None:
            self.agents.guard.audit.record(
                "registered",
                principal=principal.name if principal else None,
                capability=registration.capability,
                instance=registration.instance_id,
                protocol=registration.protocol,
                address=registration.address,
                operations=len(join.operations),
                source=registration.source,
            )
        return Registered(
            **ack.model_dump(),
            protocol=registration.protocol,
            address=registration.address,
            operations=merged_operations(discovery.operations, registration.operations),
            details=discovery.details,
        )

    async def _keep(self, registration: Registration) -> None:
        await self.store.hash_set(
            REGISTRATIONS_KEY, registration.instance_id, registration.model_dump_json()
        )

    # -- reading and removing -------------------------------------------------------------

    async def registrations(self) -> dict[str, Registration]:
        """Every registration by URL in the store, by instance id (an unreadable one is
        logged once and left out)."""
        found: dict[str, Registration] = {}
        parsed: dict[str, tuple[str, Registration]] = {}
        for instance_id, raw in (await self.store.hash_all(REGISTRATIONS_KEY)).items():
            cached = self._parsed.get(instance_id)
            if cached is not None and cached[0] == raw:  # each probe round reads them all
                parsed[instance_id] = cached
                found[instance_id] = cached[1]
                continue
            try:
                found[instance_id] = Registration.model_validate_json(raw)
                parsed[instance_id] = (raw, found[instance_id])
            except ValidationError as exc:
                if instance_id not in self._unreadable:
                    self._unreadable.add(instance_id)
                    log.error("unreadable registration of %s ignored: %s", instance_id, exc)
        self._parsed = parsed
        return found

    async def forget(self, instance_id: str, principal: Principal | None = None) -> bool:
        """Remove the registration of `instance_id` (False: there is none), so that no probe
        joins it again; its record is the caller's to remove (`Agents.leave`)."""
        held = (await self.registrations()).get(instance_id)
        if held is None:
            return False
        self._may_change(held, instance_id, principal)
        if await self.store.hash_delete(REGISTRATIONS_KEY, instance_id) is None:
            return False
        log.info("unregistered %s instance=%s at %s", held.protocol, instance_id, held.address)
        if self.agents.guard is not None:
            self.agents.guard.audit.record(
                "unregistered",
                principal=principal.name if principal else None,
                capability=held.capability,
                instance=instance_id,
                address=held.address,
            )
        return True

    @staticmethod
    def _may_change(
        held: Registration | None, instance_id: str, principal: Principal | None
    ) -> None:
        """An agent token replaces or removes only its own registrations; one an admin made,
        or `reach.yaml` (`agents:`), or an open-mode gateway (no principal), is an admin's (and
        the config's) to change, whatever capability the token may serve. An admin (or open
        mode) changes any."""
        if held is None or principal is None or principal.kind != "agent":
            return
        if held.principal == principal.name:
            return
        if held.principal is not None:
            raise Forbidden(f"instance {instance_id!r} was registered by another principal")
        if held.source == "config":
            by, who = "reach.yaml (agents:)", "the config or an admin token"
        else:
            by, who = "an admin", "an admin token"
        raise Forbidden(
            f"instance {instance_id!r} was registered by {by}; only {who} may replace or "
            "remove it, not an agent token"
        )

    def _audit_refusal(
        self, exc: ReachError, principal: Principal | None, body: UrlRegistration
    ) -> None:
        if self.agents.guard is not None:
            self.agents.guard.audit.record(
                "register_refused",
                principal=principal.name if principal else None,
                capability=body.capability,
                instance=body.instance_id,
                address=body.service_address,
                status=exc.http_status,
                error_type=exc.type,
                reason=exc.message,
            )
