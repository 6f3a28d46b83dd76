"""Agents: Join, heartbeat and leave, shared by the HTTP routes and the gRPC front.

With tokens required, an agent token must be allowed to serve the capability it joins, an
instance_id another principal holds is not taken over, and one nobody holds is claimed only
for a capability the token may serve, audited (`Registry.join`, `owned`).

A protocol whose instances are registered by URL (A2A, MCP: `Connector.registered_by_url`)
is registered through `remote` (`gateway_api.services.remote`), which discovers what the
instance serves and joins it here with that `discovery`; a gRPC Join of such a protocol is
one too.
"""

from __future__ import annotations

from collections.abc import Sequence

import connectors
from connectors import ConnectorSet
from connectors.base import Connector
from gateway_api.live import Live
from gateway_api.services.remote import Remote
from reach.errors import Forbidden, InvalidRequest, ReachError
from reach.registry import (
    Ack,
    Beat,
    BeatEntry,
    BeatOutcome,
    HealthReport,
    InstanceRecord,
    JoinRequest,
    Registry,
)
from reach.registry.by_url import UrlRegistration
from reach.registry.models import Discovery
from reach.security.auth import may_serve
from reach.security.guard import Guard
from reach.security.tokens import Principal
from reach.telemetry.metrics import ReachMetrics


