"""FastAPI dependencies. All `async def`: FastAPI runs a plain `def` dependency in its thread
pool, a thread hop per dependency per request on the hot path."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Header, Path, Request
from pydantic import BaseModel

from gateway_api.service import Gateway
from reach import acceptance
from reach.messages import EXAMPLE_REQUEST_ID, REQUEST_ID_PATTERN

CAPABILITY_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"


async def get_gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


# The header schemas document what `reach.acceptance` enforces (with its clearer messages).
# An empty header counts as no header.
CALLER_SCHEMA = {"pattern": r"^([\x21-\x7e]{1,128})?$"}
TRACEPARENT_SCHEMA = {
    "pattern": r"^([0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[\x21-\x7e]{1,64})?)?$",
    "not": {"pattern": r"^(ff-|[0-9a-f]{2}-0{32}-|[0-9a-f]{2}-[0-9a-f]{32}-0{16}-)"},
}


async def get_caller(
    x_reach_caller: Annotated[
        str | None,
        Header(description="Who calls (visible ASCII)", json_schema_extra=CALLER_SCHEMA),
    ] = None,
) -> str:
    # Until per-principal tokens arrive (security step), the caller names itself.
    return acceptance.caller_header(x_reach_caller) or "anonymous"


async def get_traceparent(
    traceparent: Annotated[
        str | None,
        Header(description="W3C trace context", json_schema_extra=TRACEPARENT_SCHEMA),
    ] = None,
) -> str | None:
    # W3C trace context from the caller, passed on to the agent unchanged.
    return acceptance.traceparent_header(traceparent)


async def get_idempotency_key(
    idempotency_key: Annotated[
        str | None,
        # The IETF draft's header, an alias of the body's idempotency_key (documented there;
        # left out of the OpenAPI, whose schema cannot say that the two must agree).
        Header(include_in_schema=False),
    ] = None,
) -> str | None:
    return acceptance.idempotency_key_header(idempotency_key)


def json_body(model: type[BaseModel], description: str, *, required: bool = True) -> dict[str, Any]:
    """OpenAPI for a body the route reads raw and hands to `reach.acceptance`."""
    return {
        "requestBody": {
            "required": required,
            "description": description,
            "content": {"application/json": {"schema": model.model_json_schema()}},
        }
    }


GatewayDep = Annotated[Gateway, Depends(get_gateway)]
TraceparentDep = Annotated[str | None, Depends(get_traceparent)]
CallerDep = Annotated[str, Depends(get_caller)]
IdempotencyKeyDep = Annotated[str | None, Depends(get_idempotency_key)]
RequestIdPath = Annotated[
    str,
    Path(pattern=REQUEST_ID_PATTERN, description="The RequestID", examples=[EXAMPLE_REQUEST_ID]),
]
InstanceIdPath = Annotated[
    str, Path(pattern=REQUEST_ID_PATTERN, description="An instance id", examples=["retriever-01"])
]
CapabilityPath = Annotated[
    str,
    Path(pattern=CAPABILITY_PATTERN, description="A capability", examples=["knowledge-retriever"]),
]


async def require_admin(request: Request) -> None:
    """An admin token (filled in by the security work; a stub until then)."""
    return None


AdminDep = Annotated[None, Depends(require_admin)]
