from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, Field, TypeAdapter

from agent_reach_proto import wire
from connectors import ConnectorSet
from gateway_api.deps import (
    AgentDep,
    CapabilityPath,
    GatewayDep,
    InstanceIdPath,
    ReaderDep,
    json_body,
)
from gateway_api.routes._beats import (
    MAX_HEARTBEAT_BATCH,
    BatchBody,
    BatchResults,
    read_batch,
    results_of,
)
from reach import acceptance
from reach.errors import UnknownCapability, UnknownInstance
from reach.messages import ErrorResponse
from reach.registry import Ack, BeatEntry, HealthReport, InstanceRecord, JoinRequest
from reach.registry.by_url import Registered, UrlRegistration

router = APIRouter(prefix="/reach", tags=["agents"])


class HeartbeatAck(BaseModel):
    instance_id: str
    status: str
    heartbeat_interval: float


class CapabilitySummary(BaseModel):
    name: str
    instances: int
    routable: int


class CapabilityList(BaseModel):
    capabilities: list[CapabilitySummary]


class BreakerDetail(BaseModel):
    status: str
    failures: int
    retry_after_s: float


class PolicyDetail(BaseModel):
    """The policy state every gateway and worker shares for this capability (R14, R15)."""

    breaker: BreakerDetail
    ejected: dict[str, float] = Field(
        default_factory=dict, description="Instances out of routing, with seconds left."
    )
    limiter: dict[str, float] = Field(
        default_factory=dict, description="Tokens now in each rate-limit bucket in use."
    )


class RoutingDetail(BaseModel):
    """How the capability is routed, and its requests in flight now (R12, R17)."""

    strategy: str
    fallback: str | None = Field(
        default=None, description="Routes consistent_hash requests that carry no key."
    )
    hash_on: str | None = None
    max_inflight: int | None = Field(
        default=None, description="Configured; an instance's own (from Join), if smaller, holds."
    )
    inflight: dict[str, int] = Field(
        default_factory=dict,
        description="Calls in flight per instance, every gateway and worker together (as this "
        "gateway last read them; instances with none are left out).",
    )


class CapabilityDetail(BaseModel):
    name: str
    instances: list[InstanceRecord]
    policy: PolicyDetail | None = None
    routing: RoutingDetail | None = None
    connections: dict[str, dict[str, int]] = Field(
        default_factory=dict,
        description="This gateway process's connections to the capability's instances, per "
        "protocol: opened, reused, reconnected, reclaimed, failed (R4).",
        examples=[
            {"http": {"opened": 1, "reused": 41, "reconnected": 0, "reclaimed": 0, "failed": 0}}
        ],
    )


_ERR: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in {
        401: "Missing, invalid, expired or revoked token (when tokens are required)",
        403: "The token may not serve this capability, or another principal holds the "
        "instance_id, or it is not an agent token",
        404: "Unknown instance (join again) or capability",
        409: "Heartbeat: another process has joined under this instance_id since this "
        "X-Reach-Session's Join (instance_replaced)",
        413: "Body larger than the limit",
        422: "Invalid body, path parameter, address or protocol; registration by URL: what "
        "the instance answered cannot be joined (a malformed card or tool list, named)",
        429: "Join: the principal created registry.new_capabilities_per_minute this minute",
        500: "A bug in Reach",
        502: "Registration by URL: the instance could not be reached, or answered in error",
        503: "The registry store is unavailable, or (Join) it holds registry.max_capabilities; "
        "registration by URL: the instance did not answer in time",
    }.items()
}


_JOIN_BODY = {
    "requestBody": {
        "required": True,
        "description": "The instance's proposal (R8); for a protocol whose instances are "
        "registered by URL (a2a, mcp), the instance's URL and capability "
        "(docs/instances-by-url.md)",
        "content": {
            "application/json": {
                "schema": {
                    "anyOf": [JoinRequest.model_json_schema(), UrlRegistration.model_json_schema()]
                }
            }
        },
    }
}