class Agents:
    def __init__(
        self,
        live: Live,
        registry: Registry,
        guard: Guard | None = None,
        connections: ConnectorSet | None = None,
        metrics: ReachMetrics | None = None,
    ) -> None:
        self.live = live
        self.registry = registry
        self.guard = guard
        # The live connectors (the Join-time mTLS identity probe); None: no probe.
        self.connections = connections
        self.metrics = metrics
        # protocol -> its connector class: finding one reads every installed distribution's
        # entry points (tens of ms), so each protocol is looked up once per process.
        self._connector_classes: dict[str, type[Connector]] = {}
        self.remote = Remote(self)

    async def join(
        self,
        body: JoinRequest,
        principal: Principal | None = None,
        *,
        discovery: Discovery | None = None,
    ) -> Ack:
        """Register an instance whose protocol has a connector and whose address it accepts.
        A refusal is audited (`join_refused`): a token for another capability, a takeover of
        an instance another principal holds, a forbidden address.

        `discovery`: an instance registered by URL, as `remote` found it at the address it
        checked. Without one, a protocol registered by URL is registered through `remote`."""
        if discovery is None and self.by_url(body.protocol):
            return await self.remote.register(UrlRegistration.from_join(body), principal)
        try:
            return await self._join(body, principal, discovery)
        except ReachError as exc:
            self._refused("join_refused", exc, principal, body.instance_id, body.capability)
            raise

    def by_url(self, protocol: str) -> bool:
        """Whether `protocol`'s instances are registered by URL (False: unknown protocol)."""
        try:
            return self.connector_class(protocol).registered_by_url
        except InvalidRequest:
            return False

    async def _join(
        self, body: JoinRequest, principal: Principal | None, discovery: Discovery | None
    ) -> Ack:
        may_serve(principal, body.capability)
        connector = self.connector_class(body.protocol)
        if discovery is None:  # else `remote` checked and vetted it before discovering
            body.service_address = connector.check_address(body.service_address)
            await self.vet_address(connector, body.service_address)
        if (
            discovery is None
            and self.connections is not None
            and self.live.settings.security.tls.enabled
        ):
            # mTLS: the agent must hold a certificate from the CA for this instance_id (403).
            live = self.connections.get(body.protocol)
            await live.verify_identity(body.service_address, body.instance_id)
        owner = principal.name if principal is not None and principal.kind == "agent" else None
        admin = principal is not None and principal.kind == "admin"

        claimed: list[InstanceRecord] = []

        def claim(unowned: InstanceRecord) -> None:
            self._may_claim(unowned, principal)
            claimed.append(unowned)

        ack = await self.registry.join(body, owner, admin=admin, claim=claim, discovery=discovery)
        if claimed and self.guard is not None and principal is not None:
            # Audited once the Join holds it (a Join refused after the check claimed nothing).
            self.guard.audit.record(
                "instance_claimed",
                principal=principal.name,
                capability=body.capability,
                instance=body.instance_id,
                previous_capability=claimed[0].capability,
                previous_address=claimed[0].address,
            )
        if self.guard is not None:
            self.guard.audit.record(
                "join",
                principal=principal.name if principal else None,
                capability=body.capability,
                instance=body.instance_id,
                protocol=body.protocol,
                address=body.service_address,
                **({"registered_by_url": True} if discovery is not None else {}),
            )
        return ack

    @staticmethod
    def _may_claim(unowned: InstanceRecord, principal: Principal | None) -> None:
        """An agent token claims an instance nobody holds (joined with auth off, or by an
        admin) only for a capability it may serve, that instance's as well as the Join's; the
        claim is audited (`instance_claimed`), never silent."""
        assert principal is not None
        if unowned.registered_by_url:
            # An admin's or reach.yaml's registration by URL: an agent token may not take it
            # over by joining its instance_id (gateway_api.services.remote decides who may).
            raise Forbidden(
                f"instance_id {unowned.instance_id!r} is an instance of {unowned.capability!r} "
                "registered by URL by an admin or reach.yaml; only an admin may replace it. "
                "Choose another instance_id"
            )
        if not principal.may_serve(unowned.capability):
            raise Forbidden(
                f"instance_id {unowned.instance_id!r} is held by nobody, as an instance of "
                f"{unowned.capability!r}, which the token of {principal.name!r} may not serve; "
                "choose another instance_id"
            )

    def connector_class(self, protocol: str) -> type[Connector]:
        found = self._connector_classes.get(protocol)
        if found is None:
            known = connectors.available()
            if protocol not in known:
                raise InvalidRequest(
                    f"protocol {protocol!r} has no connector; known: {', '.join(sorted(known))}"
                )
            found = self._connector_classes[protocol] = connectors.load(protocol)
        return found

    async def heartbeat(
        self,
        instance_id: str,
        report: HealthReport,
        principal: Principal | None = None,
        session: str | None = None,
    ) -> Beat:
        outcome = (await self.heartbeats([BeatEntry(instance_id, report, session)], principal))[0]
        if isinstance(outcome, ReachError):
            raise outcome
        return outcome

    async def heartbeats(
        self, entries: Sequence[BeatEntry], principal: Principal | None = None
    ) -> list[BeatOutcome]:
        """Each entry refreshed or refused on its own (a batched heartbeat, or a single one):
        an agent token beats only the instances it registered, the others are refused (403,
        audited as `heartbeat_refused`) as a single heartbeat is."""
        owner = principal.name if principal is not None and principal.kind == "agent" else None
        outcomes = await self.registry.heartbeats(entries, owner)
        for entry, outcome in zip(entries, outcomes, strict=True):
            if isinstance(outcome, Forbidden):
                self._refused("heartbeat_refused", outcome, principal, entry.instance_id)
            elif self.metrics is not None and not isinstance(outcome, ReachError):
                self.metrics.heartbeat(outcome.capability, outcome.status)
        return outcomes

    async def leave(self, instance_id: str, principal: Principal | None = None) -> bool:
        """Deregister an instance; one registered by URL is forgotten too (no probe joins it
        again), also once its record has expired."""
        if principal is not None and principal.kind == "agent":
            await self._owned(instance_id, principal, "leave_refused")
        forgotten = False
        record = await self.registry.get(instance_id)
        if record is None or record.registered_by_url:  # an agent's own Leave reads no more
            try:
                forgotten = await self.remote.forget(instance_id, principal)
            except Forbidden as exc:
                self._refused("leave_refused", exc, principal, instance_id)
                raise
        left = await self.registry.leave(instance_id) or forgotten
        if left and self.guard is not None:
            self.guard.audit.record(
                "leave", principal=principal.name if principal else None, instance=instance_id
            )
        return left

    async def _owned(self, instance_id: str, principal: Principal, event: str) -> None:
        try:
            await self.registry.owned(instance_id, principal.name)
        except Forbidden as exc:  # another principal's instance: audited, as a takeover try
            self._refused(event, exc, principal, instance_id)
            raise

    def _refused(
        self,
        event: str,
        exc: ReachError,
        principal: Principal | None,
        instance_id: str,
        capability: str | None = None,
    ) -> None:
        if self.guard is not None:
            self.guard.audit.record(
                event,
                principal=principal.name if principal else None,
                capability=capability,
                instance=instance_id,
                status=exc.http_status,
                error_type=exc.type,
                reason=exc.message,
            )

    async def vet_address(self, connector: type[Connector], address: str) -> None:
        """Every address a joining agent's host resolves to must be allowed, else 422."""
        target = connector.address_host_port(address)
        if target is None:
            return
        try:
            await self.live.address_guard().resolve_checked(*target)
        except InvalidRequest as exc:
            raise InvalidRequest(f"service address {address!r}: {exc.message}") from None
