from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from pydantic import BaseModel

import connectors
from gateway_api.deps import GatewayDep
from reach.errors import InvalidRequest, UnknownCapability, UnknownInstance
from reach.registry import Ack, HealthReport, InstanceRecord, JoinRequest

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


class CapabilityDetail(BaseModel):
    name: str
    instances: list[InstanceRecord]


_ERR: dict[int | str, dict[str, Any]] = {
    404: {"description": "Unknown instance (join again) or capability"},
    422: {"description": "Invalid body or unknown protocol"},
    503: {"description": "The registry store is unavailable"},
}


@router.post("/agents", response_model=Ack, responses=_ERR, summary="Join: register an instance")
async def join(body: JoinRequest, gateway: GatewayDep) -> Ack:
    known = connectors.available()
    if body.protocol not in known:
        raise InvalidRequest(
            f"protocol {body.protocol!r} has no connector; known: {', '.join(sorted(known))}"
        )
    return await gateway.registry.join(body)


@router.put(
    "/agents/{instance_id}/heartbeat",
    response_model=HeartbeatAck,
    responses=_ERR,
    summary="Heartbeat with a health report",
)
async def heartbeat(instance_id: str, body: HealthReport, gateway: GatewayDep) -> HeartbeatAck:
    record = await gateway.registry.heartbeat(instance_id, body)
    return HeartbeatAck(
        instance_id=instance_id, status=record.status, heartbeat_interval=record.heartbeat_interval
    )


@router.delete(
    "/agents/{instance_id}", status_code=204, responses=_ERR, summary="Leave: deregister"
)
async def leave(instance_id: str, gateway: GatewayDep) -> Response:
    if not await gateway.registry.leave(instance_id):
        raise UnknownInstance(f"instance {instance_id!r} is not registered")
    return Response(status_code=204)


@router.get(
    "/capabilities",
    response_model=CapabilityList,
    responses={503: _ERR[503]},
    summary="Capabilities and instances",
)
async def list_capabilities(gateway: GatewayDep) -> CapabilityList:
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
async def get_capability(name: str, gateway: GatewayDep) -> CapabilityDetail:
    if not await gateway.registry.known(name):
        raise UnknownCapability(f"no agent has ever registered capability {name!r}")
    return CapabilityDetail(name=name, instances=await gateway.registry.instances(name))
