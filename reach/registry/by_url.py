"""Instances registered by URL (A2A agents, MCP servers): what is registered, and the pure
decisions around it.

Such an instance does not Join or heartbeat. It is registered by URL (`POST /reach/agents`,
`reach.yaml` `agents:`, `reach agents add`); the gateway asks its protocol's connector what it
serves (`Connector.discover` -> `Discovery`) and joins it in the registry with those
operations; a probe in every gateway discovers it again each heartbeat_interval and heartbeats
it while it answers (`gateway_api.prober`). The registration itself is kept apart from the
instance's record, in a long-lived hash of the store (`REGISTRATIONS_KEY`): the record expires
when probes fail like a silent agent's, the registration stays, and the instance joins again
when a probe reaches it. Only `DELETE /reach/agents/{id}` removes a registration.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from reach.errors import InvalidRequest
from reach.messages import CapabilityName, InstanceId, JsonInt
from reach.registry.models import (
    Ack,
    Discovery,
    InstanceRecord,
    JoinRequest,
    LabelKey,
    LabelValue,
    OperationDeclaration,
    OperationEntry,
)

REGISTRATIONS_KEY = "url-instances"
"""The store hash of every registration by URL: instance_id -> `Registration` as JSON."""

MAX_DETAILS_BYTES = 8 * 1024
"""Most a discovery's `details` may weigh as JSON: they are in every record and every
request's endpoint."""

MAX_REGISTRATIONS = 10_000
"""Most instances registered by URL at once (every gateway probes each)."""


