"""Registry: capability -> instances + health (R2, R5, R8, R21).

Written once over `reach.store.Store`; the store backend (memory or Redis) decides where the
records live. An instance record is a key whose TTL is `heartbeat_timeout`: every heartbeat
rewrites it, silence lets it expire. The per-capability index is pruned (and the eviction logged)
the next time anyone lists the capability, or on the gateway's periodic sweep.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from reach.config import RegistrySettings, TransportSettings
from reach.errors import UnknownInstance
from reach.messages import CapabilityName
from reach.store import Store

log = logging.getLogger("reach.registry")
heartbeat_log = logging.getLogger("reach.heartbeat")

HealthStatus = Literal["ok", "degraded", "unhealthy"]
MIN_HEARTBEAT_INTERVAL_S = 0.1


class JoinRequest(BaseModel):
    """What an agent proposes when it starts (R8)."""

    model_config = ConfigDict(extra="forbid")

    capability: CapabilityName
    instance_id: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
    protocol: str = Field(default="http", pattern=r"^[a-z0-9_-]{1,32}$")
    service_address: str = Field(min_length=1, max_length=512)
    heartbeat_interval: float | None = Field(default=None, gt=0)
    operations: list[str] = Field(default_factory=list)
    max_message_bytes: int | None = Field(default=None, gt=0)
    async_callback: bool = False
    labels: dict[str, str] = Field(default_factory=dict)


class Ack(BaseModel):
    """What Reach and the agent agreed on; later messages never exceed it."""

    instance_id: str
    capability: str
    heartbeat_interval: float
    heartbeat_timeout: float
    max_message_bytes: int
    async_callback: bool


class HealthReport(BaseModel):
    """A heartbeat body: a light self-check, not just 'alive' (R21)."""

    model_config = ConfigDict(extra="forbid")

    status: HealthStatus = "ok"
    checks: dict[str, Any] = Field(default_factory=dict)
    inflight: int = Field(default=0, ge=0)


class InstanceRecord(BaseModel):
    instance_id: str
    capability: str
    protocol: str
    address: str
    operations: list[str] = Field(default_factory=list)
    max_message_bytes: int
    async_callback: bool
    heartbeat_interval: float
    labels: dict[str, str] = Field(default_factory=dict)
    status: HealthStatus = "ok"
    checks: dict[str, Any] = Field(default_factory=dict)
    inflight: int = 0
    joined_at: float
    last_seen: float

    @property
    def routable(self) -> bool:
        return self.status != "unhealthy"


def _inst_key(instance_id: str) -> str:
    return f"inst:{instance_id}"


def _cap_key(capability: str) -> str:
    return f"cap:{capability}"


CAPS_KEY = "caps"


class Registry:
    def __init__(
        self,
        store: Store,
        settings: RegistrySettings,
        transport: TransportSettings | None = None,
    ) -> None:
        self.store = store
        self.settings = settings
        self.max_message_bytes = (transport or TransportSettings()).max_message_bytes

    def negotiate(self, join: JoinRequest) -> Ack:
        timeout = self.settings.heartbeat_timeout
        proposed = join.heartbeat_interval or self.settings.heartbeat_interval
        # At least two heartbeats must fit in one timeout, or one lost packet evicts.
        interval = max(MIN_HEARTBEAT_INTERVAL_S, min(proposed, timeout / 2))
        size = min(join.max_message_bytes or self.max_message_bytes, self.max_message_bytes)
        return Ack(
            instance_id=join.instance_id,
            capability=join.capability,
            heartbeat_interval=interval,
            heartbeat_timeout=timeout,
            max_message_bytes=size,
            async_callback=join.async_callback,
        )

    async def join(self, join: JoinRequest) -> Ack:
        ack = self.negotiate(join)
        previous = await self.get(join.instance_id)
        now = time.time()
        record = InstanceRecord(
            instance_id=join.instance_id,
            capability=join.capability,
            protocol=join.protocol,
            address=join.service_address,
            operations=join.operations,
            max_message_bytes=ack.max_message_bytes,
            async_callback=ack.async_callback,
            heartbeat_interval=ack.heartbeat_interval,
            labels=join.labels,
            joined_at=now,
            last_seen=now,
        )
        if previous is not None and previous.capability != join.capability:
            await self.store.remove_member(_cap_key(previous.capability), join.instance_id)
        await self._write(record)
        await self.store.add_member(CAPS_KEY, join.capability)
        await self.store.add_member(_cap_key(join.capability), join.instance_id)
        log.info(
            "joined capability=%s instance=%s protocol=%s address=%s%s",
            join.capability,
            join.instance_id,
            join.protocol,
            join.service_address,
            " (re-join)" if previous else "",
        )
        return ack

    async def heartbeat(self, instance_id: str, report: HealthReport) -> InstanceRecord:
        record = await self.get(instance_id)
        if record is None:
            raise UnknownInstance(f"instance {instance_id!r} is not registered; join again")
        if record.status != report.status:
            log.info(
                "health instance=%s capability=%s %s -> %s checks=%s",
                instance_id,
                record.capability,
                record.status,
                report.status,
                report.checks,
            )
        record.status = report.status
        record.checks = report.checks
        record.inflight = report.inflight
        record.last_seen = time.time()
        await self._write(record)
        heartbeat_log.debug("heartbeat instance=%s status=%s", instance_id, report.status)
        return record

    async def leave(self, instance_id: str) -> bool:
        record = await self.get(instance_id)
        if record is None:
            return False
        await self.store.delete(_inst_key(instance_id))
        await self.store.remove_member(_cap_key(record.capability), instance_id)
        log.info("left capability=%s instance=%s", record.capability, instance_id)
        return True

    async def get(self, instance_id: str) -> InstanceRecord | None:
        raw = await self.store.get(_inst_key(instance_id))
        return self._parse(raw)

    async def known(self, capability: str) -> bool:
        return await self.store.is_member(CAPS_KEY, capability)

    async def capabilities(self) -> list[str]:
        return sorted(await self.store.members(CAPS_KEY))

    async def instances(self, capability: str) -> list[InstanceRecord]:
        """Live instances of a capability (healthy or not), sorted by id; prunes the evicted."""
        ids = sorted(await self.store.members(_cap_key(capability)))
        raws = await self.store.get_many([_inst_key(i) for i in ids])
        live: list[InstanceRecord] = []
        for instance_id, raw in zip(ids, raws, strict=True):
            record = self._parse(raw)
            if record is None or record.capability != capability:
                await self.store.remove_member(_cap_key(capability), instance_id)
                if record is None:
                    log.warning(
                        "evicted capability=%s instance=%s: no heartbeat for %.1fs",
                        capability,
                        instance_id,
                        self.settings.heartbeat_timeout,
                    )
                continue
            live.append(record)
        return live

    async def sweep(self) -> None:
        for capability in await self.capabilities():
            await self.instances(capability)

    async def _write(self, record: InstanceRecord) -> None:
        await self.store.put(
            _inst_key(record.instance_id),
            record.model_dump_json(),
            ttl_s=self.settings.heartbeat_timeout,
        )

    @staticmethod
    def _parse(raw: str | None) -> InstanceRecord | None:
        if raw is None:
            return None
        try:
            return InstanceRecord.model_validate_json(raw)
        except ValidationError:
            log.exception("unreadable instance record dropped")
            return None


__all__ = [
    "Ack",
    "HealthReport",
    "HealthStatus",
    "InstanceRecord",
    "JoinRequest",
    "Registry",
    "UnknownInstance",
]