@router.post(
    "/agents",
    response_model=Registered | Ack,
    responses=_ERR,
    summary="Join: register an instance (or an A2A agent or MCP server by its URL)",
    openapi_extra=_JOIN_BODY,
)
async def join(request: Request, gateway: GatewayDep, agent: AgentDep) -> Ack:
    agents = gateway.agents
    body = acceptance.join_or_registration(await request.body(), gateway.limits, agents.by_url)
    if isinstance(body, UrlRegistration):
        return await agents.remote.register(body, agent)
    return await agents.join(body, agent)


@router.put(
    "/agents/{instance_id}/heartbeat",
    response_model=HeartbeatAck,
    responses=_ERR,
    summary="Heartbeat with a health report",
    openapi_extra=json_body(
        HealthReport, "A light self-check (R21); no body means ok", required=False
    ),
)
async def heartbeat(
    instance_id: InstanceIdPath, request: Request, gateway: GatewayDep, agent: AgentDep
) -> HeartbeatAck:
    body = acceptance.health_report(await request.body(), gateway.limits)
    session = request.headers.get(wire.HTTP_SESSION)
    record = await gateway.agents.heartbeat(instance_id, body, agent, session)
    return HeartbeatAck(
        instance_id=instance_id, status=record.status, heartbeat_interval=record.heartbeat_interval
    )


@router.post(
    "/heartbeats",
    response_model=BatchResults,
    responses=_ERR,
    summary="Batched heartbeat: many instances' reports at once",
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": f"At most {MAX_HEARTBEAT_BATCH} entries, each a heartbeat of its "
            "own; a refused entry is refused alone, in its result",
            "content": {"application/json": {"schema": TypeAdapter(BatchBody).json_schema()}},
        }
    },
)
async def heartbeats(request: Request, gateway: GatewayDep, agent: AgentDep) -> BatchResults:
    read = read_batch(await request.body(), gateway.limits)
    entries = [item for item in read if isinstance(item, BeatEntry)]
    return results_of(read, await gateway.agents.heartbeats(entries, agent))


@router.delete(
    "/agents/{instance_id}", status_code=204, responses=_ERR, summary="Leave: deregister"
)
async def leave(instance_id: InstanceIdPath, gateway: GatewayDep, agent: AgentDep) -> Response:
    if not await gateway.agents.leave(instance_id, agent):
        raise UnknownInstance(f"instance {instance_id!r} is not registered")
    return Response(status_code=204)


@router.get(
    "/capabilities",
    response_model=CapabilityList,
    responses={401: _ERR[401], 403: _ERR[403], 500: _ERR[500], 503: _ERR[503]},
    summary="Capabilities and instances",
)
async def list_capabilities(gateway: GatewayDep, reader: ReaderDep) -> CapabilityList:
    out = []
    for name in await gateway.registry.capabilities():
        instances = await gateway.registry.instances(name)
        out.append(
            CapabilitySummary(
                name=name,
                instances=len(instances),
                routable=sum(1 for i in instances if i.routable),
            )
        )
    return CapabilityList(capabilities=out)


@router.get(
    "/capabilities/{name}",
    response_model=CapabilityDetail,
    responses=_ERR,
    summary="One capability",
)
async def get_capability(
    name: CapabilityPath, gateway: GatewayDep, request: Request, reader: ReaderDep
) -> CapabilityDetail:
    if not await gateway.registry.known(name):
        raise UnknownCapability(f"no agent has ever registered capability {name!r}")
    connections: ConnectorSet | None = getattr(request.app.state, "connectors", None)
    return CapabilityDetail(
        name=name,
        instances=await gateway.registry.instances(name),
        policy=await gateway.views.policy_detail(name),
        routing=await gateway.views.routing_detail(name),
        connections=connections.stats_of(name) if connections is not None else {},
    )