class UrlRegistration(BaseModel):
    """`POST /reach/agents` for a protocol whose instances are registered by URL (A2A, MCP):
    the instance's URL and the capability it serves; what it serves is discovered."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "protocol": "a2a",
                    "service_address": "https://agents.example.com/travel",
                    "capability": "travel-planner",
                    "operations": [{"name": "book", "idempotent": False}],
                }
            ]
        },
    )

    capability: CapabilityName
    protocol: str = Field(pattern=r"^[a-z0-9_-]{1,32}$")
    service_address: str = Field(
        min_length=1,
        max_length=2048,
        pattern=r"^[\x21-\x7e]+$",
        description="The instance's URL (an A2A agent's base URL, an MCP server's endpoint), "
        "checked by the protocol's connector.",
    )
    instance_id: InstanceId | None = Field(
        default=None,
        description="Derived from the protocol and the URL when absent: the same URL, the same id.",
    )
    operations: list[OperationEntry] = Field(
        default_factory=list,
        max_length=256,
        description="Declarations over what discovery finds, per name (e.g. idempotent); a "
        "name discovery does not find is kept for when it does.",
    )
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32)
    weight: JsonInt = Field(default=1, ge=1, le=1000)
    max_inflight: JsonInt | None = Field(default=None, ge=1, le=1_000_000)

    @classmethod
    def from_join(cls, join: JoinRequest) -> UrlRegistration:
        """A Join (the gRPC front's) naming a protocol registered by URL, as a registration:
        its operations are declarations over what discovery finds."""
        return cls(
            capability=join.capability,
            protocol=join.protocol,
            service_address=join.service_address,
            instance_id=join.instance_id,
            operations=join.operations,
            labels=join.labels,
            weight=join.weight,
            max_inflight=join.max_inflight,
        )

    @field_validator("operations")
    @classmethod
    def _each_name_once(
        cls, operations: list[str | OperationDeclaration]
    ) -> list[str | OperationDeclaration]:
        names = [entry if isinstance(entry, str) else entry.name for entry in operations]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"operation {twice[0]!r} is listed more than once")
        return operations


class Registration(BaseModel):
    """A registration as the store keeps it (the address checked, the id settled)."""

    instance_id: str
    capability: str
    protocol: str
    address: str
    operations: list[OperationEntry] = Field(default_factory=list)
    labels: dict[str, str] = Field(default_factory=dict)
    weight: int = 1
    max_inflight: int | None = None
    principal: str | None = None
    source: Literal["api", "config"] = "api"
    registered_at: float = 0.0


class Registered(Ack):
    """What `POST /reach/agents` answers for an instance registered by URL: the Ack, and what
    discovery found (the operations as joined, overrides applied, and the details)."""

    registered_by_url: bool = True
    protocol: str
    address: str
    operations: list[OperationDeclaration]
    details: dict[str, Any] = Field(default_factory=dict)


def instance_id_for(protocol: str, address: str) -> str:
    """A stable instance id for an instance registered by URL: the protocol, the URL's host
    and a digest of both (the same URL, the same id; another path on the same host, another)."""
    host = urlsplit(address).hostname or ""
    host = re.sub(r"[^A-Za-z0-9.-]+", "-", host).strip(".-")[:64]
    digest = hashlib.sha256(f"{protocol} {address}".encode()).hexdigest()[:12]
    return "-".join(part for part in (protocol.strip("_-") or "url", host, digest) if part)


def merged_operations(
    discovered: Sequence[OperationDeclaration], overrides: Sequence[str | OperationDeclaration]
) -> list[OperationDeclaration]:
    """The discovered operations, each with what an override of the same name says over it
    (what the override leaves unsaid stays as discovered). An override naming an operation
    discovery did not find adds nothing: Reach does not route to what the instance lacks."""
    said = {
        entry.name: entry.model_dump(exclude={"name"}, exclude_none=True)
        for entry in overrides
        if isinstance(entry, OperationDeclaration)
    }
    return [op.model_copy(update=said[op.name]) if said.get(op.name) else op for op in discovered]


def join_request(registration: Registration, discovery: Discovery) -> JoinRequest:
    """The Join an instance registered by URL makes, as discovery found it: InvalidRequest
    naming what is wrong when what was found cannot be joined."""
    size = len(json.dumps(discovery.details, separators=(",", ":"), default=str))
    if size > MAX_DETAILS_BYTES:
        raise InvalidRequest(
            f"{registration.protocol} instance at {registration.address}: its discovery details "
            f"are {size} bytes as JSON; at most {MAX_DETAILS_BYTES}"
        )
    try:
        return JoinRequest(
            capability=registration.capability,
            instance_id=registration.instance_id,
            protocol=registration.protocol,
            service_address=registration.address,
            operations=list(merged_operations(discovery.operations, registration.operations)),
            labels=registration.labels,
            weight=registration.weight,
            max_inflight=registration.max_inflight,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise InvalidRequest(
            f"{registration.protocol} instance at {registration.address}: what discovery found "
            f"cannot be joined: {where}: {first['msg']}"
        ) from None


def known_discovery(record: InstanceRecord) -> Discovery:
    """The last discovery of an instance registered by URL, as its record keeps it: what the
    next probe passes to `Connector.discover` (its version and ETag ask conditionally)."""
    return Discovery(
        operations=[
            record.declared.get(name) or OperationDeclaration(name=name)
            for name in record.operations
        ],
        version=record.discovery_version or "",
        etag=record.discovery_etag,
        details=dict(record.details),
    )


def probe_due(record: InstanceRecord | None, now: float, interval_s: float) -> bool:
    """Whether a probe should run now: the instance is not joined (it comes back when one
    succeeds), or its last heartbeat is at least half an interval old (another gateway's probe
    of the last half interval is enough: several gateways do not probe it each in turn)."""
    return record is None or now - record.last_seen >= interval_s / 2


def changed(record: InstanceRecord, discovery: Discovery) -> bool:
    """Whether a discovery serves something other than what the record holds: another
    version, or (a protocol that names no version) other operations or details."""
    if discovery.version or record.discovery_version:
        return discovery.version != (record.discovery_version or "")
    names = [op.name for op in discovery.operations]
    return names != record.operations or discovery.details != record.details


__all__ = [
    "MAX_DETAILS_BYTES",
    "MAX_REGISTRATIONS",
    "REGISTRATIONS_KEY",
    "Registered",
    "Registration",
    "UrlRegistration",
    "changed",
    "instance_id_for",
    "join_request",
    "known_discovery",
    "merged_operations",
    "probe_due",
]
