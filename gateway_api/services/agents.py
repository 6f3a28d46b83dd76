"""Agents: Join, heartbeat and leave, shared by the HTTP routes and the gRPC front.

With tokens required, an agent token must be allowed to serve the capability it joins, an
instance_id another principal holds is not taken over, and one nobody holds is claimed only
for a capability the token may serve, audited (`Registry.join`, `owned`).
"""

from __future__ import annotations

import connectors
from connectors import ConnectorSet
from connectors.base import Connector
from gateway_api.live import Live
from reach.errors import Forbidden, InvalidRequest, ReachError
from reach.registry import Ack, HealthReport, InstanceRecord, JoinRequest, Registry
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

    async def join(self, body: JoinRequest, principal: Principal | None = None) -> Ack:
        """Register an instance whose protocol has a connector and whose address it accepts.
        A refusal is audited (`join_refused`): a token for another capability, a takeover of
        an instance another principal holds, a forbidden address."""
        try:
            return await self._join(body, principal)
        except ReachError as exc:
            self._refused("join_refused", exc, principal, body.instance_id, body.capability)
            raise

    async def _join(self, body: JoinRequest, principal: Principal | None) -> Ack:
        may_serve(principal, body.capability)
        connector = self._connector_class(body.protocol)
        body.service_address = connector.check_address(body.service_address)
        await self._vet_address(connector, body.service_address)
        if self.connections is not None and self.live.settings.security.tls.enabled:
            # mTLS: the agent must hold a certificate from the CA for this instance_id (403).
            live = self.connections.get(body.protocol)
            await live.verify_identity(body.service_address, body.instance_id)
        owner = principal.name if principal is not None and principal.kind == "agent" else None
        admin = principal is not None and principal.kind == "admin"

        def claim(unowned: InstanceRecord) -> None:
            self._claim(unowned, principal, body)

        ack = await self.registry.join(body, owner, admin=admin, claim=claim)
        if self.guard is not None:
            self.guard.audit.record(
                "join",
                principal=principal.name if principal else None,
                capability=body.capability,
                instance=body.instance_id,
                protocol=body.protocol,
                address=body.service_address,
            )
        return ack

    def _claim(
        self, unowned: InstanceRecord, principal: Principal | None, body: JoinRequest
    ) -> None:
        """An agent token claims an instance nobody holds (joined with auth off, or by an
        admin) only for a capability it may serve, that instance's as well as the Join's; the
        claim is audited (`instance_claimed`), never silent."""
        assert principal is not None
        if not principal.may_serve(unowned.capability):
            raise Forbidden(
                f"instance_id {unowned.instance_id!r} is held by nobody, as an instance of "
                f"{unowned.capability!r}, which the token of {principal.name!r} may not serve; "
                "choose another instance_id"
            )
        if self.guard is not None:
            self.guard.audit.record(
                "instance_claimed",
                principal=principal.name,
                capability=body.capability,
                instance=body.instance_id,
                previous_capability=unowned.capability,
                previous_address=unowned.address,
            )

    def _connector_class(self, protocol: str) -> type[Connector]:
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
    ) -> InstanceRecord:
        if principal is not None and principal.kind == "agent":
            await self._owned(instance_id, principal, "heartbeat_refused")
        record = await self.registry.heartbeat(instance_id, report, session)
        if self.metrics is not None:
            self.metrics.heartbeat(record.capability, record.status)
        return record

    async def leave(self, instance_id: str, principal: Principal | None = None) -> bool:
        if principal is not None and principal.kind == "agent":
            await self._owned(instance_id, principal, "leave_refused")
        left = await self.registry.leave(instance_id)
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

    async def _vet_address(self, connector: type[Connector], address: str) -> None:
        """Every address a joining agent's host resolves to must be allowed, else 422."""
        target = connector.address_host_port(address)
        if target is None:
            return
        try:
            await self.live.address_guard().resolve_checked(*target)
        except InvalidRequest as exc:
            raise InvalidRequest(f"service address {address!r}: {exc.message}") from None
